"""Lightning strategies that restore sharded checkpoints after setup: FSDP1 and FSDP2/DTensor."""

from __future__ import annotations

from lightning_sharded.strategies.fsdp import ShardedFSDPStrategy
from lightning_sharded.strategies.model_parallel import ShardedModelParallelStrategy

__all__ = ["ShardedFSDPStrategy", "ShardedModelParallelStrategy"]
