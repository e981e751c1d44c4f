"""The one commit protocol: write elsewhere, make durable, then publish; over either backend.

:func:`commit_directory` (collective) commits a sharded checkpoint written by every rank, in the phases
of :class:`_Commit`; :func:`commit_file` (one process) a full checkpoint file. What each step does on
disk is the backend's. Every decision is taken once and shared: a rank never raises alone while the
others wait in a collective. A collective that fails (a rank died) leaves the staged data for the next
save to remove, as a crash would. The steps and the guarantees: ``docs/checkpoint-format.md``, "How a
save commits" and "Guarantees".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_sharded.checkpoint import collective
from lightning_sharded.checkpoint.backends import (
    Backend,
    Location,
    absolute,
    backend_for,
    leftovers,
    local_path,
    location,
    parent,
    resolve,
)
from lightning_sharded.checkpoint.errors import CheckpointError, StorageError
from lightning_sharded.checkpoint.failures import Failure, Space, failures_of, save_failed
from lightning_sharded.checkpoint.faults import FaultPoint, fault
from lightning_sharded.checkpoint.manifest import FileEntry, FrozenPart, Manifest
from lightning_sharded.checkpoint.presence import RanksLost
from lightning_sharded.checkpoint.space import refusal

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "commit_directory",
    "commit_file",
    "leftovers",
    "remove_checkpoint",
    "resolve",
]

log = logging.getLogger(__name__)

#: ``write(staging)``: writes this rank's files; may return ``{relative path: (size, crc32 hex)}``.
WriteFn = Callable[[Any], "Mapping[str, tuple[int, str]] | None"]


def _target(path: str | os.PathLike[str] | Location) -> Location:
    return absolute(location(path))


def commit_directory(
    path: str | os.PathLike[str],
    write: WriteFn,
    *,
    metadata: Mapping[str, Any] | None = None,
    group: ProcessGroup | None = None,
    backend: Backend | None = None,
    frozen: FrozenPart | None = None,
    needed: int | None = None,
    check_space: bool = True,
    alone: bool = False,
) -> None:
    """Write a sharded checkpoint at ``path`` atomically; collective over ``group``.

    Every rank of ``group`` must call it with the same ``path``; rank 0's ``path`` and ``metadata`` are
    used.

    Args:
        path: The checkpoint directory, local or an fsspec URL. It may exist (a previous checkpoint,
            directory or full file, replaced only once the new one is complete) or not.
        write: Called on every rank with the staging location (an empty, existing directory locally);
            writes this rank's part of the checkpoint there (``dcp.save(state, checkpoint_id=staging)``
            and, on rank 0, ``meta.pt``). Local shard files other than rank 0's must be named
            ``__<rank>_*`` (as DCP does) to be checksummed by their own rank; any other file is
            checksummed by rank 0. It may (on object storage it must) return ``{relative path: (size,
            crc32 hex)}`` for files it checksummed while writing them: those are not read back.
        metadata: Recorded in the manifest (rank 0's value), e.g. ``{"epoch": 3, "global_step": 120}``.
        group: The process group of the ranks that write (``None``: the :func:`~.collective.scope`'s
            group, else the default group; no process group at all works as one rank).
        backend: The storage; the one of ``path`` (:func:`~.backends.backend_for`) when ``None``.
        frozen: A trainable-only checkpoint: what it leaves out and where that is (rank 0's value),
            recorded in the manifest.
        needed: This rank's estimate of the bytes it writes (:func:`~.space.sharded_share`), or ``None``
            (no estimate; then on every rank): gathered on rank 0, shown in the error of a full disk.
        check_space: Refuse the save, before anything is written, when the local filesystem has less
            free space than the estimates and their margin (:func:`~.space.required`).
        alone: Write in this process only, whatever process group is up (an offline tool's directory:
            the Hugging Face export). An error of ``write`` that no cause of the storage's is behind is
            then raised as it is, as :func:`commit_file` does.

    Raises:
        StorageError: the storage failed (the message starts with the cause: ``No space left on device
            (ENOSPC): ...``; ``errno`` is the cause's), or the save did not fit and was refused. It is a
            ``CheckpointError`` and an ``OSError``.
        CheckpointError: a rank failed while writing, rank 0 failed to prepare or publish, or a
            collective of the commit failed (a rank died or did not come in time: the message names
            it). The same error on every rank, raised from this rank's own error where it had one; the
            previous checkpoint is unchanged. ``KeyboardInterrupt`` and ``SystemExit`` on a rank are
            re-raised there as they are.
    """
    target = _target(path)
    run = _Commit(target, backend or backend_for(target), collective.ranks(group, alone=alone))
    staging = run.share_preparation(run.gather_needs(needed), check_space)
    run.write_and_gather(write, staging)
    outcome: CheckpointError | None = None
    if run.where.rank == 0:
        outcome = run.publish(staging, metadata, frozen)
    elif run.error is None:
        fault(FaultPoint.BEFORE_MANIFEST, run.where.rank)
        fault(FaultPoint.BEFORE_PUBLISH, run.where.rank)
    run.share_outcome(outcome, alone)


@dataclasses.dataclass
class _Commit:
    """One :func:`commit_directory` on one rank: its phases in order, each ending in one collective."""

    target: Location
    backend: Backend
    where: collective.Ranks
    started: float = dataclasses.field(default_factory=time.perf_counter)
    # Phase 1, from rank 0: the version the publish replaces, and the free space.
    previous: str | None = None
    space: Space | None = None
    # Phase 2, this rank's: the files `write` checksummed itself, its seconds, its own error and the
    # failures it names, the local directory of the writes; every rank's (entries, failures) on rank 0.
    files: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    error: BaseException | None = None
    failures: list[Failure] | None = None
    near: Path | None = None
    reports: list[tuple[list[FileEntry], list[Failure] | None]] | None = None

    def lost(self, stage: str, err: Exception) -> CheckpointError:
        """The error of a collective of the commit that failed (a rank died or did not come)."""
        saving, place = f"Saving the checkpoint {str(self.target)!r} failed {stage}", self.backend.place
        if isinstance(err, RanksLost):
            return RanksLost(
                f"{saving}: {err} The {place} holds the previous checkpoint or this one, whole, never a mix;"
                " resume from it.",
                err.ranks,
            )
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return CheckpointError(
            f"{saving}: a collective failed, most likely because another rank died ({type(err).__name__}:"
            f" {first}). The {place} holds the previous checkpoint or this one, whole, never a mix; check"
            " the other ranks' logs, then resume from it."
        )

    def failed(self, failures: list[Failure], stage: str = "write") -> CheckpointError:
        return save_failed(self.target, failures, stage=stage, space=self.space, place=self.backend.place)

    def shared(
        self, share: Callable[[Any, collective.Ranks, str], Any], obj: Any, step: str, stage: str
    ) -> Any:
        """``share(obj, where, step)`` (a gather or a broadcast), whose failure raises :meth:`lost`: as
        after a crash, what was staged is left for the next save to remove."""
        try:
            return share(obj, self.where, step)
        except Exception as err:
            raise self.lost(stage, err) from err

    def gather_needs(self, needed: int | None) -> list[int | None] | None:
        """Phase 0: every rank's estimate, on rank 0 (for the refusal, and the figures of a full disk)."""
        if needed is None:
            return [needed]
        step = "estimating the size of the save"
        needs: list[int | None] | None = self.shared(collective.gather, needed, step, "before writing")
        return needs

    def share_preparation(self, needs: list[int | None] | None, check_space: bool) -> Location:
        """Phase 1: rank 0 recovers, cleans up, checks the space and stages; every rank learns the
        staging location, or raises rank 0's refusal."""
        prepared: tuple[Location | None, str | None, CheckpointError | None, Space | None] = (None,) * 4
        if self.where.rank == 0:
            prepared = _prepare(self.backend, self.target, needs, check_space)
        staging: Location | None
        shared = self.shared(collective.broadcast, prepared, "preparing the save", "before writing")
        staging, self.previous, error, self.space = shared
        if staging is None:
            assert error is not None
            raise error
        return staging

    def write_and_gather(self, write: WriteFn, staging: Location) -> None:
        """Phase 2: every rank writes, then seals its own files; their entries (or failures) go to rank 0."""
        rank, entries = self.where.rank, []
        t_write = time.perf_counter()
        try:
            self.files = write(staging) or {}
            fault(FaultPoint.AFTER_WRITE, rank)
            self.seconds = time.perf_counter() - t_write
            entries = self.backend.seal_own(staging, rank, self.files)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            self.error = err
        if isinstance(self.error, RanksLost):  # a collective inside write failed: the others know it too
            raise self.lost("while writing", self.error) from self.error
        self.near = local_path(staging)
        self.failures = None if self.error is None else failures_of(self.error, rank, self.near)
        # Gathered on rank 0 only (it alone writes the manifest); whether any rank failed travels in the
        # outcome rank 0 broadcasts later, so no rank receives N ranks' entries.
        report = (entries, self.failures)
        self.reports = self.shared(
            collective.gather, report, "gathering the written files", "after writing, before publishing"
        )

    def publish(
        self, staging: Location, metadata: Mapping[str, Any] | None, frozen: FrozenPart | None
    ) -> CheckpointError | None:
        """Phase 3, rank 0: the rest of the files, the manifest, the publish. The outcome: ``None``
        (published), or the error every rank raises."""
        backend, where = self.backend, self.where
        failed = [f for _, rank_failures in self.reports or [] for f in rank_failures or []]
        if failed:
            with contextlib.suppress(Exception):
                backend.discard(staging)
            return self.failed(failed)
        assert self.reports is not None
        publishing = False
        try:
            t_seal = time.perf_counter()
            draft = Manifest(
                files=[], world_size=where.world_size, metadata=dict(metadata or {}), frozen=frozen
            )
            every = [e for rank_entries, _ in self.reports for e in rank_entries]
            manifest = backend.seal(staging, every, self.files, draft)  # durable, the manifest written
            t_seal = time.perf_counter() - t_seal
            fault(FaultPoint.BEFORE_PUBLISH, where.rank)
            t_pub = time.perf_counter()
            publishing = True  # from here on the backend cleans up after its own failures
            backend.publish(staging, self.target, manifest, self.previous, rank=where.rank)
            log.info(
                "Committed checkpoint %s: %d files, %.1f MB, %d ranks in %.2fs (write %.2fs, seal %.2fs,"
                " publish %.2fs)",
                self.target,
                len(manifest.files),
                manifest.total_size / 1e6,
                where.world_size,
                time.perf_counter() - self.started,
                self.seconds,
                t_seal,
                time.perf_counter() - t_pub,
            )
        except Exception as err:
            outcome = self.failed([Failure.of(err, 0, self.near)], "publish" if publishing else "write")
            if not publishing:
                with contextlib.suppress(Exception):
                    backend.discard(staging)
            return outcome
        return None

    def share_outcome(self, outcome: CheckpointError | None, alone: bool) -> None:
        """Phase 4: rank 0's outcome to every rank, which raises it (from its own error, where it had one)."""
        own_error = self.error
        interrupted = (
            own_error if isinstance(own_error, KeyboardInterrupt | SystemExit | GeneratorExit) else None
        )
        try:
            outcome = collective.broadcast(outcome, self.where, "publishing")
        except Exception as err:
            if interrupted is not None:
                raise interrupted from err
            if own_error is not None:  # this rank failed itself: its own error says more
                raise self.failed(self.failures or []) from own_error
            raise self.lost("while rank 0 published", err) from err
        if interrupted is not None:
            raise interrupted
        if alone and own_error is not None and not any(f.errno for f in self.failures or []):
            raise own_error  # the write's own error (no cause of the storage's): its own words
        if outcome is not None:
            raise outcome from own_error


def _prepare(
    backend: Backend, target: Location, needs: list[int | None] | None, check_space: bool
) -> tuple[Location | None, str | None, CheckpointError | None, Space | None]:
    """Rank 0's step 1: ``(staging, previous version, None, space)``, or ``(None, None, error, space)``."""
    space: Space | None = None
    try:
        known = [n for n in needs or [] if n is not None]
        previous, free = backend.prepare(target, directory=True, measure=bool(known))
        if free is not None:
            space = Space(sum(known), free, str(parent(target)))
            refused = refusal(target, space, known, backend.place) if check_space else None
            if refused is not None:
                return None, None, refused, space
        return backend.stage(target, directory=True), previous, None, space
    except Exception as err:
        failure = Failure.of(err, 0, local_path(parent(target)))
        if failure.errno is None:  # a refusal (a directory of something else...): its message says it all
            error = CheckpointError(
                f"Could not prepare the checkpoint {str(target)!r} on rank 0: {collective.describe(err)}"
                f" The previous checkpoint at that {backend.place}, if any, is unchanged."
            )
            return None, None, error, space
        return None, None, save_failed(target, [failure], stage="prepare", place=backend.place), space


def commit_file(
    path: str | os.PathLike[str],
    write: Callable[[Path], None],
    *,
    backend: Backend | None = None,
    needed: int | None = None,
    check_space: bool = True,
) -> None:
    """Write a full checkpoint file at ``path`` atomically; called by one process (rank 0).

    ``write`` is called with a local file name: next to ``path`` locally (same directory, so the rename
    is atomic), in a temporary directory for a URL; e.g. ``lambda tmp: torch.save(checkpoint, tmp)``.
    The file is fsynced, then published over ``path`` (a previous file, or a previous sharded directory,
    swapped atomically; on object storage one upload). A crash at any moment leaves the previous
    checkpoint or the new file at ``path``; an exception in ``write`` removes the file. ``needed``: the
    file's estimated size (:func:`~.space.full_size`): with ``check_space``, a local save is refused
    before anything is written when its filesystem has less free space (and the margin).

    Raises:
        IsADirectoryError: ``path`` is a non-empty local directory that is not a checkpoint.
        StorageError: the storage failed (the message starts with the cause; ``errno`` is the
            cause's), or the file did not fit and was refused; nothing changed at ``path``.
        CheckpointError: ``path`` is a sharded checkpoint on object storage, or ``write`` did not create
            the file.
        Exception: what ``write`` raised, as it is, when no cause of the storage's is behind it.
    """
    target = _target(path)
    backend = backend or backend_for(target)
    try:
        _, free = backend.prepare(target, directory=False, measure=needed is not None)
        space: Space | None = None
        if needed is not None and free is not None:
            space = Space(needed, free, str(parent(target)))
            refused = refusal(target, space, [needed], backend.place) if check_space else None
            if refused is not None:
                raise refused
        staging = backend.stage(target, directory=False)
    except OSError as err:
        if err.errno is None or isinstance(err, StorageError):  # a refusal: its message says it all
            raise
        failure = Failure.of(err, 0, local_path(parent(target)))
        raise save_failed(target, [failure], stage="prepare", place=backend.place) from err
    staged = local_path(staging)  # a local file for every backend (an upload follows on object storage)
    assert staged is not None
    stage = "write"
    try:
        write(staged)
        if not staged.is_file():
            raise CheckpointError(
                f"The write function given to commit_file did not create the file {str(staged)!r} it was"
                f" given; nothing was written to {str(target)!r}."
            )
        fault(FaultPoint.BEFORE_PUBLISH, 0)
        stage = "publish"
        backend.publish_file(staged, target)
    except BaseException as err:
        # measured before the partial file is removed (a full disk shows as such only then)
        measured = Failure.of(err, 0, staged.parent, file=staged) if isinstance(err, Exception) else None
        with contextlib.suppress(Exception):
            if os.path.lexists(staged):
                backend.discard(staged)
        if measured is None or measured.errno is None:  # an interrupt, or the write's own error: as it is
            raise
        raise save_failed(target, [measured], stage=stage, space=space, place=backend.place) from err


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Remove a checkpoint directory or file, with the leftovers of its interrupted saves.

    Locally the checkpoint is first renamed to a hidden ``trash`` sibling (atomic), then deleted;
    leftover ``old`` versions go first, so an interrupted removal never brings an older checkpoint
    back. On object storage the manifest goes first.

    Raises:
        FileNotFoundError: there is no checkpoint at ``path``.
    """
    target = _target(path)
    backend_for(target).remove(target)
