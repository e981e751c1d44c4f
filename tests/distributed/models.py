"""Models the multi-process scenarios train: FSDP-sharded layers, a DTensor table, a ShardedTensor cache.

Every rank builds the same initial values from a fixed seed; training changes the weights (Adam) and
the sharded attributes (a deterministic in-place update per step), so a restored value can only equal
the saved one if it was really restored.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, DIM = 12, 8


def _table_values() -> torch.Tensor:
    return torch.arange(VOCAB * DIM, dtype=torch.float32).reshape(VOCAB, DIM) / 10


class ShardedModel(L.LightningModule):
    """Two linear layers, a ``DTensor`` table (Shard(0)) and optionally a ``ShardedTensor`` cache.

    Args:
        sharded_tensor: add a legacy ``ShardedTensor`` attribute (FSDP1 scenarios).
        shard_layers: apply ``fully_shard`` to the layers in ``configure_model`` when a device mesh is
            available (ModelParallel scenarios without a policy).
        table: add the DTensor table (needs a process group).
        hidden: width of the hidden layer (another width makes a checkpoint not fit).
        extra: add a buffer ``extra`` that no checkpoint has.
    """

    def __init__(
        self,
        sharded_tensor: bool = False,
        shard_layers: bool = True,
        table: bool = True,
        hidden: int = 16,
        extra: bool = False,
    ) -> None:
        super().__init__()
        self.sharded_tensor = sharded_tensor
        self.shard_layers = shard_layers
        self.use_table = table
        torch.manual_seed(0)
        self.layer1 = nn.Linear(DIM, hidden)
        self.layer2 = nn.Linear(hidden, 4)
        if extra:
            self.register_buffer("extra", torch.full((2,), 7.0))
        self.table: Any = None
        self.cache: Any = None

    def configure_model(self) -> None:
        if not dist.is_initialized():
            # One plain process: the table is an ordinary buffer under the same key.
            if self.use_table and self.table is None:
                del self.table
                self.register_buffer("table", _table_values())
            if self.sharded_tensor and self.cache is None:
                del self.cache
                self.register_buffer("cache", torch.zeros(6, 3))
            return
        world = dist.get_world_size()
        if self.use_table and self.table is None:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            mesh = init_device_mesh(device, (world,))
            table = _table_values().to(device)
            self.table = distribute_tensor(table, mesh, [Shard(0)], src_data_rank=None)
        if self.sharded_tensor and self.cache is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                from torch.distributed._shard import sharded_tensor
                from torch.distributed._shard.sharding_spec import ChunkShardingSpec

                spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
                self.cache = sharded_tensor.zeros(spec, 6, 3)
        if self.shard_layers and self._device_mesh is not None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if not isinstance(self.layer1, FSDPModule):
                mesh = self._device_mesh["data_parallel"]
                fully_shard(self.layer1, mesh=mesh)
                fully_shard(self.layer2, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.relu(self.layer1(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).pow(2).mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            if self.table is not None:
                local = self.table.to_local() if hasattr(self.table, "to_local") else self.table
                local.add_(1.0)
            if hasattr(self.cache, "local_shards"):  # a ShardedTensor (itself a torch.Tensor subclass)
                for shard in self.cache.local_shards():
                    shard.tensor.add_(0.5)
            elif self.cache is not None:
                self.cache.add_(0.5)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        self.log("val_loss", self(x).pow(2).mean(), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        self.log("test_loss", self(x).pow(2).mean(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def _loader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(32, DIM, generator=generator)), batch_size=4)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()


class TwoOptimizerModel(ShardedModel):
    """The same model with two Adam optimizers (manual optimization), for the optimizer-count error."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        for opt in self.optimizers():
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
        return loss

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.Adam(self.layer1.parameters(), lr=0.01),
            torch.optim.Adam(self.layer2.parameters(), lr=0.01),
        ]
