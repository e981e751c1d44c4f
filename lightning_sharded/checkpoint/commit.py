"""The one commit protocol: write elsewhere, make durable, then publish; over either backend.

Two entry points, one per kind of checkpoint:

- :func:`commit_directory` (collective): a sharded checkpoint written by every rank, for example
  through ``torch.distributed.checkpoint.save`` plus Lightning's ``meta.pt``;
- :func:`commit_file` (one process): a full checkpoint file, for example ``torch.save``.

The steps of :func:`commit_directory`, the same for a local path and an fsspec URL (what each step does
on disk is the backend's: :mod:`~lightning_sharded.checkpoint.backends.local` publishes by rename,
:mod:`~lightning_sharded.checkpoint.backends.objstore` by writing the manifest last):

1. rank 0 prepares the target (recovery rules, leftovers of crashed saves removed, a refusal of a
   directory that is not a checkpoint) and stages a fresh location; the outcome is broadcast;
2. every rank calls ``write(staging)``, then seals its own files (checksummed while written or read
   back, fsynced); the entries and any error are gathered on every rank;
3. rank 0 seals the rest (its files, the directories), writes the manifest and publishes;
4. rank 0 broadcasts the outcome; every rank returns or raises the same error.

Every decision is taken once and shared: a rank never raises alone while the others wait in a
collective. Guarantees (one save per target at a time): a crash of any rank at any moment, SIGKILL
and power loss included, leaves at the target either the previous checkpoint, untouched, or the new
one, complete with its manifest. An exception on any rank removes the staged data and raises on every
rank, the previous checkpoint unchanged; a collective that fails (a rank died) leaves the staged data
for the next save to remove, as a crash would.

Fault injection (tests only): :data:`~lightning_sharded.checkpoint.faults.FAULT_ENV`, see
:class:`~lightning_sharded.checkpoint.faults.FaultPoint`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_sharded.checkpoint import collective
from lightning_sharded.checkpoint.backends import Backend, Location, backend_for, location
from lightning_sharded.checkpoint.backends.local import NO_EXCHANGE_ENV, leftovers, resolve
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.faults import FAULT_ENV, FaultPoint, fault
from lightning_sharded.checkpoint.manifest import FileEntry, FrozenPart, Manifest

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "FAULT_ENV",
    "NO_EXCHANGE_ENV",
    "FaultPoint",
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
    loc = location(path) if not isinstance(path, Path) else path
    return loc.absolute() if isinstance(loc, Path) else loc


def commit_directory(
    path: str | os.PathLike[str],
    write: WriteFn,
    *,
    metadata: Mapping[str, Any] | None = None,
    group: ProcessGroup | None = None,
    backend: Backend | None = None,
    frozen: FrozenPart | None = None,
) -> None:
    """Write a sharded checkpoint at ``path`` atomically; collective over ``group``.

    Every rank of ``group`` (the default group when ``None``; no process group at all works as one
    rank) must call it with the same ``path``; rank 0's ``path`` and ``metadata`` are used.

    Args:
        path: The checkpoint directory, local or an fsspec URL. It may exist (a previous checkpoint,
            directory or full file, replaced only once the new one is complete) or not (parents are
            created).
        write: Called on every rank with the staging location (an empty, existing directory locally);
            writes this rank's part of the checkpoint there, for example
            ``dcp.save(state, checkpoint_id=staging)`` and, on rank 0, ``meta.pt``. Local shard files
            other than rank 0's must be named ``__<rank>_*`` (as DCP does) to be checksummed by their
            own rank; any other file is checksummed by rank 0. It may return
            ``{relative path: (size, crc32 hex)}`` for files it checksummed while writing them; those
            are only fsynced and their size checked, not read back. On object storage it must.
        metadata: Recorded in the manifest (rank 0's value), e.g. ``{"epoch": 3, "global_step": 120}``.
        group: The process group of the ranks that write.
        backend: The storage; the one of ``path`` (:func:`~.backends.backend_for`) when ``None``.
        frozen: A trainable-only checkpoint: what it leaves out and where that is (rank 0's value),
            recorded in the manifest.

    Raises:
        CheckpointError: another rank failed while writing, rank 0 failed to prepare or publish, or a
            collective of the commit failed (a rank died).
        BaseException: the exception ``write`` raised on this rank (``OSError`` for a full disk, DCP's
            ``CheckpointException``...), re-raised after every rank has learned of it. In both cases
            the staged data is removed and the previous checkpoint is unchanged.
    """
    target = _target(path)
    backend = backend or backend_for(target)
    where = collective.ranks(group)
    rank = where.rank
    started = time.perf_counter()

    # 1. rank 0: recovery, cleanup, refusal, staging; everyone learns the outcome.
    prepared: tuple[Location | None, str | None, str | None] = (None, None, None)
    if rank == 0:
        try:
            previous = backend.prepare(target, directory=True)
            prepared = (backend.stage(target, directory=True), previous, None)
        except Exception as err:
            prepared = (None, None, collective.describe(err))
    try:
        staging, previous, error = collective.broadcast(prepared, where)
    except Exception as err:  # a rank died: what was staged is left for the next save to remove
        raise _lost_rank(target, "before writing", err, backend.place) from err
    if staging is None:
        raise CheckpointError(
            f"Could not prepare the checkpoint {str(target)!r} on rank 0: {error}. Check that the"
            f" {backend.place} is writable and has space; the previous checkpoint is unchanged."
        )

    # 2. every rank writes, then seals its own files.
    entries: list[FileEntry] = []
    written: Mapping[str, tuple[int, str]] = {}
    own_error: BaseException | None = None
    t_write = time.perf_counter()
    try:
        written = write(staging) or {}
        fault(FaultPoint.AFTER_WRITE, rank)
        t_write = time.perf_counter() - t_write
        entries = backend.seal_own(staging, rank, written)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        own_error = err
    report = (entries, None if own_error is None else collective.describe(own_error))
    try:
        # Gathered on rank 0 only (it alone writes the manifest); whether any rank failed travels in the
        # outcome rank 0 broadcasts below, so no rank receives N ranks' entries.
        reports = collective.gather(report, where)
    except Exception as err:  # a rank died: as after a crash, the next save removes the staged data
        raise _lost_rank(target, "after writing, before publishing", err, backend.place) from err

    # 3. rank 0: the rest of the files, the manifest, the publish. The outcome: None (published), or
    # ("write", who failed) or ("publish", why).
    outcome: tuple[str, str] | None = None
    publishing = False
    failures = [(r, msg) for r, (_, msg) in enumerate(reports or []) if msg is not None]
    if rank == 0 and failures:
        with contextlib.suppress(Exception):
            backend.discard(staging)
        outcome = ("write", ", ".join(f"rank {r} ({msg})" for r, msg in failures))
    elif rank == 0:
        assert reports is not None
        try:
            t_seal = time.perf_counter()
            everything = backend.seal(
                staging, [e for rank_entries, _ in reports for e in rank_entries], written
            )
            t_seal = time.perf_counter() - t_seal
            fault(FaultPoint.BEFORE_MANIFEST, rank)
            manifest = Manifest(
                files=everything,
                world_size=where.world_size,
                metadata=dict(metadata or {}),
                **backend.manifest_fields(staging),
                frozen=frozen,
            )
            backend.write_manifest(staging, manifest)
            fault(FaultPoint.BEFORE_PUBLISH, rank)
            t_pub = time.perf_counter()
            publishing = True  # from here on the backend cleans up after its own failures
            backend.publish(staging, target, manifest, previous, rank=rank)
            log.info(
                "Committed checkpoint %s: %d files, %.1f MB, %d ranks in %.2fs (write %.2fs, seal %.2fs,"
                " publish %.2fs)",
                target,
                len(manifest.files),
                manifest.total_size / 1e6,
                where.world_size,
                time.perf_counter() - started,
                t_write,
                t_seal,
                time.perf_counter() - t_pub,
            )
        except Exception as err:
            outcome = ("publish", collective.describe(err))
            if not publishing:
                with contextlib.suppress(Exception):
                    backend.discard(staging)
    elif own_error is None:
        fault(FaultPoint.BEFORE_MANIFEST, rank)
        fault(FaultPoint.BEFORE_PUBLISH, rank)
    try:
        outcome = collective.broadcast(outcome, where)
    except Exception as err:
        if own_error is not None:  # this rank failed itself: its own error says more
            raise own_error from err
        raise _lost_rank(target, "while rank 0 published", err, backend.place) from err
    if outcome is None:
        return
    stage, message = outcome
    if stage == "write":
        if own_error is not None:
            raise own_error
        raise CheckpointError(
            f"Saving the checkpoint {str(target)!r} failed on {message}. The partial save was removed and the"
            f" previous checkpoint at that {backend.place}, if any, is unchanged."
        )
    raise CheckpointError(
        f"Publishing the checkpoint {str(target)!r} failed on rank 0: {message}. The previous"
        f" checkpoint at that {backend.place}, if any, is unchanged; check the storage and save again."
    )


def _lost_rank(target: Location, stage: str, err: Exception, place: str) -> CheckpointError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return CheckpointError(
        f"Saving the checkpoint {str(target)!r} failed {stage}: a collective failed, most likely because"
        f" another rank died ({type(err).__name__}: {first}). The {place} holds the previous checkpoint"
        " or this one, whole, never a mix; check the other ranks' logs, then resume from it."
    )


def commit_file(
    path: str | os.PathLike[str],
    write: Callable[[Path], None],
    *,
    backend: Backend | None = None,
) -> None:
    """Write a full checkpoint file at ``path`` atomically; called by one process (rank 0).

    ``write`` is called with a local file name: next to ``path`` locally (same directory, so the rename
    is atomic), in a temporary directory for a URL; e.g. ``lambda tmp: torch.save(checkpoint, tmp)``.
    The file is fsynced, then published over ``path`` (a previous file, or a previous sharded directory,
    swapped atomically; on object storage one upload). A crash at any moment leaves the previous
    checkpoint or the new file at ``path``; an exception in ``write`` removes the file and is re-raised.

    Raises:
        IsADirectoryError: ``path`` is a non-empty local directory that is not a checkpoint.
        CheckpointError: ``path`` is a sharded checkpoint on object storage, or ``write`` did not
            create the file.
    """
    target = _target(path)
    backend = backend or backend_for(target)
    backend.prepare(target, directory=False)
    staged = backend.stage(target, directory=False)
    assert isinstance(staged, Path)
    try:
        write(staged)
        if not staged.is_file():
            raise CheckpointError(
                f"The write function given to commit_file did not create the file {str(staged)!r} it was"
                f" given; nothing was written to {str(target)!r}."
            )
        fault(FaultPoint.BEFORE_PUBLISH, 0)
        backend.publish_file(staged, target)
    except BaseException:
        with contextlib.suppress(Exception):
            if os.path.lexists(staged):
                backend.discard(staged)
        raise


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
