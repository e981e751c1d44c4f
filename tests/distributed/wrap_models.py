"""A model that keeps sharded state where real models keep it, under every wrapping torch and Lightning use.

``WrapModel`` holds a ``DTensor`` ``table`` and a ``ShardedTensor`` ``cache`` at three places: the root,
the block ``enc.block`` (the module that gets wrapped), and ``enc.block.sub``, a block inside it (wrapped
too by the nested wrappings). Both are created in ``configure_model``, as models usually do, and
change at every step, so a restored value equals the saved one only if it was restored.

Wrappings (``WRAPPINGS``): under ``ShardedFSDPStrategy`` ``fsdp`` (the root only), ``fsdp-wrap``
(auto-wrap of Block and Sub), ``fsdp-ac`` (auto-wrap of Block, activation checkpointing of Block and
Sub); under ``ShardedModelParallelStrategy`` (FSDP2, applied in ``configure_model``) ``mp``
(``fully_shard`` of Sub, Block, root), ``mp-ac`` (``checkpoint_wrapper`` before ``fully_shard``),
``mp-compile`` (``torch.compile`` of the sharded block) and ``mp-nested`` (``torch.compile`` of a
checkpoint-wrapped, sharded block, Sub checkpoint-wrapped as well).
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy, ShardedStateMixin
from tests._compare import full_values

DIM = 8
WRAPPINGS = ("fsdp", "fsdp-wrap", "fsdp-ac", "mp", "mp-ac", "mp-compile", "mp-nested")
PLACES = {"root": "", "block": "enc.block.", "sub": "enc.block.sub."}


class Sub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.table: Any = None
        self.cache: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.sub = Sub()
        self.table: Any = None
        self.cache: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub(torch.relu(self.lin(x)))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.block(x))


def strategy_for(wrapping: str, world: int) -> Any:
    if wrapping == "fsdp":
        return ShardedFSDPStrategy()
    if wrapping == "fsdp-wrap":
        return ShardedFSDPStrategy(auto_wrap_policy={Block, Sub})
    if wrapping == "fsdp-ac":
        return ShardedFSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block, Sub})
    if wrapping.startswith("mp"):
        return ShardedModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    raise SystemExit(f"unknown wrapping {wrapping}")


def _initial(place: str, rows: int, cols: int) -> torch.Tensor:
    offset = {"root": 0.0, "block": 100.0, "sub": 200.0}[place]
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) / 10 + offset


class WrapModel(ShardedStateMixin, L.LightningModule):
    def __init__(self, wrapping: str = "mp") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wrapping = wrapping
        torch.manual_seed(0)
        self.enc = Encoder()
        self.head = nn.Linear(DIM, 2)
        self.table: Any = None
        self.cache: Any = None

    def holders(self) -> dict[str, nn.Module]:
        """The module at each place, found by type through any wrapper."""
        block = next(m for m in self.modules() if isinstance(m, Block))
        sub = next(m for m in self.modules() if isinstance(m, Sub))
        return {"root": self, "block": block, "sub": sub}

    def configure_model(self) -> None:
        if not dist.is_initialized():
            return  # one plain process (load_from_checkpoint): the sharded attributes stay None
        world = dist.get_world_size()
        for place, holder in self.holders().items():
            if holder.table is None:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.tensor import Shard, distribute_tensor

                mesh = init_device_mesh("cpu", (world,))
                holder.table = distribute_tensor(
                    _initial(place, 4, DIM), mesh, [Shard(0)], src_data_rank=None
                )
            if holder.cache is None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    from torch.distributed._shard import sharded_tensor
                    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

                    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
                    holder.cache = sharded_tensor.zeros(spec, 6, 3)
        if self.wrapping.startswith("mp"):
            self._wrap_fsdp2()

    def _wrap_fsdp2(self) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        block = self.enc.block
        if self.wrapping in ("mp-ac", "mp-nested"):
            block.sub = checkpoint_wrapper(block.sub)
        fully_shard(block.sub, mesh=mesh)
        if self.wrapping == "mp-ac":
            block = checkpoint_wrapper(block)
        fully_shard(block, mesh=mesh)
        if self.wrapping == "mp-compile":
            block = torch.compile(block, backend="eager")
        if self.wrapping == "mp-nested":
            block = torch.compile(checkpoint_wrapper(block), backend="eager")
        self.enc.block = block
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).pow(2).mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for index, holder in enumerate(self.holders().values()):
                holder.table.to_local().add_(1.0 + index)
                for shard in holder.cache.local_shards():
                    shard.tensor.add_(0.5 + index)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(16, DIM, generator=generator)), batch_size=4)


def full_state_values(trainer: L.Trainer, skip: Any) -> dict[str, Any]:
    """``global_step``, the model's keys, and its full model and optimizer state, for exact comparisons.

    Args:
        trainer: A fitted (or fitting) Trainer; collective over its ranks.
        skip: ``skip(key)`` is true for model keys the caller records itself (the sharded attributes).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    root = trainer.strategy.model
    values: dict[str, Any] = {"global_step": trainer.global_step, "keys": sorted(get_model_state_dict(root))}
    values.update(full_values(root, trainer.optimizers, skip))
    return values
