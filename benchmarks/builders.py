"""The model, the strategies and the trainers every Lightning case of the benchmarks uses.

The model is ``layers`` bias-free ``Linear(width, width)`` with Adam, so a checkpoint is the weights
plus two Adam moments (:func:`geometry` picks the size); the strategies are stock Lightning's two
(FSDP1 through a subclass that runs on CPU) and ours, by the case names of :data:`STRATEGIES`.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from benchmarks.world import world_size

#: The ranks of every Lightning case.
WORLD = 2
#: Training steps of each fit before its saves.
STEPS = 1
#: The strategies by case name.
STRATEGIES = ("stock-mp", "stock-fsdp", "ours-mp", "ours-fsdp")


def geometry(size_gb: float) -> tuple[int, int]:
    """(width, layers) of a model whose checkpoint (weights plus two Adam moments) is ``size_gb``."""
    width = 4096 if size_gb >= 0.5 else 512
    layers = max(2, round(size_gb * 1e9 / (12 * width * width)))
    return width, layers


class BenchModel(L.LightningModule):
    """``layers`` bias-free ``Linear(width, width)``; FSDP2 shards each in ``configure_model``."""

    def __init__(self, width: int, layers: int, shard_layers: bool) -> None:
        super().__init__()
        self.width = width
        self.shard_layers = shard_layers
        self.layers = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])

    def configure_model(self) -> None:
        if not self.shard_layers or self._device_mesh is None:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.layers[0], FSDPModule):
            return
        mesh = self._device_mesh["data_parallel"]
        for layer in self.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.layers(batch[0]).square().mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(torch.randn(8, self.width)), batch_size=2)


class Rows(Dataset[tuple[torch.Tensor]]):
    """The same random row, as often as a long fit asks (a compute-bound step needs no real data)."""

    def __init__(self, width: int) -> None:
        self.row = torch.randn(width)

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        return (self.row,)


class ThroughputModel(BenchModel):
    """:class:`BenchModel` whose step runs a batch of ``batch`` rows: the step is matmul-bound."""

    def __init__(self, width: int, layers: int, shard_layers: bool, batch: int) -> None:
        super().__init__(width, layers, shard_layers)
        self.batch = batch

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Rows(self.width), batch_size=self.batch)


class StockCpuFSDP(FSDPStrategy):
    """Stock ``FSDPStrategy``; the subclass passes the GPU check, and the wrap gets ``device_id=cpu``."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


def shards_layers(strategy: str) -> bool:
    """Whether the model applies ``fully_shard`` itself under ``strategy`` (the ModelParallel ones)."""
    return strategy.endswith("mp")


def make_strategy(name: str, world: int, **options: Any) -> Any:
    """The strategy of case ``name`` (one of :data:`STRATEGIES`) for ``world`` ranks; ``options`` go to
    ours (``async_save``, ``verify``)."""
    wrap: set[type[nn.Module]] = {nn.Linear}
    if name == "stock-mp":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    if name == "stock-fsdp":
        return StockCpuFSDP(auto_wrap_policy=wrap, state_dict_type="sharded")
    import lightning_sharded

    if name == "ours-mp":
        return lightning_sharded.ShardedModelParallelStrategy(
            data_parallel_size=world, tensor_parallel_size=1, **options
        )
    if name == "ours-fsdp":
        return lightning_sharded.ShardedFSDPStrategy(auto_wrap_policy=wrap, **options)
    raise SystemExit(f"unknown strategy {name!r}")


def trainer_for(strategy: Any, callbacks: list[Any] | None = None) -> L.Trainer:
    """A CPU ``Trainer`` on every rank of the job: :data:`STEPS` steps, no logger, no checkpoints of its
    own, nothing printed."""
    return L.Trainer(
        accelerator="cpu",
        devices=world_size(),
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks or [],
    )
