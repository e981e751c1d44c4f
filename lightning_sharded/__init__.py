"""lightning_sharded: sharded state that survives PyTorch Lightning checkpoints.

Importing the package is cheap and silent: the legacy ShardedTensor support is imported lazily, and
the strategies and checkpoint tools (which import Lightning and torch.distributed.checkpoint,
seconds) load on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_sharded._lazy import lazy_attributes
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.hooks import has_sharded_state_hooks, register_sharded_state_hooks
from lightning_sharded.mixin import ShardedStateMixin
from lightning_sharded.user_state import register_rank_state

if TYPE_CHECKING:
    from lightning_sharded.checkpoint.tools import consolidate_checkpoint, inspect_checkpoint, load_checkpoint
    from lightning_sharded.checkpoint.tools.pretrained import load_pretrained
    from lightning_sharded.checkpoint.verify import verify_checkpoint
    from lightning_sharded.strategies import ShardedFSDPStrategy, ShardedModelParallelStrategy

__version__ = "0.1.0"

# Public names loaded on first access, and the module each comes from.
_LAZY = {
    "ShardedFSDPStrategy": "lightning_sharded.strategies.fsdp",
    "ShardedModelParallelStrategy": "lightning_sharded.strategies.model_parallel",
    "load_pretrained": "lightning_sharded.checkpoint.tools.pretrained",
    # the checkpoint package's own lazy exports
    **dict.fromkeys(
        ("consolidate_checkpoint", "inspect_checkpoint", "load_checkpoint", "verify_checkpoint"),
        "lightning_sharded.checkpoint",
    ),
}


__getattr__ = lazy_attributes(__name__, _LAZY, globals())

__all__ = [
    "CheckpointError",
    "ShardedFSDPStrategy",
    "ShardedModelParallelStrategy",
    "ShardedStateMixin",
    "__version__",
    "consolidate_checkpoint",
    "has_sharded_state_hooks",
    "inspect_checkpoint",
    "load_checkpoint",
    "load_pretrained",
    "register_rank_state",
    "register_sharded_state_hooks",
    "verify_checkpoint",
]
