"""A tiny LightningModule for checkpoint scenarios: data-parallel FSDP2 under ModelParallelStrategy,
a plain module on one device."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sharded import ShardedStateMixin


class TinyModel(L.LightningModule):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(self.net, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g))
        return DataLoader(data, batch_size=4)


class TinyShardedModel(ShardedStateMixin, TinyModel):
    """The same model with the library's mixin (``load_from_checkpoint`` accepts directories)."""
