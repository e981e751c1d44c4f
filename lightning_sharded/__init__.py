"""lightning_sharded: sharded state that survives PyTorch Lightning checkpoints.

Importing the package is silent and imports no torch: every public name loads on first access, the
mixin and the hooks with torch and ``torch.distributed.tensor`` (about 1.2 s on a 2-core machine, 0.8
s of it torch), the checkpoint tools and their result types (0.15 s more), the strategies with
Lightning (1.6 s more), the legacy ShardedTensor support only where it is used. So the command line's
``verify`` of a checkpoint of tensors and plain data runs without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_sharded._lazy import lazy_attributes
from lightning_sharded._registry import install as _install_strategy_names
from lightning_sharded.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from lightning_sharded.checkpoint.tools import (
        CheckpointInfo,
        EntryInfo,
        consolidate_checkpoint,
        inspect_checkpoint,
        load_checkpoint,
    )
    from lightning_sharded.checkpoint.tools.pretrained import PretrainedKeys, load_pretrained
    from lightning_sharded.checkpoint.verify import VerifyReport, verify_checkpoint
    from lightning_sharded.hooks import has_sharded_state_hooks, register_sharded_state_hooks
    from lightning_sharded.mixin import ShardedStateMixin
    from lightning_sharded.strategies import ShardedFSDPStrategy, ShardedModelParallelStrategy
    from lightning_sharded.user_state import register_rank_state

__version__ = "0.1.0"

# Public names loaded on first access, and the module each comes from.
_LAZY = {
    "ShardedStateMixin": "lightning_sharded.mixin",
    **dict.fromkeys(("has_sharded_state_hooks", "register_sharded_state_hooks"), "lightning_sharded.hooks"),
    "register_rank_state": "lightning_sharded.user_state",
    "ShardedFSDPStrategy": "lightning_sharded.strategies.fsdp",
    "ShardedModelParallelStrategy": "lightning_sharded.strategies.model_parallel",
    **dict.fromkeys(("PretrainedKeys", "load_pretrained"), "lightning_sharded.checkpoint.tools.pretrained"),
    "EntryInfo": "lightning_sharded.checkpoint.tools",
    # the checkpoint package's own lazy exports
    **dict.fromkeys(
        (
            "CheckpointInfo",
            "VerifyReport",
            "consolidate_checkpoint",
            "inspect_checkpoint",
            "load_checkpoint",
            "verify_checkpoint",
        ),
        "lightning_sharded.checkpoint",
    ),
}


__getattr__ = lazy_attributes(__name__, _LAZY, globals())
# `Trainer(strategy="sharded_fsdp")`: the names go into Lightning's registry once it is imported.
_install_strategy_names()

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "EntryInfo",
    "PretrainedKeys",
    "ShardedFSDPStrategy",
    "ShardedModelParallelStrategy",
    "ShardedStateMixin",
    "VerifyReport",
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
