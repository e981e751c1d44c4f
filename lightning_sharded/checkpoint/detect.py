"""The one detector: what is at a checkpoint location, after the recovery rules of an interrupted save.

Loads, checks and the tools all start at :func:`detect`, so every one of them accepts and refuses the
same things with the same messages (the error table in ``docs/checkpoint-format.md``). It only looks at
names (and reads the manifest); it changes nothing. A path to one file of a checkpoint directory is
refused with the one message that names the directory to pass; Hugging Face weights are named as what
they are: refused by every load, returned to the tools that describe them (``safetensors=True``).

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

from lightning_sharded.checkpoint import hf_layout, names
from lightning_sharded.checkpoint.backends import (
    Backend,
    Location,
    backend_for,
    basename,
    join,
    location,
    parent,
)
from lightning_sharded.checkpoint.errors import CheckpointError, MissingCheckpointError
from lightning_sharded.checkpoint.manifest import Manifest

__all__ = ["CheckpointKind", "Found", "checkpoint_files", "detect", "not_a_checkpoint"]

log = logging.getLogger(__name__)

_WHAT_A_CHECKPOINT_IS = (
    "Make sure the path points to either a directory with sharded checkpoint files (`.metadata`,"
    " `__<rank>_0.distcp` and `meta.pt`), or a single file with a full checkpoint."
)


def not_a_checkpoint(path: str | os.PathLike[str], what: str, why: str) -> CheckpointError:
    """The one error every command and function gives for a path (as the user gave it; ``what``:
    ``"file"``, ``"directory"``...) that holds something else: ``why``, in words, no final period."""
    return CheckpointError(f"The {what} {str(path)!r} is not a checkpoint: {why}. {_WHAT_A_CHECKPOINT_IS}")


def _file_kind(backend: Backend, file: Location, shown: str) -> CheckpointKind:
    """A full checkpoint is a ``torch.save`` file, told by its first bytes (one read); a safetensors
    file is told the same way. Anything else is refused."""
    with backend.open_file(file) as f:
        head = f.read(9)
    # A torch.save file starts as a zip archive (torch >= 1.6), or as the legacy format's pickle.
    if head.startswith(b"PK\x03\x04") or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return CheckpointKind.FULL
    if hf_layout.is_safetensors_head(head):
        return CheckpointKind.SAFETENSORS
    why = (
        "it is empty (0 bytes)"
        if not head
        else f"it is not a torch.save file (it starts with {head[:4]!r}, not a zip archive or a pickle)"
    )
    raise not_a_checkpoint(shown, "file", why)


class CheckpointKind(str, Enum):
    """The two kinds of checkpoints Lightning writes, and Hugging Face weights (for the tools only)."""

    SHARDED = "sharded"
    FULL = "full"
    #: A Hugging Face weights directory or one ``.safetensors`` file: weights only, no training state.
    #: Only ``detect(..., safetensors=True)`` returns it.
    SAFETENSORS = "safetensors"


#: What each file of a sharded checkpoint directory is, in words, by name.
_PARTS = {
    names.DCP_METADATA: "its index, torch.distributed.checkpoint's `.metadata`",
    names.MANIFEST_NAME: "its manifest: every file's size and checksum",
    names.LIGHTNING_METADATA: "its Lightning metadata: epoch, global step, loops, callbacks",
    names.RANK_STATE_DIR: "its folder of per-rank state files",
    names.INDEX_DIR: "its per-rank index folder",
}


def _refuse_part(backend: Backend, loc: Location, shown: str) -> None:
    """The one error for a path to one part of a checkpoint directory. A shard file, ``.metadata``, the
    manifest, a per-rank state file and the per-rank index's files are parts by their names; ``meta.pt``,
    ``rank_state/`` and ``index/`` when their folder holds a checkpoint's other files (a lone ``meta.pt``
    is read as the file it is)."""
    name, folder = basename(loc), parent(loc)
    rank = names.shard_rank(name)
    state = names.RANK_STATE_FILE.match(f"{basename(folder)}/{name}")
    index = names.RANK_INDEX_FILE.match(f"{basename(folder)}/{name}")
    if rank is not None:
        what = f"the shard file of rank {rank}, torch.distributed.checkpoint's data"
    elif state is not None:
        folder = parent(folder)
        what = f"the per-rank state of rank {int(state.group(1))}: RNG, train dataloader"
    elif index is not None or f"{basename(folder)}/{name}" == names.INDEX_LAYOUT:
        folder = parent(folder)
        what = f"the per-rank index of rank {int(index.group(1))}" if index else "its index layout"
    elif name in (names.DCP_METADATA, names.MANIFEST_NAME) or (
        name in _PARTS and any(names.is_checkpoint_member(n) for n in backend.list_files(folder) if n != name)
    ):
        what = _PARTS[name]
    else:
        return
    if names.DATA_DIR.match(basename(folder)):  # a version (object storage's data-<token>):
        folder = parent(folder)  # its checkpoint is above it
    if hf_layout.is_weights_listing(backend.list_files(folder)):
        whole, takes = "Hugging Face weights directory", "`inspect`, `verify` and `load_pretrained`"
    else:
        whole, takes = "sharded checkpoint", "every tool, `load_checkpoint` and `ckpt_path`"
    noun = "file" if backend.is_file(loc) else backend.noun
    raise CheckpointError(
        f"The {noun} {shown!r} is one part of the {whole} {str(folder)!r} ({what}), not a checkpoint by"
        f" itself: pass the directory {str(folder)!r} instead ({takes} take the whole directory)."
    )


def _weights(found: Found, shown: str, safetensors: bool, files: dict[str, int] | None) -> Found:
    """Hugging Face weights at ``found.data``: returned when the caller describes them (``safetensors``),
    else the error that names them."""
    if safetensors:
        return found
    if files is None:
        what = f"The file {shown!r} is a safetensors file"
    else:
        held = [n for n in (names.SAFETENSORS_INDEX, names.SAFETENSORS_FILE) if n in files]
        count = sum(n.endswith(names.SAFETENSORS_SUFFIX) for n in files)
        held = held or [f"{count} .safetensors file{'s' if count != 1 else ''}"]
        what = f"The {found.backend.noun} {shown!r} is a Hugging Face weights directory ({', '.join(held)})"
    raise CheckpointError(
        f"{what}, not a Lightning checkpoint: it holds weights only, no optimizer, loop or epoch state, so it"
        f" cannot be loaded, resumed from or consolidated as one. Load the weights into a model with"
        f" `lightning_sharded.load_pretrained(module, {shown!r})` (or transformers' `from_pretrained`);"
        f" `lightning-sharded inspect {shown}` lists its tensors."
    )


@dataclass(frozen=True)
class Found:
    """A checkpoint found by :func:`detect`.

    Attributes:
        path: The location as given (a :class:`~pathlib.Path`, or a URL string).
        data: Where its files are: ``path`` itself, the previous version an interrupted save left, or
            the published ``data-<token>`` prefix on object storage.
        manifest: The manifest that describes ``data``; ``None`` for a stock checkpoint or a full file.
    """

    path: Location
    data: Location
    kind: CheckpointKind
    backend: Backend
    manifest: Manifest | None


def detect(path: str | os.PathLike[str], *, safetensors: bool = False) -> Found:
    """What is at ``path``: kind, backend, manifest and where the files are; changes nothing.

    Args:
        path: A sharded checkpoint directory or a full checkpoint file (a local path or a URL).
        safetensors: Return Hugging Face weights (a directory of ``.safetensors`` files, or one) as
            :attr:`CheckpointKind.SAFETENSORS` instead of refusing them: for the tools that describe
            what is at a path (``inspect``, ``verify``), not for loads.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: an empty directory, something that is not a checkpoint, one file of a
            checkpoint directory (the message names the directory to pass instead), Hugging Face
            weights (unless ``safetensors``), a version that was never published, a sharded checkpoint
            without ``.metadata`` or ``meta.pt``, or a manifest that cannot be parsed.
    """
    given = location(path)
    backend = backend_for(given)
    shown = str(given)
    data, manifest = _published(backend, given, shown)
    if manifest is None and backend.is_file(data):
        _refuse_part(backend, data, shown)
        kind = _file_kind(backend, data, shown)
        found = Found(given, data, kind, backend, None)
        return found if kind is CheckpointKind.FULL else _weights(found, shown, safetensors, None)
    if manifest is None and not backend.exists(data):
        raise MissingCheckpointError(  # a ValueError with stock's words, and a FileNotFoundError
            f"There is no checkpoint at {shown!r}: the path does not exist (no file, {backend.noun} or"
            f" object by that name), so it does not point to a valid checkpoint."
            f" {backend.hint.format(cwd=os.getcwd())} {_WHAT_A_CHECKPOINT_IS}"
        )
    files = backend.list_files(data)
    if hf_layout.is_weights_listing(files):
        found = Found(given, data, CheckpointKind.SAFETENSORS, backend, manifest)
        return _weights(found, shown, safetensors, files)
    if manifest is None and not any(names.is_checkpoint_member(n) for n in files):
        _refuse_other_directory(backend, data, shown, files)
    _refuse_unfinished(shown, files)
    return Found(given, data, CheckpointKind.SHARDED, backend, manifest)


def _published(backend: Backend, given: Location, shown: str) -> tuple[Location, Manifest | None]:
    """Where the files of the checkpoint at ``given`` are, and its manifest: the backend's recovery
    rules, then a manifest that a stock save made stale left aside."""
    data, manifest = backend.locate(given)
    if manifest is None or not backend.manifest_is_stale(given, manifest):
        return data, manifest
    log.warning(
        "The manifest %s of %r does not describe the checkpoint's `.metadata` and `meta.pt`: a save"
        " without lightning_sharded wrote over it. Ignoring the manifest; the checkpoint is read as"
        " that save left it.",
        names.MANIFEST_NAME,
        shown,
    )
    return given, None


def _refuse_other_directory(backend: Backend, data: Location, shown: str, files: dict[str, int]) -> None:
    """The error for a directory without a manifest that holds none of a checkpoint's files: empty, one
    part of a checkpoint, unpublished versions (object storage), or anything else."""
    dirs = backend.list_dirs(data)
    if not files and not dirs:
        raise CheckpointError(
            f"The {backend.noun} {shown!r} is empty: it holds no checkpoint, so it does not point to a"
            f" valid checkpoint. {_WHAT_A_CHECKPOINT_IS}"
        )
    _refuse_part(backend, data, shown)
    unpublished = [d for d in dirs if names.DATA_DIR.match(d)]  # object storage's versions
    if unpublished:
        raise CheckpointError(
            f"The checkpoint {shown!r} is not published: it has no manifest {names.MANIFEST_NAME!r},"
            f" only the data of {len(unpublished)} save(s) that did not finish"
            f" ({', '.join(unpublished)}). Load an earlier checkpoint; the next save to this"
            " location removes these leftovers."
        )
    listed = sorted(files) + [f"{d}/" for d in dirs]
    held = ", ".join(listed[:5]) + (", ..." if len(listed) > 5 else "")
    raise not_a_checkpoint(
        shown,
        backend.noun,
        f"it is not a sharded checkpoint (it has no `.metadata`, no `__<rank>_0.distcp` shard file"
        f" and no {names.MANIFEST_NAME}; it holds {held}) and not a file, so it does not point to a"
        " valid checkpoint",
    )


def _refuse_unfinished(shown: str, files: dict[str, int]) -> None:
    """The error for a sharded checkpoint without ``.metadata`` or ``meta.pt``, which the save writes last."""
    if names.DCP_METADATA not in files:
        raise CheckpointError(
            f"The sharded checkpoint {shown!r} has no `.metadata` file, which torch.distributed.checkpoint"
            " writes last (its index, '.metadata'): the save that wrote it did not finish, or the file was"
            " deleted, so it does not point to a valid checkpoint. Restore the directory from a copy or load"
            " an earlier checkpoint."
        )
    if names.LIGHTNING_METADATA not in files:
        raise CheckpointError(
            f"The sharded checkpoint {shown!r} has no `meta.pt` ('meta.pt' is the file in which Lightning"
            " saves epoch, global step, loops and callbacks): the save that wrote it did not finish (stock"
            " Lightning writes it after the shards), or the file was deleted. Loading it would restart"
            " progress silently; restore the directory from a copy or load an earlier checkpoint."
        )


def checkpoint_files(found: Found) -> dict[str, int]:
    """The files of a checkpoint with their sizes, by path relative to it (what a copy of it must hold,
    the manifest included): the one count of a checkpoint's files and bytes, shown by ``inspect``,
    ``verify``, ``consolidate`` and the demo."""
    backend, data, manifest = found.backend, found.data, found.manifest
    if found.kind is CheckpointKind.FULL or (
        found.kind is CheckpointKind.SAFETENSORS and manifest is None and backend.is_file(data)
    ):
        return {basename(data): backend.size(data)}
    if manifest is not None:
        files = {entry.path: entry.size for entry in manifest.files}
        # On object storage the manifest of a published version lies next to its data directory.
        beside = parent(data) if manifest.data_dir else data
        files[names.MANIFEST_NAME] = backend.size(join(beside, names.MANIFEST_NAME))
        return dict(sorted(files.items()))
    present = backend.list_files(data)
    if found.kind is CheckpointKind.SAFETENSORS:
        return {
            n: size
            for n, size in sorted(present.items())
            if n == names.SAFETENSORS_INDEX or n.endswith(names.SAFETENSORS_SUFFIX)
        }
    members = (names.DCP_METADATA, names.LIGHTNING_METADATA)
    return {n: size for n, size in sorted(present.items()) if n in members or names.SHARD_FILE.match(n)}
