"""Everything about checkpoint files: what is at a path (``detect``), the commit protocol over two
backends (local paths, fsspec URLs), saving and loading through ``torch.distributed.checkpoint``,
manifests, checks and the single-process tools. See ``docs/architecture.md`` for the layout.

Only :class:`CheckpointError` is imported with the package; the rest loads on first access, so that
``import lightning_sharded`` does not import ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_sharded.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from lightning_sharded.checkpoint.backends.dcp_writer import ChecksummingWriter
    from lightning_sharded.checkpoint.commit import commit_directory, commit_file, remove_checkpoint, resolve
    from lightning_sharded.checkpoint.detect import read_manifest
    from lightning_sharded.checkpoint.manifest import Manifest
    from lightning_sharded.checkpoint.names import MANIFEST_NAME
    from lightning_sharded.checkpoint.tools import (
        CheckpointInfo,
        consolidate_checkpoint,
        inspect_checkpoint,
        load_checkpoint,
    )
    from lightning_sharded.checkpoint.verify import VerifyReport, check_files, verify_checkpoint

_LAZY = {
    "MANIFEST_NAME": "names",
    "Manifest": "manifest",
    "read_manifest": "detect",
    "commit_directory": "commit",
    "commit_file": "commit",
    "remove_checkpoint": "commit",
    "resolve": "commit",
    "ChecksummingWriter": "backends.dcp_writer",
    "CheckpointInfo": "tools",
    "consolidate_checkpoint": "tools",
    "inspect_checkpoint": "tools",
    "load_checkpoint": "tools",
    "VerifyReport": "verify",
    "check_files": "verify",
    "verify_checkpoint": "verify",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
