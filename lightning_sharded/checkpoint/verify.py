"""Checks of checkpoint files: presence and sizes on every load, checksums on request.

- :func:`check_files`: a sharded directory against its manifest; presence and sizes always (cheap:
  one ``stat`` per file), checksums with ``verify=True`` (reads every byte).
- :func:`verify_checkpoint`: everything that can be checked at a path, checksums included; for a
  sharded directory without a manifest (stock Lightning), what can be checked without one: that
  ``.metadata`` reads and that every shard file it references is there and long enough; for a full
  file, the CRC-32 that ``torch.save`` stores for every record of its zip archive. It also checks,
  without unpickling anything, that every pickle of the checkpoint holds only what a safe load
  allows (:mod:`~lightning_sharded.checkpoint.unpickling`).

Both raise :class:`~lightning_sharded.CheckpointError` naming the first bad file, and the others.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sharded.checkpoint import storage, unpickling
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.layout import (
    DCP_METADATA,
    LIGHTNING_METADATA,
    SHARD_FILE,
    CheckpointKind,
    checkpoint_kind,
)
from lightning_sharded.checkpoint.manifest import FileEntry, Manifest, file_checksum, read_manifest

__all__ = ["Problem", "VerifyReport", "check_files", "find_problems", "verify_checkpoint"]


@dataclass(frozen=True)
class Problem:
    """One bad file of a checkpoint.

    Attributes:
        path: The file, relative to the checkpoint directory (the file name for a full checkpoint).
        what: What is wrong with it, in words.
        rank: The rank that wrote it, when known.
    """

    path: str
    what: str
    rank: int | None = None

    def __str__(self) -> str:
        who = f" (written by rank {self.rank})" if self.rank is not None else ""
        return f"{self.path!r}{who} {self.what}"


@dataclass
class VerifyReport:
    """What :func:`verify_checkpoint` checked.

    Attributes:
        path: The checkpoint read (the previous version, when an interrupted save left the path empty).
        kind: ``"sharded"`` or ``"full"``.
        files: Number of files checked.
        bytes: Bytes read to check them.
        has_manifest: A sharded directory with a manifest (sizes and checksums checked against it).
        notes: What could not be checked, in words.
    """

    path: storage.Location
    kind: CheckpointKind
    files: int = 0
    bytes: int = 0
    has_manifest: bool = False
    notes: list[str] = field(default_factory=list)


def _rank_of(name: str) -> int | None:
    m = SHARD_FILE.match(name)
    return int(m.group(1)) if m else None


def find_problems(path: str | os.PathLike[str], manifest: Manifest, *, checksums: bool) -> list[Problem]:
    """Every file of ``manifest`` that is missing, has another size or (with ``checksums``) other bytes."""
    if storage.is_url(path):
        from lightning_sharded.checkpoint import object_store

        return object_store.find_problems(str(path), manifest, checksums=checksums)
    root = Path(path)
    problems: list[Problem] = []
    for entry in manifest.files:
        file = root / entry.path
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            problems.append(Problem(entry.path, "is missing", entry.rank))
            continue
        if size != entry.size:
            how = "truncated" if size < entry.size else "longer than written"
            problems.append(
                Problem(entry.path, f"is {how}: {size} bytes, the manifest says {entry.size}", entry.rank)
            )
            continue
        if checksums:
            problem = checksum_problem(entry, manifest, file_checksum(file)[1])
            if problem is not None:
                problems.append(problem)
    return problems


def checksum_problem(entry: FileEntry, manifest: Manifest, checksum: str) -> Problem | None:
    """The problem of a file whose computed ``checksum`` differs from its manifest entry, or ``None``."""
    if checksum == entry.checksum:
        return None
    return Problem(
        entry.path,
        f"is corrupted: its {manifest.checksum_algorithm} is {checksum}, the manifest says {entry.checksum}",
        entry.rank,
    )


def _raise(path: storage.Location, problems: list[Problem]) -> None:
    if not problems:
        return
    first, others = problems[0], problems[1:]
    also = f" Also: {'; '.join(map(str, others))}." if others else ""
    raise CheckpointError(
        f"The checkpoint {str(path)!r} is damaged: {first}.{also} Restore it from a copy, or load an earlier"
        " checkpoint."
    )


def check_files(path: str | os.PathLike[str], manifest: Manifest | None, *, verify: bool = False) -> None:
    """Check a sharded directory against its manifest before loading it.

    Args:
        path: The sharded checkpoint directory.
        manifest: Its manifest; ``None`` (a checkpoint without one) checks nothing.
        verify: Also compare every file's checksum (reads every byte).

    Raises:
        CheckpointError: a file is missing, has another size, or (with ``verify``) another checksum;
            names the first one, its rank and the others.
    """
    if manifest is None:
        return
    _raise(storage.location(path), find_problems(path, manifest, checksums=verify))


def read_dcp_metadata(root: storage.Location, weights_only: bool | None = True) -> Any:
    """DCP's ``.metadata`` of ``root``, unpickled safely unless ``weights_only`` is ``False``."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = storage.join(root, DCP_METADATA)
    with storage.open_file(file) as f:
        metadata = unpickling.load_pickle(
            f, what=f"The DCP metadata {str(file)!r}", weights_only=weights_only
        )
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"The DCP metadata {str(file)!r} holds a {type(metadata).__name__}, not DCP's Metadata: this is"
            " not a sharded checkpoint. Restore the directory from a copy, or load an earlier checkpoint."
        )
    return metadata


def _dcp_problems(root: storage.Location, weights_only: bool | None = True) -> tuple[list[Problem], int]:
    """Without a manifest: ``.metadata`` readable, every file it references present and long enough."""
    try:
        metadata = read_dcp_metadata(root, weights_only)
        storage_data = dict(metadata.storage_data or {})
    except CheckpointError:
        raise
    except Exception as err:
        return [Problem(DCP_METADATA, f"cannot be read ({type(err).__name__}: {err})")], 0
    needed: dict[str, int] = {}
    for info in storage_data.values():
        rel = str(info.relative_path)
        needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    problems: list[Problem] = []
    sizes = storage.list_files(root)
    for rel in sorted(needed):
        size = sizes.get(rel, -1)
        if size < 0:
            problems.append(Problem(rel, "is missing (`.metadata` references it)", _rank_of(rel)))
            continue
        if size < needed[rel]:
            problems.append(
                Problem(rel, f"is truncated: {size} bytes, `.metadata` needs {needed[rel]}", _rank_of(rel))
            )
    if LIGHTNING_METADATA not in sizes:
        problems.append(Problem(LIGHTNING_METADATA, "is missing"))
    return problems, len(needed) + 2  # the shard files, `.metadata` and `meta.pt`


def _full_file_problems(file: storage.Location) -> list[Problem]:
    """A ``torch.save`` zip archive: every record's CRC-32 (stored by torch.save) must match."""
    try:
        with storage.open_file(file) as f, zipfile.ZipFile(f) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return [
            Problem(
                storage.basename(file),
                f"is not a complete torch.save archive ({err}): it is truncated or corrupt, or was written"
                " by a"
                " torch older than 1.6",
            )
        ]
    if bad is not None:
        return [
            Problem(
                storage.basename(file),
                f"is corrupted: record {bad!r} does not match the CRC-32 torch.save stored",
            )
        ]
    return []


def _refused_pickles(root: storage.Location, kind: CheckpointKind) -> list[tuple[str, str]]:
    """Each pickle of a checkpoint that a safe load would refuse, as ``(what, names)``; runs nothing.

    ``torch.save`` archives (a full file, ``meta.pt``, DCP's non-tensor entries) are read statically
    (only their ``data.pkl``); ``.metadata`` with the restricted unpickler, which refuses before
    building anything else. Each shard file is opened once.
    """
    if kind is CheckpointKind.FULL:
        with storage.open_file(root) as f:
            names = _globals_or_raise(root, f, storage.basename(root), "its pickle")
        return [(f"The checkpoint file {str(root)!r}", ", ".join(names))] if names else []
    try:
        metadata = read_dcp_metadata(root)
    except unpickling.RefusedPickleError as err:
        return [(err.what, err.name)]
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    objects = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        # An item stored transformed (compressed...) is read only by DCP's load, which reads it safely.
        if index.fqn in objects and not info.transform_descriptors:
            by_file.setdefault(str(info.relative_path), []).append(
                (int(info.offset), int(info.length), index.fqn)
            )
    found: list[tuple[str, str]] = []
    for rel in sorted(by_file):
        rank = _rank_of(rel)
        who = f", written by rank {rank}" if rank is not None else ""
        with storage.open_file(storage.join(root, rel)) as f:
            for offset, length, fqn in sorted(by_file[rel]):
                f.seek(offset)
                names = _globals_or_raise(
                    root, f.read(length), rel, f"its entry {fqn!r} at byte {offset}", rank
                )
                if names:
                    what = f"The entry {fqn!r} of the sharded checkpoint {str(root)!r} (in {rel!r}{who})"
                    found.append((what, ", ".join(names)))
    meta = storage.join(root, LIGHTNING_METADATA)
    if storage.exists(meta):
        with storage.open_file(meta) as f:
            names = _globals_or_raise(root, f, LIGHTNING_METADATA, "its pickle")
        if names:
            found.append((f"The Lightning metadata {str(meta)!r}", ", ".join(names)))
    return found


def _globals_or_raise(
    root: storage.Location, source: Any, rel: str, part: str, rank: int | None = None
) -> list[str]:
    """:func:`unpickling.unsafe_globals` of ``source``; a pickle that cannot be read is damage."""
    try:
        return unpickling.unsafe_globals(source)
    except Exception as err:  # not a torch.save archive, cut short...
        detail = str(err).splitlines()[0] if str(err) else ""
        _raise(
            root,
            [Problem(rel, f"is corrupted: {part} cannot be read ({type(err).__name__}: {detail})", rank)],
        )
        raise  # unreachable: _raise raised


def _check_pickles(report: VerifyReport, weights_only: bool | None) -> None:
    found = _refused_pickles(report.path, report.kind)
    if found and unpickling.resolve_weights_only(weights_only):
        raise unpickling.refused(*found[0])
    for what, names in found:
        report.notes.append(
            f"{what} holds {names}, which a safe load refuses: it opens only with {unpickling.UNSAFE_FLAG}"
            " (weights_only=False), running code from the file"
        )


def verify_checkpoint(path: str | os.PathLike[str], *, weights_only: bool | None = True) -> VerifyReport:
    """Check every file of a checkpoint, checksums included; works in one plain process.

    - a sharded directory with a manifest: every listed file present, with its size and checksum;
    - a sharded directory without one (stock Lightning): nothing to compare checksums with, so it
      checks that ``.metadata`` reads and that every file it references is there and long enough
      (the report's ``notes`` say so);
    - a full file: the CRC-32 of every record of the ``torch.save`` archive;
    - then, without unpickling anything, every pickle (the full file; ``.metadata``, ``meta.pt`` and
      DCP's non-tensor entries): a type that a safe load would refuse fails the check, or, with
      ``weights_only=False``, is named in the report's ``notes``.

    Args:
        path: A sharded checkpoint directory or a full checkpoint file.
        weights_only: ``True`` (or ``None``): a checkpoint that :func:`load_checkpoint` would refuse
            fails; ``False`` (for a file you trust): it passes, with a note.

    Returns:
        What was checked.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: the path is not a checkpoint, or a file is missing, truncated or corrupted;
            the message names the first bad file, the rank that wrote it, and the others. With
            ``weights_only``, also a pickle that holds a type that is not allowed (the message names it).
    """
    real, kind = checkpoint_kind(path)
    report = VerifyReport(real, kind)
    if kind is CheckpointKind.FULL:
        _raise(real, _full_file_problems(real))
        report.files, report.bytes = 1, storage.size(real)
        _check_pickles(report, weights_only)
        return report
    manifest = read_manifest(real)
    if manifest is None:
        problems, report.files = _dcp_problems(real, weights_only)
        _raise(real, problems)
        report.notes.append(
            "no manifest (a checkpoint written without lightning_sharded): there are no checksums to compare"
            " with; checked that `.metadata` reads and that every shard file it references is present and"
            " long enough"
        )
        report.bytes = sum(storage.list_files(real).values())
        _check_pickles(report, weights_only)
        return report
    problems = find_problems(real, manifest, checksums=True)
    listed = {e.path for e in manifest.files}
    if DCP_METADATA not in listed:
        problems.append(Problem(DCP_METADATA, "is not listed in the manifest"))
    _raise(real, problems)
    report.has_manifest = True
    report.files, report.bytes = len(manifest.files), manifest.total_size
    _check_pickles(report, weights_only)
    return report
