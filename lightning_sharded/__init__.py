"""lightning_sharded: sharded state that survives PyTorch Lightning checkpoints.

Importing the package is cheap and silent: the legacy ShardedTensor support is imported lazily, and
the strategies and checkpoint tools (which import Lightning and torch.distributed.checkpoint,
seconds) load on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.hooks import has_sharded_state_hooks, register_sharded_state_hooks
from lightning_sharded.mixin import ShardedStateMixin

if TYPE_CHECKING:
    from lightning_sharded.checkpoint.tools import consolidate_checkpoint, inspect_checkpoint, load_checkpoint
    from lightning_sharded.checkpoint.verify import verify_checkpoint
    from lightning_sharded.strategies import ShardedFSDPStrategy, ShardedModelParallelStrategy

__version__ = "0.1.0"

# Public names loaded on first access, and the module each comes from.
_LAZY = {
    "ShardedFSDPStrategy": "lightning_sharded.strategies.fsdp",
    "ShardedModelParallelStrategy": "lightning_sharded.strategies.model_parallel",
    "consolidate_checkpoint": "lightning_sharded.checkpoint.tools",
    "inspect_checkpoint": "lightning_sharded.checkpoint.tools",
    "load_checkpoint": "lightning_sharded.checkpoint.tools",
    "verify_checkpoint": "lightning_sharded.checkpoint.verify",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "register_sharded_state_hooks",
    "verify_checkpoint",
]
