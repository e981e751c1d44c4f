"""Whether a checkpoint's files are whole: presence, sizes and checksums, agreed by every rank.

- :func:`check_found` (collective), before a read: with a manifest, rank 0 checks every file's presence
  and size, every other rank those of the files it wrote; ``verify=True`` adds every checksum, each
  file read by one rank (:func:`split_by_size`). Without a manifest: the shard files against the DCP
  index (rank 0). Every rank raises the same error (:func:`raise_agreed`), or none does.
- :class:`ReadVerification`: a sharded load's checksums from the bytes it reads, for ``verify=True``
  (``"before"``) and ``"during"``: ``docs/checkpoint-format.md``, "Checksums on a load".
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Literal, cast

from lightning_sharded.checkpoint import collective
from lightning_sharded.checkpoint.backends import Backend, Location, join
from lightning_sharded.checkpoint.backends.paths import listed_sizes
from lightning_sharded.checkpoint.dcp_index import index_problems, read_index
from lightning_sharded.checkpoint.detect import Found, detect
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.manifest import FileEntry, Manifest
from lightning_sharded.checkpoint.problems import Problem, damaged

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

__all__ = [
    "AFTER_READ",
    "UNCHANGED",
    "ReadChecksums",
    "ReadVerification",
    "VerifyMode",
    "check_files",
    "check_found",
    "checksum_problem",
    "find_problems",
    "prepare_read",
    "raise_agreed",
    "size_problem",
    "split_by_size",
    "verify_mode",
]


def size_problem(entry: FileEntry, found: int | None) -> Problem | None:
    """What is wrong with ``entry``'s file, found with ``found`` bytes (``None``: not there)."""
    if found is None:
        return Problem(entry.path, "is missing", entry.rank)
    if found != entry.size:
        how = "truncated" if found < entry.size else "longer than written"
        what = f"is {how}: {found} bytes, the manifest says {entry.size}"
        return Problem(entry.path, what, entry.rank, found, entry.size)
    return None


def checksum_problem(entry: FileEntry, manifest: Manifest, checksum: str) -> Problem | None:
    """The problem of a file whose computed ``checksum`` differs from its manifest entry, or ``None``."""
    if checksum == entry.checksum:
        return None
    what = (
        f"is corrupted: its {manifest.checksum_algorithm} is {checksum}, the manifest says {entry.checksum}"
    )
    return Problem(entry.path, what, entry.rank)


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


def _size_or_none(backend: Backend, base: Location, rel: str) -> int | None:
    try:
        return backend.size(join(base, rel))
    except FileNotFoundError:
        return None


def _size_problems(backend: Backend, data: Location, manifest: Manifest, rank: int = 0) -> list[Problem]:
    """Rank 0 checks every file with one listing; another rank the files it wrote, one ``stat`` each, so
    that one whose view differs (an NFS attribute cache) is named, without N ranks listing N files each."""
    if rank == 0:
        present = listed_sizes(backend.list_files, data, (entry.path for entry in manifest.files))
        found = [(entry, present.get(entry.path)) for entry in manifest.files]
    else:
        found = [(e, _size_or_none(backend, data, e.path)) for e in manifest.files if e.rank == rank]
    return [problem for entry, size in found if (problem := size_problem(entry, size)) is not None]


def _checksum_problems(
    backend: Backend,
    data: Location,
    manifest: Manifest,
    entries: list[FileEntry],
    on_bytes: Callable[[int], None] | None = None,
) -> list[Problem]:
    problems = []
    for entry in entries:
        try:
            problem = checksum_problem(entry, manifest, backend.checksum(join(data, entry.path))[1])
        except FileNotFoundError:  # a file whose presence another rank checks (or gone since): reported
            problem = size_problem(entry, None)
        if problem is not None:
            problems.append(problem)
        if on_bytes is not None:  # a progress bar, file by file
            on_bytes(entry.size)
    return problems


def find_problems(
    backend: Backend,
    data: Location,
    manifest: Manifest,
    *,
    checksums: bool,
    on_bytes: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Every file of ``manifest`` under ``data`` that is missing, has another size or (with ``checksums``)
    other bytes, in this process. ``on_bytes`` is called with the size of each file once it is
    checksummed (a progress bar)."""
    problems = _size_problems(backend, data, manifest)
    if checksums:
        bad = {p.path for p in problems}
        todo = [e for e in manifest.files if e.path not in bad]
        problems += _checksum_problems(backend, data, manifest, todo, on_bytes)
    return problems


def check_files(path: str | os.PathLike[str], manifest: Manifest | None, *, verify: bool = False) -> None:
    """Check the sharded checkpoint at ``path`` (as :func:`~.detect.detect` finds it) against ``manifest``
    (``None`` checks nothing) before loading it, in this process; with ``verify`` every checksum too.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: a file is missing, has another size, or (with ``verify``) another checksum;
            names the first one, its rank and the others.
    """
    if manifest is None:
        return
    found = detect(path)
    error = damaged(found.data, find_problems(found.backend, found.data, manifest, checksums=verify))
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

    See the module doc. With ``alone`` it runs in this process only (the single-process tools), whatever
    process group is up. ``weights_only`` is how a checkpoint without a manifest has its ``.metadata``
    read (:func:`~lightning_sharded.checkpoint.dcp_index.read_index`): ``False`` by DCP's reader, as a
    resume reads it; ``True`` / ``None`` (the tools) safely. Raises what :func:`check_files` raises, the
    same on every rank.
    """
    where = collective.ranks(group, alone=alone)
    backend, data, manifest = found.backend, found.data, found.manifest
    try:
        if manifest is not None:
            mine = _size_problems(backend, data, manifest, where.rank)
        elif where.rank == 0:
            metadata = read_index(backend, data, weights_only=weights_only, standins=True)
            mine = index_problems(backend, data, metadata)
        else:
            mine = []
        if manifest is not None and verify:
            # The same split on every rank (each file checksummed by one rank), less what this rank saw
            # damaged already: rank 0 sees every file's size, another rank only its own files'.
            bad = {p.path for p in mine}
            share = split_by_size(list(manifest.files), where.world_size)[where.rank]
            mine += _checksum_problems(backend, data, manifest, [e for e in share if e.path not in bad])
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
    for rank, (_, message) in enumerate(reports):
        if message is not None:
            raise CheckpointError(message if where.world_size == 1 else f"{message} (on rank {rank})")
    # Manifests list their files by path, so path order is manifest order; the writers are the problems'
    # own: a rank other than 0 may hold only its share of the manifest, and every rank must say the same.
    seen: dict[tuple[str, str], tuple[Problem, set[int]]] = {}
    for r, (problems, _) in enumerate(reports):
        for problem in problems:
            seen.setdefault((problem.path, problem.what), (problem, set()))[1].add(r)
    merged = sorted((problem for problem, _ in seen.values()), key=lambda p: p.path)
    error = damaged(data, merged, then)
    if error is None:
        return
    # Presence and sizes of a file are checked by rank 0 and by the rank that wrote it (its checkers):
    # say so when only one of them saw a problem.
    writer = {p.path: p.rank for p in merged if p.rank is not None} if manifest is not None else {}
    size_problems = {key: rs for key, (_, rs) in seen.items() if "corrupted" not in key[1]}
    partial = sorted({r for rs in size_problems.values() for r in rs})
    checkers = {path: {r for r in (0, writer.get(path, 0)) if r < where.world_size} for path, _ in seen}
    if partial and any(not checkers[key[0]] <= rs for key, rs in size_problems.items()):
        shown = ", ".join(map(str, partial))
        raise CheckpointError(
            f"{error} (seen by rank(s) {shown} of {where.world_size}; rank {partial[0]}'s report)"
        )
    raise error


#: How a load checks checksums, besides ``False`` (not at all) and ``True`` (``"before"``).
VerifyMode = Literal["before", "during"]

#: What a checksum error found after a ``"during"`` read adds to its message.
AFTER_READ = (
    "The load had already read the model's tensors from it (the optimizers were not set): build the"
    " model again, or restart, before you load another checkpoint."
)
#: What it adds after a ``"before"`` (``True``) read, whose values wait beside the model until checked.
UNCHANGED = "Nothing was loaded from it: the model and the optimizers are as they were."


def verify_mode(verify: bool | str | None) -> VerifyMode | None:
    """The mode a ``verify=`` argument asks for (``True``: ``"before"``; ``False``: ``None``, no checksums;
    a mode or ``None`` as it is); anything else raises a ``ValueError`` naming the values accepted."""
    if verify is None or isinstance(verify, bool):
        return "before" if verify else None
    if verify in ("before", "during"):
        return cast(VerifyMode, verify)
    raise ValueError(
        f"verify={verify!r} is not a way to check a checkpoint: pass False, True (or 'before': nothing is"
        " loaded from a damaged checkpoint) or 'during' (the load's reads go straight into the model)."
    )


class ReadChecksums:
    """The CRC-32 of the byte ranges a DCP reader read straight into their targets, per file: what the
    backend's reader is given to record into (its ``checksums=``).

    ``ranges`` maps a file's path relative to the checkpoint to ``(offset, length, crc32)`` of each range.
    """

    def __init__(self) -> None:
        self.ranges: dict[str, list[tuple[int, int, int]]] = {}
        self._last: int | None = None

    def add(self, relative: str, offset: int, length: int, crc: int) -> None:
        self.ranges.setdefault(relative, []).append((offset, length, crc))
        self._last = crc

    def take(self) -> int | None:
        """The CRC-32 of the range added last, once: called as its item is committed (a direct read is
        recorded right before its commit, in the same thread), ``None`` for an item read otherwise."""
        last, self._last = self._last, None
        return last

    def covered(self) -> dict[str, int]:
        """Bytes read (and checksummed) of each file."""
        return {path: sum(length for _, length, _ in ranges) for path, ranges in self.ranges.items()}


class ReadVerification:
    """The checksums of one sharded load, from what its reads saw (see the module doc).

    Args:
        found: The sharded checkpoint, with its manifest, on a backend whose reader records checksums.
        alone: Check in this process only, whatever process group is up (the single-process tools);
            otherwise :meth:`check` and :meth:`reading` are collective over the default group.
        then: What a checksum error found after the read adds to its message (what the reader holds).
    """

    def __init__(self, found: Found, *, alone: bool = False, then: str = AFTER_READ) -> None:
        if not self.applies(found):
            raise ValueError("a ReadVerification needs a manifest and a backend that reads checksums")
        self.found = found
        self.alone = alone
        self.then = then
        #: Given to the DCP reader: the ranges it read and their CRC-32.
        self.checksums = ReadChecksums()

    @staticmethod
    def applies(found: Found) -> bool:
        """Whether ``found`` can be verified from its reads (a manifest, and a reader that records)."""
        return found.manifest is not None and found.backend.reads_checksums

    def check_sizes(self, weights_only: bool | None = False) -> None:
        """Before the first read: every file present with its size (collective, unless ``alone``). If one
        is not, every file's checksum is computed too, so the ``CheckpointError`` (the same on every rank)
        names every damaged file, as a check before the read would."""
        try:
            check_found(self.found, verify=False, alone=self.alone, weights_only=weights_only)
        except CheckpointError:
            check_found(self.found, verify=True, alone=self.alone, weights_only=weights_only)
            raise

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around a read that every rank fails alike (a collective read): a ``CheckpointError`` raised in
        it is replaced by the damage the files' checksums show, if any (collective, then)."""
        try:
            yield
        except CheckpointError as err:
            try:
                check_found(self.found, verify=True, alone=self.alone)
            except CheckpointError as damage:
                raise damage from err
            raise

    def check(self) -> None:
        """Compare every file's checksum with the manifest, after the read. Collective.

        Raises:
            CheckpointError: a file's bytes differ from what was written (the same error on every rank).
        """
        found, manifest = self.found, self.found.manifest
        assert manifest is not None
        where = collective.ranks(alone=self.alone)
        covered = collective.all_gather(self.checksums.covered(), where)
        owners: dict[str, int] = {}
        for entry in manifest.files:
            counts = [read.get(entry.path, 0) for read in covered]
            if max(counts):
                owners[entry.path] = counts.index(max(counts))  # the rank that read most of it (lowest)
        unread = split_by_size([e for e in manifest.files if e.path not in owners], where.world_size)
        mine = [e for e in manifest.files if owners.get(e.path) == where.rank] + unread[where.rank]
        report: tuple[list[Problem], str | None] = ([], None)
        try:
            for entry in mine:
                known = self.checksums.ranges.get(entry.path, [])
                size, checksum = found.backend.checksum(join(found.data, entry.path), known=known)
                if problem := size_problem(entry, size) or checksum_problem(entry, manifest, checksum):
                    report[0].append(problem)
        except OSError as err:
            report = ([], f"Could not read {str(found.data)!r} to check its checksums: {err!r}")
        raise_agreed(report, where, found.data, manifest, self.then)


def prepare_read(
    found: Found,
    verify: bool,
    weights_only: bool | None = True,
    *,
    during: bool = True,
    then: str = AFTER_READ,
) -> ReadVerification | None:
    """The checks of a sharded checkpoint's files before one process reads all of them (the offline tools).

    With ``verify``, ``during`` and a manifest, on local files: presence and sizes now, and a
    :class:`ReadVerification` returned, whose checksums the reads complete (call its ``check`` after the
    last read, before anything is published; ``then`` is what its error adds). Otherwise
    :func:`check_found` (every checksum now with ``verify``) and ``None``.
    """
    if verify and found.manifest is None:
        log.warning(
            "%s has no manifest (it was written without lightning_sharded): there are no checksums to"
            " verify; checked presence and sizes only",
            found.data,
        )
    if verify and during and ReadVerification.applies(found):
        verification = ReadVerification(found, alone=True, then=then)
        verification.check_sizes(weights_only)
        return verification
    check_found(found, verify=verify, alone=True, weights_only=weights_only)
    return None
