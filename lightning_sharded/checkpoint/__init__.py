"""Everything about checkpoint files: formats, loading and saving through
``torch.distributed.checkpoint``, manifests, atomic commits and the single-process tools."""

from __future__ import annotations

from lightning_sharded.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
