"""Everything about checkpoint files: formats, loading and saving through
``torch.distributed.checkpoint``, manifests, atomic commits and the single-process tools."""

from __future__ import annotations

from lightning_sharded.checkpoint.atomic import commit_directory, commit_file, remove_checkpoint, resolve
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.manifest import MANIFEST_NAME, Manifest, read_manifest
from lightning_sharded.checkpoint.tools import (
    CheckpointInfo,
    consolidate_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
)
from lightning_sharded.checkpoint.verify import VerifyReport, check_files, verify_checkpoint

__all__ = [
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointInfo",
    "Manifest",
    "VerifyReport",
    "check_files",
    "commit_directory",
    "commit_file",
    "consolidate_checkpoint",
    "inspect_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "remove_checkpoint",
    "resolve",
    "verify_checkpoint",
]
