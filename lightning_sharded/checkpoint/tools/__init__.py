"""Single-process tools: load, consolidate and inspect a checkpoint without any process group."""

from __future__ import annotations

from lightning_sharded.checkpoint.tools.consolidate import consolidate_checkpoint
from lightning_sharded.checkpoint.tools.frozen import load_checkpoint
from lightning_sharded.checkpoint.tools.inspect import CheckpointInfo, EntryInfo, inspect_checkpoint

__all__ = ["CheckpointInfo", "EntryInfo", "consolidate_checkpoint", "inspect_checkpoint", "load_checkpoint"]
