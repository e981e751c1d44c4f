"""The one detector: what is at a checkpoint location, after the recovery rules of an interrupted save.

:func:`detect` answers, for a local path or an fsspec URL: which backend holds it, whether it is a
sharded directory or a full file, where the files of the published version are, and the manifest
that describes them (``None`` for a checkpoint written by stock Lightning). Loads, checks and the
tools all start here, so every one of them accepts and refuses the same things with the same
messages (the error table in ``docs/checkpoint-format.md``). It only looks at names (and reads the
manifest); it changes nothing.

A manifest that no longer describes the files beside it, because a stock Lightning save wrote over
the checkpoint after ours (neither ``.metadata`` nor ``meta.pt`` is the file the manifest lists; on
object storage, a ``.metadata`` beside the published version), is ignored with a warning: the
checkpoint is then read as the stock one it is, not reported as corrupt.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from enum import Enum

from lightning_sharded.checkpoint import names
from lightning_sharded.checkpoint.backends import Backend, Location, backend_for, location
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.manifest import Manifest

__all__ = ["CheckpointKind", "Found", "detect", "not_a_checkpoint", "read_manifest"]

log = logging.getLogger(__name__)

_WHAT_A_CHECKPOINT_IS = (
    "Make sure the path points to either a directory with sharded checkpoint files (`.metadata`,"
    " `__<rank>_0.distcp` and `meta.pt`), or a single file with a full checkpoint."
)


#: The first bytes of a ``torch.save`` file: a zip archive (torch >= 1.6), or the legacy pickle format.
_ZIP_MAGIC = b"PK\x03\x04"


def not_a_checkpoint(path: str | os.PathLike[str], what: str, why: str) -> CheckpointError:
    """The one error every command and function gives for a file that holds something else.

    Args:
        path: The path as the user gave it.
        what: ``"file"``, ``"directory"``...
        why: What is there instead, in words (no final period).
    """
    return CheckpointError(f"The {what} {str(path)!r} is not a checkpoint: {why}. {_WHAT_A_CHECKPOINT_IS}")


def _check_full_file(backend: Backend, file: Location, shown: str) -> None:
    """A full checkpoint is a ``torch.save`` file: refuse anything else by its first bytes (one read)."""
    with backend.open_file(file) as f:
        head = f.read(4)
    if head.startswith(_ZIP_MAGIC) or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return
    why = (
        "it is empty (0 bytes)"
        if not head
        else f"it is not a torch.save file (it starts with {head!r}, not a zip archive or a pickle)"
    )
    raise not_a_checkpoint(shown, "file", why)


class CheckpointKind(str, Enum):
    """The two kinds of checkpoints Lightning writes."""

    SHARDED = "sharded"
    FULL = "full"


@dataclass(frozen=True)
class Found:
    """A checkpoint found by :func:`detect`.

    Attributes:
        path: The location as given (a :class:`~pathlib.Path`, or a URL string).
        data: Where its files are: ``path`` itself, the previous version an interrupted save left, or
            the published ``data-<token>`` prefix on object storage.
        kind: Sharded directory or full file.
        backend: The storage that holds it.
        manifest: The manifest that describes ``data``; ``None`` for a stock checkpoint or a full file.
    """

    path: Location
    data: Location
    kind: CheckpointKind
    backend: Backend
    manifest: Manifest | None


def detect(path: str | os.PathLike[str]) -> Found:
    """What is at ``path``: kind, backend, manifest and where the files are; changes nothing.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: an empty directory, something that is not a checkpoint, a version that was
            never published, a sharded checkpoint without ``.metadata`` or ``meta.pt``, or a manifest
            that cannot be parsed.
    """
    given = location(path)
    backend = backend_for(given)
    data, manifest = backend.locate(given)
    shown = str(given)
    if manifest is not None and backend.manifest_is_stale(given, manifest):
        log.warning(
            "The manifest %s of %r does not describe the checkpoint's `.metadata` and `meta.pt`: a save"
            " without lightning_sharded wrote over it. Ignoring the manifest; the checkpoint is read as"
            " that save left it.",
            names.MANIFEST_NAME,
            shown,
        )
        data, manifest = given, None
    if manifest is None:
        if backend.is_file(data):
            _check_full_file(backend, data, shown)
            return Found(given, data, CheckpointKind.FULL, backend, None)
        if not backend.exists(data):
            raise FileNotFoundError(
                f"There is no checkpoint at {shown!r}: the path does not exist (no file, {backend.noun} or"
                f" object by that name). {backend.hint.format(cwd=os.getcwd())} {_WHAT_A_CHECKPOINT_IS}"
            )
    files = backend.list_files(data)
    if manifest is None:
        dirs = backend.list_dirs(data)
        if not files and not dirs:
            raise CheckpointError(
                f"The {backend.noun} {shown!r} is empty: it holds no checkpoint. {_WHAT_A_CHECKPOINT_IS}"
            )
        if not any(names.is_checkpoint_member(n) for n in files):
            unpublished = backend.unpublished(data)
            if unpublished:
                raise CheckpointError(
                    f"The checkpoint {shown!r} is not published: it has no manifest {names.MANIFEST_NAME!r},"
                    f" only the data of {len(unpublished)} save(s) that did not finish"
                    f" ({', '.join(unpublished)}). Load an earlier checkpoint; the next save to this"
                    " location removes these leftovers."
                )
            listed = sorted(files) + [f"{d}/" for d in dirs]
            held = ", ".join(listed[:5]) + (", ..." if len(listed) > 5 else "")
            raise CheckpointError(
                f"The {backend.noun} {shown!r} is not a checkpoint: it is not a sharded checkpoint (it has no"
                f" `.metadata`, no `__<rank>_0.distcp` shard file and no {names.MANIFEST_NAME}; it holds"
                f" {held}) and not a file. {_WHAT_A_CHECKPOINT_IS}"
            )
    if names.DCP_METADATA not in files:
        raise CheckpointError(
            f"The sharded checkpoint {shown!r} has no `.metadata` file, which torch.distributed.checkpoint"
            " writes last (its index, '.metadata'): the save that wrote it did not finish, or the file was"
            " deleted. Restore the directory from a copy or load an earlier checkpoint."
        )
    if names.LIGHTNING_METADATA not in files:
        raise CheckpointError(
            f"The sharded checkpoint {shown!r} has no `meta.pt` ('meta.pt' is the file in which Lightning"
            " saves epoch, global step, loops and callbacks): the save that wrote it did not finish (stock"
            " Lightning writes it after the shards), or the file was deleted. Loading it would restart"
            " progress silently; restore the directory from a copy or load an earlier checkpoint."
        )
    return Found(given, data, CheckpointKind.SHARDED, backend, manifest)


def read_manifest(directory: str | os.PathLike[str]) -> Manifest | None:
    """The manifest of a sharded checkpoint directory (local path, URL, or a published version's prefix).

    Returns:
        The manifest, or ``None`` when there is none (a checkpoint written by stock Lightning).

    Raises:
        CheckpointError: the manifest exists but cannot be parsed, or ``directory`` is an unpublished
            version on object storage.
    """
    data = location(directory)
    return backend_for(data).manifest_at(data)
