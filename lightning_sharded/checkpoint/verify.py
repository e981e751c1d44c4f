"""Checks of checkpoint files: presence and sizes on every load, checksums on request.

- :func:`check_found` (collective when a process group is up): a sharded checkpoint against its
  manifest before a load; presence and sizes always (rank 0: one listing; every other rank: its own
  files), checksums with ``verify=True``,
  each file read by one rank only (the files are split across the ranks by size) and the findings
  gathered, so every rank raises the same error or none does. Without a manifest, the shard files
  are checked against the DCP index.
- :func:`verify_checkpoint` (one process): everything that can be checked at a path, checksums
  included; for a sharded directory without a manifest (stock Lightning), what can be checked
  without one (``.metadata`` reads, every file it references is there and long enough); for a full
  file, the CRC-32 that ``torch.save`` stores for every record of its zip archive. It also checks,
  without unpickling anything, that every pickle of the checkpoint holds only what a safe load
  allows (:mod:`~lightning_sharded.checkpoint.pickles`).

Both raise :class:`~lightning_sharded.CheckpointError` naming the first bad file, and the others.
"""

from __future__ import annotations

import heapq
import logging
import os
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_sharded.checkpoint import collective, hf_layout, names, unpickling
from lightning_sharded.checkpoint.backends import (
    Backend,
    Location,
    backend_for,
    basename,
    is_url,
    join,
    location,
)
from lightning_sharded.checkpoint.dcp_index import index_problems, read_index
from lightning_sharded.checkpoint.detect import CheckpointKind, Found, checkpoint_files, detect
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.manifest import FileEntry, Manifest
from lightning_sharded.checkpoint.pickles import check_pickles
from lightning_sharded.checkpoint.problems import Problem, damaged
from lightning_sharded.checkpoint.progress import format_size, progress_bar

log = logging.getLogger(__name__)

#: Bytes read at a time from a full file's records.
_CHUNK = 8 << 20

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "Problem",
    "VerifyReport",
    "check_files",
    "check_found",
    "checksum_problem",
    "find_problems",
    "raise_agreed",
    "size_problem",
    "split_by_size",
    "verify_checkpoint",
]


@dataclass
class VerifyReport:
    """What :func:`verify_checkpoint` checked.

    Attributes:
        path: The checkpoint read (the previous version, when an interrupted save left the path empty).
        kind: ``"sharded"``, ``"full"`` or ``"safetensors"`` (Hugging Face weights).
        files: Number of files of the checkpoint, the manifest included
            (:func:`~lightning_sharded.checkpoint.detect.checkpoint_files`, as ``inspect`` counts them).
        bytes: Their bytes.
        has_manifest: A directory with a manifest (sizes and checksums checked against it).
        notes: What could not be checked, in words.
    """

    path: Location
    kind: CheckpointKind
    files: int = 0
    bytes: int = 0
    has_manifest: bool = False
    notes: list[str] = field(default_factory=list)


def checksum_problem(entry: FileEntry, manifest: Manifest, checksum: str) -> Problem | None:
    """The problem of a file whose computed ``checksum`` differs from its manifest entry, or ``None``."""
    if checksum == entry.checksum:
        return None
    return Problem(
        entry.path,
        f"is corrupted: its {manifest.checksum_algorithm} is {checksum}, the manifest says {entry.checksum}",
        entry.rank,
    )


def _size_problems(backend: Backend, data: Location, manifest: Manifest) -> list[Problem]:
    present = backend.list_files(data)
    found = (
        (
            entry,
            present.get(entry.path) if "/" not in entry.path else _size_or_none(backend, data, entry.path),
        )
        for entry in manifest.files
    )
    return [problem for entry, size in found if (problem := size_problem(entry, size)) is not None]


def _own_size_problems(backend: Backend, data: Location, manifest: Manifest, rank: int) -> list[Problem]:
    """The files ``rank`` wrote (its shards), each checked with one ``stat``: what a rank other than 0
    checks, so that one whose view differs (an NFS attribute cache) is named, without N ranks listing N
    files each (rank 0 checks every file with one listing)."""
    found = (
        (entry, _size_or_none(backend, data, entry.path)) for entry in manifest.files if entry.rank == rank
    )
    return [problem for entry, size in found if (problem := size_problem(entry, size)) is not None]


def size_problem(entry: FileEntry, found: int | None) -> Problem | None:
    """What is wrong with ``entry``'s file, found with ``found`` bytes (``None``: not there)."""
    if found is None:
        return Problem(entry.path, "is missing", entry.rank)
    if found != entry.size:
        how = "truncated" if found < entry.size else "longer than written"
        return Problem(
            entry.path,
            f"is {how}: {found} bytes, the manifest says {entry.size}",
            entry.rank,
            found,
            entry.size,
        )
    return None


def _size_or_none(backend: Backend, base: Location, rel: str) -> int | None:
    try:
        return backend.size(join(base, rel))
    except FileNotFoundError:
        return None


def _checksum_problems(
    backend: Backend,
    data: Location,
    manifest: Manifest,
    entries: list[FileEntry],
    on_bytes: Callable[[int], None] | None = None,
) -> list[Problem]:
    problems = []
    for entry in entries:
        problem = checksum_problem(entry, manifest, backend.checksum(join(data, entry.path))[1])
        if problem is not None:
            problems.append(problem)
        if on_bytes is not None:  # a progress bar, file by file
            on_bytes(entry.size)
    return problems


def find_problems(
    path: str | os.PathLike[str],
    manifest: Manifest,
    *,
    checksums: bool,
    on_bytes: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Every file of ``manifest`` that is missing, has another size or (with ``checksums``) other bytes.

    ``on_bytes`` is called with the size of each file once it is checksummed (a progress bar).
    """
    data = location(path)
    backend = backend_for(data)
    problems = _size_problems(backend, data, manifest)
    if checksums:
        bad = {p.path for p in problems}
        problems += _checksum_problems(
            backend, data, manifest, [e for e in manifest.files if e.path not in bad], on_bytes
        )
    return problems


def split_by_size(entries: list[FileEntry], parts: int) -> list[list[FileEntry]]:
    """``entries`` in ``parts`` lists of about equal bytes (largest first to the least loaded); the same
    split on every rank."""
    split: list[list[FileEntry]] = [[] for _ in range(parts)]
    loads = [(0, i) for i in range(parts)]  # a heap of (bytes so far, part): the least loaded first
    for entry in sorted(entries, key=lambda e: (-e.size, e.path)):
        load, least = heapq.heappop(loads)
        split[least].append(entry)
        heapq.heappush(loads, (load + entry.size, least))
    return split


def check_files(path: str | os.PathLike[str], manifest: Manifest | None, *, verify: bool = False) -> None:
    """Check a sharded directory against its manifest before loading it, in this process.

    Args:
        path: The sharded checkpoint directory (where its files are).
        manifest: Its manifest; ``None`` (a checkpoint without one) checks nothing.
        verify: Also compare every file's checksum (reads every byte).

    Raises:
        CheckpointError: a file is missing, has another size, or (with ``verify``) another checksum;
            names the first one, its rank and the others.
    """
    if manifest is None:
        return
    error = damaged(location(path), find_problems(path, manifest, checksums=verify))
    if error is not None:
        raise error


def check_found(
    found: Found,
    *,
    verify: bool = False,
    group: ProcessGroup | None = None,
    alone: bool = False,
    weights_only: bool | None = False,
) -> None:
    """Check a sharded checkpoint's files before a load; collective over ``group`` when one is up.

    With a manifest: rank 0 checks presence and sizes of every file (one listing), every other rank
    those of the files it wrote (one ``stat`` each), so no rank does work that grows with the number of
    ranks; with ``verify`` each file's checksum is computed by one rank only. Without one: the shard
    files against the DCP index (rank 0). The findings of all ranks are gathered, so every rank raises
    the same error, or none does. With
    ``alone`` it runs in this process only (the single-process tools), whatever process group is up.
    ``weights_only`` is how a checkpoint without a manifest has its ``.metadata`` read
    (:func:`~lightning_sharded.checkpoint.dcp_index.read_index`): ``False`` by DCP's reader, as a
    resume reads it; ``True`` / ``None`` (the tools) safely.

    Raises:
        CheckpointError: a file is missing, has another size, or (with ``verify``) another checksum;
            names the first one, its rank and the others.
    """
    where = collective.ranks(group, alone=alone)
    backend, data, manifest = found.backend, found.data, found.manifest
    try:
        if manifest is None:
            index = read_index(backend, data, weights_only=weights_only) if where.rank == 0 else None
            mine = index_problems(backend, data, index) if index is not None else []
        elif where.rank == 0:
            mine = _size_problems(backend, data, manifest)
        else:
            mine = _own_size_problems(backend, data, manifest, where.rank)
        if manifest is not None and verify:
            bad = {p.path for p in mine}
            share = split_by_size([e for e in manifest.files if e.path not in bad], where.world_size)
            mine += _checksum_problems(backend, data, manifest, share[where.rank])
        report: tuple[list[Problem], str | None] = (mine, None)
    except CheckpointError as err:
        report = ([], str(err))
    raise_agreed(report, where, data, manifest)


def raise_agreed(
    report: tuple[list[Problem], str | None],
    where: collective.Ranks,
    data: Location,
    manifest: Manifest | None,
    then: str = "",
) -> None:
    """Gather every rank's ``(problems, error message)`` about checkpoint ``data`` and raise the same
    :class:`~lightning_sharded.CheckpointError` on every rank (the first error, else every problem
    found, in manifest order, with ``then`` after the message), or return on every rank. Collective."""
    reports = collective.all_gather(report, where)
    errors = [(r, message) for r, (_, message) in enumerate(reports) if message is not None]
    if errors:
        rank, message = errors[0]
        raise CheckpointError(message if where.world_size == 1 else f"{message} (on rank {rank})")
    order = {e.path: i for i, e in enumerate(manifest.files)} if manifest is not None else {}
    seen: dict[tuple[str, str], Problem] = {}
    seen_by: dict[tuple[str, str], list[int]] = {}
    for r, (problems, _) in enumerate(reports):
        for problem in problems:
            seen.setdefault((problem.path, problem.what), problem)
            seen_by.setdefault((problem.path, problem.what), []).append(r)
    merged = sorted(seen.values(), key=lambda p: (order.get(p.path, len(order)), p.path))
    error = damaged(data, merged, then)
    if error is None:
        return
    # Presence and sizes of a file are checked by rank 0 and by the rank that wrote it: say so when only
    # one of them saw a problem.
    writer = {e.path: e.rank for e in manifest.files} if manifest is not None else {}

    def checkers(path: str) -> set[int]:
        return {r for r in (0, writer.get(path, 0)) if r < where.world_size}

    size_problems = {key: set(rs) for key, rs in seen_by.items() if "corrupted" not in key[1]}
    partial = sorted({r for rs in size_problems.values() for r in rs})
    if partial and any(not checkers(key[0]) <= rs for key, rs in size_problems.items()):
        shown = ", ".join(map(str, partial))
        raise CheckpointError(
            f"{error} (seen by rank(s) {shown} of {where.world_size}; rank {partial[0]}'s report)"
        )
    raise error


def _full_file_problems(backend: Backend, file: Location, progress: bool | None) -> list[Problem]:
    """A ``torch.save`` zip archive: every record's CRC-32 (stored by torch.save) must match."""
    bad: str | None = None
    try:
        with backend.open_file(file) as f, zipfile.ZipFile(f) as archive:
            records = archive.infolist()
            total = sum(info.file_size for info in records)
            with progress_bar(total, progress, f"verifying {basename(file)}") as tick:
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
                basename(file),
                f"is not a complete torch.save archive ({err}): it is truncated or corrupt, or was written"
                " by a torch older than 1.6",
            )
        ]
    if bad is not None:
        return [
            Problem(
                basename(file), f"is corrupted: record {bad!r} does not match the CRC-32 torch.save stored"
            )
        ]
    return []


def _raise(path: Location, problems: list[Problem]) -> None:
    error = damaged(path, problems)
    if error is not None:
        raise error


def verify_checkpoint(
    path: str | os.PathLike[str], *, progress: bool | None = None, weights_only: bool | None = True
) -> VerifyReport:
    """Check every file of a checkpoint, checksums included; works in one plain process.

    - a sharded directory with a manifest: every listed file present, with its size and checksum;
    - a sharded directory without one (stock Lightning): nothing to compare checksums with, so it
      checks that ``.metadata`` reads and that every file it references is there and long enough
      (the report's ``notes`` say so);
    - a full file: the CRC-32 of every record of the ``torch.save`` archive;
    - Hugging Face weights (a ``.safetensors`` file or directory): every header reads and every file is
      as long as its header says; with a manifest (``consolidate --format safetensors``), every listed
      file's size and checksum too;
    - then, without unpickling anything, every pickle (the full file; ``.metadata``, ``meta.pt`` and
      DCP's non-tensor entries): a type that a safe load would refuse fails the check, or, with
      ``weights_only=False``, is named in the report's ``notes``.

    Args:
        path: A sharded checkpoint directory, a full checkpoint file, or Hugging Face weights.
        progress: Show a progress bar on stderr while reading; ``None`` shows one for checkpoints of
            64 MiB or more.
        weights_only: ``True`` (or ``None``): a checkpoint that ``load_checkpoint`` would refuse
            fails; ``False`` (for a file you trust): it passes, with a note. Nothing is unpickled either way.

    Returns:
        What was checked: ``files`` and ``bytes`` count the checkpoint's files as ``inspect`` does.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: the path is not a checkpoint, or a file is missing, truncated or corrupted;
            the message names the first bad file, the rank that wrote it, and the others. With
            ``weights_only``, also a pickle that holds a type that is not allowed (the message names it).
    """
    started = time.perf_counter()
    found = detect(path, safetensors=True)
    backend, real = found.backend, found.data
    report = VerifyReport(real, found.kind)
    manifest = found.manifest
    weights = found.kind is CheckpointKind.SAFETENSORS
    # Hugging Face weights: every header reads, every file as long as its header says; with a manifest
    # (our export) the checksums too, below.
    header_problems = hf_layout.read_weights(backend, real).problems if weights else []
    if found.kind is CheckpointKind.FULL:
        _raise(real, _full_file_problems(backend, real, progress))
    elif weights and manifest is None:
        _raise(real, header_problems)
        report.notes.append(
            "no manifest (weights not written by lightning_sharded): there are no checksums to compare with;"
            " checked that every safetensors header reads and that every file is as long as its header says"
        )
    elif manifest is None:
        try:  # read safely, flag or not: verify never unpickles
            problems = index_problems(backend, real, read_index(backend, real, weights_only=True))
        except unpickling.RefusedPickleError:
            problems = []  # the pickle check below refuses it, or notes it with the flag
            report.notes.append(
                "the shard files were not checked against `.metadata`: reading it would run code from it"
            )
        except CheckpointError as err:
            detail = repr(err.__cause__) if err.__cause__ is not None else str(err)
            problems = [Problem(names.DCP_METADATA, f"cannot be read ({detail})")]
        _raise(real, problems)
        report.notes.append(
            "no manifest (a checkpoint written without lightning_sharded): there are no checksums to compare"
            " with; checked that `.metadata` reads and that every shard file it references is present and"
            " long enough"
        )
    else:
        with progress_bar(manifest.total_size, progress, f"verifying {basename(real)}") as tick:
            problems = find_problems(real, manifest, checksums=True, on_bytes=tick)
        if not weights and names.DCP_METADATA not in {e.path for e in manifest.files}:
            problems.append(Problem(names.DCP_METADATA, "is not listed in the manifest"))
        seen = {p.path for p in problems}
        _raise(real, problems + [p for p in header_problems if p.path not in seen])
        report.has_manifest = True
        if manifest.frozen is not None:
            source = manifest.frozen.source
            gone = "" if is_url(source) or os.path.exists(source) else ", which does not exist"
            report.notes.append(
                f"trainable only: {len(manifest.frozen.keys)} frozen parameter(s) are not in this checkpoint;"
                f" a load reads them from {source}{gone} (not checked here)"
            )
    files = checkpoint_files(found)
    report.files, report.bytes = len(files), sum(files.values())
    if not weights:  # safetensors holds no pickle
        report.notes += check_pickles(backend, real, found.kind, weights_only)
    log.info(
        "Verified %s (%s, %d files, %s) in %.2fs",
        real,
        found.kind.value,
        report.files,
        format_size(report.bytes),
        time.perf_counter() - started,
    )
    return report
