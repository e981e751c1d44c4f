"""Single-process tools: load, consolidate and inspect a checkpoint without any process group."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_sharded._lazy import lazy_attributes

if TYPE_CHECKING:
    from lightning_sharded.checkpoint.tools.consolidate import consolidate_checkpoint
    from lightning_sharded.checkpoint.tools.frozen import load_checkpoint
    from lightning_sharded.checkpoint.tools.inspect import CheckpointInfo, EntryInfo, inspect_checkpoint

__all__ = ["CheckpointInfo", "EntryInfo", "consolidate_checkpoint", "inspect_checkpoint", "load_checkpoint"]

# Loaded on first access: load_checkpoint imports torch, which inspect, and consolidate of most
# checkpoints, do not need.
__getattr__ = lazy_attributes(
    __name__,
    {
        "consolidate_checkpoint": "lightning_sharded.checkpoint.tools.consolidate",
        "load_checkpoint": "lightning_sharded.checkpoint.tools.frozen",
        **dict.fromkeys(
            ("CheckpointInfo", "EntryInfo", "inspect_checkpoint"),
            "lightning_sharded.checkpoint.tools.inspect",
        ),
    },
    globals(),
)
