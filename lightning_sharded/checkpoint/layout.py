"""What is at a checkpoint path: a sharded directory, a full file, or an error that says why not.

A sharded checkpoint directory holds the files ``torch.distributed.checkpoint`` writes (shard files
``__<rank>_<i>.distcp`` and :data:`DCP_METADATA`), Lightning's :data:`LIGHTNING_METADATA` with the
rest of the Lightning checkpoint (epoch, global step, loops, callbacks...) and, when this library
wrote it, the manifest. A full checkpoint is one ``torch.save`` file.
"""

from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path

from lightning_sharded.checkpoint import storage
from lightning_sharded.checkpoint.atomic import resolve
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.manifest import MANIFEST_NAME

__all__ = [
    "DCP_METADATA",
    "LIGHTNING_METADATA",
    "MODEL_KEYS",
    "CheckpointKind",
    "checkpoint_kind",
    "not_a_checkpoint",
]

#: The file in which ``torch.distributed.checkpoint`` describes every entry and where its bytes are.
DCP_METADATA = ".metadata"
#: The file in which Lightning saves the non-sharded part of the checkpoint.
LIGHTNING_METADATA = "meta.pt"
#: Top-level DCP keys holding the model's state: stock ``FSDPStrategy`` writes ``model``, stock
#: ``ModelParallelStrategy`` writes ``state_dict``.
MODEL_KEYS = ("state_dict", "model")
#: Top-level DCP keys holding the optimizers' states: ``optimizer_0``, ``optimizer_1``...
OPTIMIZER_KEY = re.compile(r"^optimizer_(\d+)$")
SHARD_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")

_WHAT_A_CHECKPOINT_IS = (
    "Make sure the path points to either a directory with sharded checkpoint files (`.metadata`,"
    " `__<rank>_0.distcp` and `meta.pt`), or a single file with a full checkpoint."
)


#: The first bytes of a ``torch.save`` file: a zip archive (torch >= 1.6), or the legacy pickle format.
_ZIP_MAGIC = b"PK\x03\x04"


def not_a_checkpoint(path: str | os.PathLike[str], what: str, why: str) -> CheckpointError:
    """The one error every command and function gives for a path that holds something else.

    Args:
        path: The path as the user gave it.
        what: ``"file"`` or ``"directory"``.
        why: What is there instead, in words (no final period).
    """
    return CheckpointError(f"The {what} {str(path)!r} is not a checkpoint: {why}. {_WHAT_A_CHECKPOINT_IS}")


def _check_full_file(file: storage.Location, given: str | os.PathLike[str]) -> None:
    """A full checkpoint is a ``torch.save`` file: refuse anything else by its first bytes (one read)."""
    with storage.open_file(file) as f:
        head = f.read(4)
    if head.startswith(_ZIP_MAGIC) or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return
    why = (
        "it is empty (0 bytes)"
        if not head
        else f"it is not a torch.save file (it starts with {head!r}, not a zip archive or a pickle)"
    )
    raise not_a_checkpoint(given, "file", why)


class CheckpointKind(str, Enum):
    """The two kinds of checkpoints Lightning writes."""

    SHARDED = "sharded"
    FULL = "full"


def checkpoint_kind(path: str | os.PathLike[str]) -> tuple[storage.Location, CheckpointKind]:
    """Find the checkpoint at ``path`` (after the recovery rules of an interrupted save) and its kind.

    Looks at names, and at the first bytes of a file (a full checkpoint is a ``torch.save`` file);
    changes nothing on disk.

    Returns:
        The path to read (``path`` itself, or the previous version an interrupted save left) and its
        kind.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: an empty directory, a directory or a file that is not a checkpoint (the
            message of :func:`not_a_checkpoint`), or a sharded directory without ``.metadata`` or
            ``meta.pt``.
    """
    if storage.is_url(path):  # object storage: the version the manifest publishes
        from lightning_sharded.checkpoint.object_store import locate

        located = locate(str(path))
        kind = CheckpointKind(located.kind.value)
        if kind is CheckpointKind.FULL:
            _check_full_file(located.data, path)
        return located.data, kind
    given = Path(path)
    real = resolve(given)
    if not real.exists():
        raise FileNotFoundError(
            f"There is no checkpoint at {str(given)!r}: the path does not exist. Check the path (relative"
            f" paths start at {os.getcwd()!r}). {_WHAT_A_CHECKPOINT_IS}"
        )
    if real.is_file():
        _check_full_file(real, given)
        return real, CheckpointKind.FULL
    names = set(os.listdir(real))
    if not names:
        raise CheckpointError(
            f"The directory {str(given)!r} is empty: it holds no checkpoint. {_WHAT_A_CHECKPOINT_IS}"
        )
    shards = sorted(n for n in names if SHARD_FILE.match(n))
    looks_sharded = bool(shards) or DCP_METADATA in names or MANIFEST_NAME in names
    if not looks_sharded:
        listed = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise not_a_checkpoint(
            given,
            "directory",
            f"it has no `.metadata`, no `__<rank>_0.distcp` shard file and no {MANIFEST_NAME} (it holds"
            f" {listed})",
        )
    if DCP_METADATA not in names:
        raise CheckpointError(
            f"The sharded checkpoint {str(given)!r} has no `.metadata` file, which"
            " torch.distributed.checkpoint"
            " writes last: the save that wrote it was interrupted, or the file was deleted. Restore the"
            " directory from a copy or load an earlier checkpoint."
        )
    if LIGHTNING_METADATA not in names:
        raise CheckpointError(
            f"The sharded checkpoint {str(given)!r} has no `meta.pt`, the file in which Lightning saves"
            " epoch,"
            " global step, loops and callbacks: the save that wrote it was interrupted (stock Lightning"
            " writes"
            " it after the shards), or the file was deleted. Loading it would restart progress silently;"
            " restore the directory from a copy or load an earlier checkpoint."
        )
    return real, CheckpointKind.SHARDED
