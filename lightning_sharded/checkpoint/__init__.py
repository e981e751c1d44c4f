"""Everything about checkpoint files: what is at a path (``detect``), the commit protocol over two
backends (local paths, fsspec URLs), saving and loading through ``torch.distributed.checkpoint``,
manifests, checks and the single-process tools. See ``docs/architecture.md`` for the layout.

Only :class:`CheckpointError` is imported with the package; the rest loads on first access, so that
``import lightning_sharded`` does not import ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_sharded._lazy import lazy_attributes
from lightning_sharded.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from lightning_sharded.checkpoint.backends import ChecksummingWriter, read_manifest
    from lightning_sharded.checkpoint.commit import commit_directory, commit_file, remove_checkpoint, resolve
    from lightning_sharded.checkpoint.integrity import check_files
    from lightning_sharded.checkpoint.manifest import Manifest
    from lightning_sharded.checkpoint.names import MANIFEST_NAME
    from lightning_sharded.checkpoint.tools import (
        CheckpointInfo,
        consolidate_checkpoint,
        inspect_checkpoint,
        load_checkpoint,
    )
    from lightning_sharded.checkpoint.verify import VerifyReport, verify_checkpoint

_LAZY = {
    "MANIFEST_NAME": "lightning_sharded.checkpoint.names",
    "Manifest": "lightning_sharded.checkpoint.manifest",
    "read_manifest": "lightning_sharded.checkpoint.backends",
    "commit_directory": "lightning_sharded.checkpoint.commit",
    "commit_file": "lightning_sharded.checkpoint.commit",
    "remove_checkpoint": "lightning_sharded.checkpoint.commit",
    "resolve": "lightning_sharded.checkpoint.commit",
    "ChecksummingWriter": "lightning_sharded.checkpoint.backends.dcp_writer",
    "CheckpointInfo": "lightning_sharded.checkpoint.tools",
    "consolidate_checkpoint": "lightning_sharded.checkpoint.tools",
    "inspect_checkpoint": "lightning_sharded.checkpoint.tools",
    "load_checkpoint": "lightning_sharded.checkpoint.tools",
    "VerifyReport": "lightning_sharded.checkpoint.verify",
    "check_files": "lightning_sharded.checkpoint.integrity",
    "verify_checkpoint": "lightning_sharded.checkpoint.verify",
}


__getattr__ = lazy_attributes(__name__, _LAZY, globals())

__all__ = [
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointInfo",
    "ChecksummingWriter",
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
