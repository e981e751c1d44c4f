"""lightning_sharded: sharded state that survives PyTorch Lightning checkpoints.

Importing the package is cheap and silent: the legacy ShardedTensor support is imported lazily and
the strategies and checkpoint tools are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.hooks import has_sharded_state_hooks, register_sharded_state_hooks
from lightning_sharded.mixin import ShardedStateMixin

__version__ = "0.1.0"

if TYPE_CHECKING:
    from lightning_sharded.strategies import ShardedFSDPStrategy, ShardedModelParallelStrategy

# Importing the strategies imports Lightning (seconds); they load on first access instead.
_LAZY = {
    "ShardedFSDPStrategy": "lightning_sharded.strategies.fsdp",
    "ShardedModelParallelStrategy": "lightning_sharded.strategies.model_parallel",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

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
    "has_sharded_state_hooks",
    "register_sharded_state_hooks",
]
