"""Checks of checkpoint files: presence and sizes on every load, checksums on request.

- :func:`check_files`: a sharded directory against its manifest; presence and sizes always (cheap:
  one ``stat`` per file), checksums with ``verify=True`` (reads every byte).
- :func:`verify_checkpoint`: everything that can be checked at a path, checksums included; for a
  sharded directory without a manifest (stock Lightning), what can be checked without one: that
  ``.metadata`` reads and that every shard file it references is there and long enough; for a full
  file, the CRC-32 that ``torch.save`` stores for every record of its zip archive.

Both raise :class:`~lightning_sharded.CheckpointError` naming the first bad file, and the others.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sharded.checkpoint import storage
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.layout import (
    DCP_METADATA,
    LIGHTNING_METADATA,
    SHARD_FILE,
    CheckpointKind,
    checkpoint_kind,
)
from lightning_sharded.checkpoint.manifest import FileEntry, Manifest, file_checksum, read_manifest
from lightning_sharded.checkpoint.progress import format_size, progress_bar

__all__ = [
    "Problem",
    "VerifyReport",
    "check_files",
    "check_presence",
    "find_problems",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)

#: Bytes read at a time from a full file's records.
_CHUNK = 8 << 20


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


def find_problems(
    path: str | os.PathLike[str],
    manifest: Manifest,
    *,
    checksums: bool,
    on_bytes: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Every file of ``manifest`` that is missing, has another size or (with ``checksums``) other bytes.

    ``on_bytes`` is called with the number of bytes checksummed as they are read (a progress bar).
    """
    if storage.is_url(path):
        from lightning_sharded.checkpoint import object_store

        found = object_store.find_problems(str(path), manifest, checksums=checksums)
        if on_bytes is not None and checksums:
            on_bytes(manifest.total_size)
        return found
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
            problem = checksum_problem(entry, manifest, file_checksum(file, on_chunk=on_bytes)[1])
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


def check_presence(path: storage.Location) -> dict[str, int]:
    """Presence and size of every file of a sharded checkpoint (cheap: no file is read but `.metadata`).

    With a manifest, every file it lists must be there with its size; without one (stock Lightning),
    ``.metadata`` must read and every shard file it references must be there and long enough.

    Returns:
        The checkpoint's files and their sizes (what ``verify`` and ``inspect`` count): the manifest's
        entries, or ``.metadata``, ``meta.pt`` and the shard files ``.metadata`` references.

    Raises:
        CheckpointError: a file is missing or has another size; names the first one, its rank and the
            others.
    """
    manifest = read_manifest(path)
    if manifest is not None:
        _raise(path, find_problems(path, manifest, checksums=False))
        return {entry.path: entry.size for entry in manifest.files}
    problems, files = _dcp_problems(path)
    _raise(path, problems)
    return files


def _dcp_problems(root: storage.Location) -> tuple[list[Problem], dict[str, int]]:
    """Without a manifest: ``.metadata`` readable, every file it references present and long enough.

    Returns the problems, and the files present among ``.metadata``, ``meta.pt`` and the referenced
    shard files, with their sizes.
    """
    sizes = storage.list_files(root)
    try:
        with storage.open_file(storage.join(root, DCP_METADATA)) as f:
            metadata: Any = pickle.load(f)
        storage_data = dict(metadata.storage_data or {})
    except Exception as err:
        return [Problem(DCP_METADATA, f"cannot be read ({type(err).__name__}: {err})")], {}
    needed: dict[str, int] = {}
    for info in storage_data.values():
        rel = str(info.relative_path)
        needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    problems: list[Problem] = []
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
    files = {
        name: sizes[name] for name in [DCP_METADATA, LIGHTNING_METADATA, *sorted(needed)] if name in sizes
    }
    return problems, files


def _full_file_problems(file: storage.Location, progress: bool | None) -> list[Problem]:
    """A ``torch.save`` zip archive: every record's CRC-32 (stored by torch.save) must match."""
    bad: str | None = None
    try:
        with storage.open_file(file) as f, zipfile.ZipFile(f) as archive:
            records = archive.infolist()
            total = sum(info.file_size for info in records)
            with progress_bar(total, progress, f"verifying {storage.basename(file)}") as tick:
                for info in records:
                    try:
                        with archive.open(info) as record:  # checks the CRC-32 once read to the end
                            while chunk := record.read(_CHUNK):
                                tick(len(chunk))
                    except zipfile.BadZipFile:
                        bad = info.filename
                        break
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


def verify_checkpoint(path: str | os.PathLike[str], *, progress: bool | None = None) -> VerifyReport:
    """Check every file of a checkpoint, checksums included; works in one plain process.

    - a sharded directory with a manifest: every listed file present, with its size and checksum;
    - a sharded directory without one (stock Lightning): nothing to compare checksums with, so it
      checks that ``.metadata`` reads and that every file it references is there and long enough
      (the report's ``notes`` say so);
    - a full file: the CRC-32 of every record of the ``torch.save`` archive.

    Args:
        path: A sharded checkpoint directory or a full checkpoint file.
        progress: Show a progress bar on stderr while reading; ``None`` shows one for checkpoints of
            64 MiB or more.

    Returns:
        What was checked: ``files`` and ``bytes`` count the checkpoint's files as ``inspect`` does.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: the path is not a checkpoint, or a file is missing, truncated or corrupted;
            the message names the first bad file, the rank that wrote it, and the others.
    """
    started = time.perf_counter()
    real, kind = checkpoint_kind(path)
    report = VerifyReport(real, kind)
    desc = f"verifying {storage.basename(real)}"
    if kind is CheckpointKind.FULL:
        report.files, report.bytes = 1, storage.size(real)
        _raise(real, _full_file_problems(real, progress))
    else:
        manifest = read_manifest(real)
        if manifest is None:
            problems, files = _dcp_problems(real)
            _raise(real, problems)
            report.notes.append(
                "no manifest (a checkpoint written without lightning_sharded): there are no checksums to"
                " compare with; checked that `.metadata` reads and that every shard file it references is"
                " present and long enough"
            )
            report.files, report.bytes = len(files), sum(files.values())
        else:
            with progress_bar(manifest.total_size, progress, desc) as tick:
                problems = find_problems(real, manifest, checksums=True, on_bytes=tick)
            if DCP_METADATA not in {e.path for e in manifest.files}:
                problems.append(Problem(DCP_METADATA, "is not listed in the manifest"))
            _raise(real, problems)
            report.has_manifest = True
            report.files, report.bytes = len(manifest.files), manifest.total_size
    log.info(
        "Verified %s (%s, %d files, %s) in %.2fs",
        real,
        kind.value,
        report.files,
        format_size(report.bytes),
        time.perf_counter() - started,
    )
    return report
