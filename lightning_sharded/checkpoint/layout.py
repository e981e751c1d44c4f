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


class CheckpointKind(str, Enum):
    """The two kinds of checkpoints Lightning writes."""

    SHARDED = "sharded"
    FULL = "full"


def checkpoint_kind(path: str | os.PathLike[str]) -> tuple[storage.Location, CheckpointKind]:
    """Find the checkpoint at ``path`` (after the recovery rules of an interrupted save) and its kind.

    Only looks at names, never at contents; changes nothing on disk.

    Returns:
        The path to read (``path`` itself, or the previous version an interrupted save left) and its
        kind.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: an empty directory, a directory that is not a checkpoint, or a sharded
            directory without ``.metadata`` or ``meta.pt``.
    """
    if storage.is_url(path):  # object storage: the version the manifest publishes
        from lightning_sharded.checkpoint.object_store import locate

        located = locate(str(path))
        return located.data, CheckpointKind(located.kind.value)
    given = Path(path)
    real = resolve(given)
    if not real.exists():
        raise FileNotFoundError(
            f"There is no checkpoint at {str(given)!r}: the path does not exist. Check the path (relative"
            f" paths start at {os.getcwd()!r}). {_WHAT_A_CHECKPOINT_IS}"
        )
    if real.is_file():
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
        raise CheckpointError(
            f"The directory {str(given)!r} is not a checkpoint: it has no `.metadata`, no `__<rank>_0.distcp`"
            f" shard file and no {MANIFEST_NAME} (it holds {listed}). {_WHAT_A_CHECKPOINT_IS}"
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
