"""lightning_sharded: sharded state that survives PyTorch Lightning checkpoints.

Importing the package is cheap and silent: the legacy ShardedTensor support is imported lazily and
the strategies and checkpoint tools are loaded on first use.
"""

from __future__ import annotations

from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.hooks import has_sharded_state_hooks, register_sharded_state_hooks
from lightning_sharded.mixin import ShardedStateMixin

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ShardedStateMixin",
    "__version__",
    "has_sharded_state_hooks",
    "register_sharded_state_hooks",
]
