"""Atomic commits of checkpoints: write elsewhere, fsync, then publish with one rename.

Two entry points, one per kind of checkpoint:

- :func:`commit_directory` (collective): a sharded checkpoint directory written by every rank, for
  example through ``torch.distributed.checkpoint.save`` plus Lightning's ``meta.pt``;
- :func:`commit_file` (one process): a full checkpoint file, for example ``torch.save``.

Both take the target path and a ``write`` callable that writes the checkpoint into the path it is
given (a fresh staging directory, or a temporary file name). How it works, on a POSIX filesystem:

1. rank 0 applies the recovery rules (below) for the target, removes the leftovers of crashed
   saves of the same target, creates ``.<name>.staging-<token>`` next to it and broadcasts the name;
2. every rank calls ``write(staging)``; then reads back, checksums and fsyncs the files it wrote
   (``__<rank>_*`` for a rank other than 0; rank 0 takes everything else, ``.metadata`` and
   ``meta.pt`` included), and the entries are gathered on rank 0;
3. rank 0 writes the manifest (:data:`~lightning_sharded.checkpoint.manifest.MANIFEST_NAME`, via a
   temporary file and a rename) and fsyncs it and the staging directory;
4. rank 0 publishes: onto a free path with ``rename``; over an existing checkpoint (directory or
   file) with ``renameat2(RENAME_EXCHANGE)``, one atomic swap, where Linux and the filesystem
   support it, else with two renames (target to ``.<name>.old-<token>``, staging to target). It
   fsyncs the parent directory, then removes the previous version (renamed to
   ``.<name>.trash-<token>`` first, then deleted);
5. rank 0 broadcasts the outcome; every rank returns or raises the same error.

A save replaces a previous checkpoint (directory or file) or an empty directory, never a non-empty
directory that is not a checkpoint: that raises ``IsADirectoryError`` (wrapped in ``CheckpointError``
by :func:`commit_directory`) and changes nothing.

Guarantees (one save per target path at a time): a crash of any rank at any moment, SIGKILL and
power loss included, leaves at the path either the previous checkpoint, untouched, or the new one,
complete with its manifest; never a mix and never nothing where there was a checkpoint. An exception
on any rank (``write`` raising, disk full) removes the staging directory and raises on every rank,
the previous checkpoint unchanged.

Recovery rules (:func:`resolve`, applied read-only by every load, and for real by the next save):

- the path exists: it is the checkpoint; every ``.<name>.staging-*``, ``.<name>.trash-*`` and
  ``.<name>.old-*`` next to it is a leftover, ignored by loads and deleted by the next save;
- the path does not exist but ``.<name>.old-<token>`` does (a crash between the two renames of the
  fallback publish): the newest such ``old`` is the checkpoint; the next save renames it back.

Fault injection (tests only): set :data:`FAULT_ENV` to ``<point>`` or ``<point>@<rank>`` (a
:class:`FaultPoint` value) and the matching rank kills itself with SIGKILL at that point.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest, file_checksum

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "FAULT_ENV",
    "FaultPoint",
    "LocalPublisher",
    "Publisher",
    "commit_directory",
    "commit_file",
    "leftovers",
    "remove_checkpoint",
    "resolve",
]

log = logging.getLogger(__name__)

#: Environment variable naming a fault-injection point (tests only), see :class:`FaultPoint`.
FAULT_ENV = "LIGHTNING_SHARDED_FAULT"
#: Set to ``1`` to never use ``renameat2(RENAME_EXCHANGE)`` and publish with the two-rename fallback.
NO_EXCHANGE_ENV = "LIGHTNING_SHARDED_NO_RENAME_EXCHANGE"

STAGING = "staging"
OLD = "old"
TRASH = "trash"
_KINDS = (STAGING, OLD, TRASH)


class FaultPoint(str, Enum):
    """Where a rank may be told to SIGKILL itself during a commit (tests only, via :data:`FAULT_ENV`)."""

    AFTER_WRITE = "after_write"
    """``write(staging)`` returned on this rank; nothing checksummed yet."""
    BEFORE_MANIFEST = "before_manifest"
    """Every rank's files are checksummed and fsynced; rank 0 has not written the manifest."""
    BEFORE_PUBLISH = "before_publish"
    """The staging directory is complete with its manifest; nothing renamed yet."""
    BETWEEN_RENAMES = "between_renames"
    """Fallback publish only: the target is renamed to ``old``; the staging one is not yet in place."""
    AFTER_PUBLISH = "after_publish"
    """The new version is in place; the previous one is not yet removed."""
    DURING_REMOVE = "during_remove"
    """The previous version is renamed to ``trash`` and partly deleted."""


def _fault(point: FaultPoint, rank: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    name, _, who = spec.partition("@")
    if name == point.value and (not who or int(who) == rank):
        log.warning("fault injection: rank %d kills itself at %s", rank, point.value)
        os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------------------- names


def _token() -> str:
    # Time first (fixed width hex), so tokens sort by creation time; random tail for uniqueness.
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:8]}"


def _sibling(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{_token()}"


def leftovers(path: str | os.PathLike[str], kind: str | None = None) -> list[Path]:
    """The staging, old and trash siblings of a checkpoint path left by saves, oldest first.

    Args:
        path: The checkpoint path (file or directory).
        kind: ``"staging"``, ``"old"`` or ``"trash"``; ``None`` for all three.
    """
    target = Path(path)
    kinds = _KINDS if kind is None else (kind,)
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.({'|'.join(kinds)})-([0-9a-f]{{24}})$")
    try:
        names = os.listdir(target.parent)
    except FileNotFoundError:
        return []
    found = [(m.group(2), target.parent / n) for n in names if (m := pattern.match(n))]
    return [p for _, p in sorted(found)]


def resolve(path: str | os.PathLike[str]) -> Path:
    """The path a load should read for checkpoint ``path``, after the recovery rules; changes nothing.

    Returns ``path`` itself when it exists; else the newest ``.<name>.old-<token>`` sibling (left by a
    crash between the two renames of a fallback publish) when there is one; else ``path`` (which does
    not exist, for the caller to report).
    """
    target = Path(path)
    if os.path.lexists(target):
        return target
    olds = leftovers(target, OLD)
    return olds[-1] if olds else target


# ---------------------------------------------------------------------------------- disk helpers


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with ``renameat2(RENAME_EXCHANGE)``; ``False`` where unsupported."""
    global _renameat2
    if os.environ.get(NO_EXCHANGE_ENV) == "1":
        return False
    if _renameat2 is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            _renameat2 = libc.renameat2
            _renameat2.argtypes = [
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_uint,
            ]
            _renameat2.restype = ctypes.c_int
        except (OSError, AttributeError):
            _renameat2 = False
    if _renameat2 is False:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {str(a)!r} and {str(b)!r}: {os.strerror(err)}")


def _delete(path: Path, *, rank: int = 0) -> None:
    """Delete a file or tree that no reader uses any more (already renamed away)."""
    if path.is_dir() and not path.is_symlink():
        first = True
        for root, dirs, files in os.walk(path, topdown=False):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(root, name))
                if first:
                    first = False
                    _fault(FaultPoint.DURING_REMOVE, rank)
            for name in dirs:
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(os.path.join(root, name))
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _discard(path: Path, *, rank: int = 0) -> None:
    """Rename ``path`` to a trash sibling (atomic), then delete it."""
    trash = _sibling(path if not path.name.startswith(".") else _owner(path), TRASH)
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    _delete(trash, rank=rank)


def _owner(sibling: Path) -> Path:
    """The checkpoint path a ``.<name>.<kind>-<token>`` sibling belongs to."""
    m = re.match(rf"^\.(.+)\.({'|'.join(_KINDS)})-[0-9a-f]{{24}}$", sibling.name)
    return sibling.parent / m.group(1) if m else sibling


# -------------------------------------------------------------------------------------- publish


class Publisher:
    """How a staged checkpoint becomes visible at its path; one implementation per kind of storage.

    :func:`commit_directory` and :func:`commit_file` only call these four methods, on rank 0 (except
    :meth:`stage`'s result, which is broadcast). Object storage, which has no atomic rename, can
    publish by writing the manifest last instead.
    """

    def prepare(self, target: Path) -> None:
        """Apply the recovery rules for ``target`` and delete the leftovers of crashed saves."""
        raise NotImplementedError

    def stage(self, target: Path, *, directory: bool) -> Path:
        """Create (for a directory) or name (for a file) a fresh staging location next to ``target``."""
        raise NotImplementedError

    def publish(self, staged: Path, target: Path, *, rank: int = 0) -> None:
        """Make ``staged`` (complete and durable) visible at ``target``, then drop the previous version."""
        raise NotImplementedError

    def discard(self, staged: Path) -> None:
        """Delete a staging location after a failed save."""
        raise NotImplementedError


def _refuse_foreign_directory(target: Path) -> None:
    """A save replaces a previous checkpoint, never a directory of something else (it would delete it)."""
    if not target.is_dir() or target.is_symlink():
        return
    names = os.listdir(target)
    if not names or any(
        n in (MANIFEST_NAME, ".metadata", "meta.pt") or (n.startswith("__") and n.endswith(".distcp"))
        for n in names
    ):
        return
    listed = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
    raise IsADirectoryError(
        f"The checkpoint path {str(target)!r} is a directory that is not a checkpoint (it holds {listed});"
        " saving would replace and delete it. Choose another path, or remove the directory first."
    )


class LocalPublisher(Publisher):
    """Publishing on a local or POSIX network filesystem, by rename."""

    def prepare(self, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        _refuse_foreign_directory(target)
        olds = leftovers(target, OLD)
        if not os.path.lexists(target) and olds:
            newest = olds.pop()
            log.warning("Recovering checkpoint %s from %s left by an interrupted save", target, newest.name)
            os.rename(newest, target)
            _fsync_dir(target.parent)
        for stale in leftovers(target, STAGING) + leftovers(target, TRASH) + olds:
            if stale.exists():
                log.info("Removing %s left by an interrupted save", stale)
                _delete(stale)

    def stage(self, target: Path, *, directory: bool) -> Path:
        staged = _sibling(target, STAGING)
        if directory:
            staged.mkdir()
        return staged

    def publish(self, staged: Path, target: Path, *, rank: int = 0) -> None:
        parent = target.parent
        if not os.path.lexists(target):
            os.rename(staged, target)
            _fsync_dir(parent)
            return
        if _exchange(staged, target):
            previous = staged  # after the swap, the staging name holds the previous version
        else:
            previous = _sibling(target, OLD)
            os.rename(target, previous)
            _fault(FaultPoint.BETWEEN_RENAMES, rank)
            os.rename(staged, target)
        # Published: from here on a failure leaves leftovers for the next save, not a failed save.
        try:
            _fsync_dir(parent)
            _fault(FaultPoint.AFTER_PUBLISH, rank)
            trash = _sibling(target, TRASH)
            os.rename(previous, trash)
            _delete(trash, rank=rank)
            _fsync_dir(parent)
        except OSError as err:
            log.warning(
                "Checkpoint %s is published, but removing the previous version failed (%s); the next save"
                " of this path removes it",
                target,
                err,
            )

    def discard(self, staged: Path) -> None:
        _delete(staged)


# ------------------------------------------------------------------------------------- commits


def _dist(group: ProcessGroup | None) -> tuple[int, int, int]:
    """(rank in group, world size of group, global rank of the group's rank 0)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, 0
    src = dist.get_global_rank(group, 0) if group is not None else 0
    return dist.get_rank(group), dist.get_world_size(group), src


def _broadcast(obj: Any, src: int, group: ProcessGroup | None, world_size: int) -> Any:
    if world_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _all_gather(obj: Any, group: ProcessGroup | None, world_size: int) -> list[Any]:
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def _walk(root: Path) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            yield name if rel == "." else f"{Path(rel).as_posix()}/{name}"


def _own_files(staging: Path, rank: int) -> list[str]:
    """The files a rank other than 0 claims: DCP names its shard files ``__<rank>_<i>.distcp``."""
    prefix = f"__{rank}_"
    return [rel for rel in _walk(staging) if "/" not in rel and rel.startswith(prefix)]


def _checksum(file: Path, known: tuple[int, str] | None) -> tuple[int, str]:
    """Size and CRC-32 of a file just written: ``known`` (computed while writing) if the size on disk
    agrees, else read back. Either way the file is fsynced."""
    if known is not None and file.stat().st_size == int(known[0]):
        _fsync_file(file)
        return int(known[0]), str(known[1])
    return file_checksum(file, fsync=True)


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def commit_directory(
    path: str | os.PathLike[str],
    write: Callable[[Path], Mapping[str, tuple[int, str]] | None],
    *,
    metadata: Mapping[str, Any] | None = None,
    group: ProcessGroup | None = None,
    publisher: Publisher | None = None,
) -> None:
    """Write a sharded checkpoint directory at ``path`` atomically; collective over ``group``.

    Every rank of ``group`` (the default group when ``None``; no process group at all works as one
    rank) must call it with the same ``path``; rank 0's ``path`` and ``metadata`` are used.

    Args:
        path: The checkpoint directory. It may exist (a previous checkpoint, directory or full file,
            which is replaced only once the new one is complete) or not (parents are created).
        write: Called on every rank with the staging directory (empty, existing); writes this rank's
            part of the checkpoint there, for example ``dcp.save(state, checkpoint_id=staging)`` and,
            on rank 0, ``torch.save(meta, staging / "meta.pt")``. Shard files other than rank 0's
            must be named ``__<rank>_*`` (as DCP does) to be checksummed by their own rank; any other
            file is checksummed by rank 0. It may return ``{relative path: (size, crc32 hex)}`` for
            files it checksummed while writing
            (:class:`~lightning_sharded.checkpoint.dcp_writer.ChecksummingWriter`): those are not read
            back, only their sizes checked and the files fsynced.
        metadata: Recorded in the manifest (rank 0's value), e.g. ``{"epoch": 3, "global_step": 120}``;
            JSON-serializable values.
        group: The process group of the ranks that write.
        publisher: How to publish; :class:`LocalPublisher` (rename) by default.

    Raises:
        CheckpointError: another rank failed while writing, rank 0 failed to publish, or a collective of
            the commit failed (a rank died).
        BaseException: the exception ``write`` raised on this rank (``OSError`` for a full disk, DCP's
            ``CheckpointException``...), re-raised after every rank has learned of it. In both cases
            the staging directory is removed and the previous checkpoint is unchanged.
    """
    publisher = publisher or LocalPublisher()
    rank, world_size, src = _dist(group)
    target = Path(path).absolute()
    started = time.perf_counter()

    # 1. rank 0: recovery, cleanup, staging directory; everyone learns its name (or the error).
    prepared: tuple[str | None, str | None] = (None, None)
    if rank == 0:
        try:
            publisher.prepare(target)
            prepared = (str(publisher.stage(target, directory=True)), None)
        except Exception as err:
            prepared = (None, _describe(err))
    try:
        staged_name, error = _broadcast(prepared, src, group, world_size)
    except Exception as err:
        if rank == 0 and prepared[0] is not None:
            publisher.discard(Path(prepared[0]))
        raise _lost_rank(target, "before writing", err) from err
    if staged_name is None:
        raise CheckpointError(
            f"Could not prepare the checkpoint directory {str(target)!r} on rank 0: {error}. Check that the"
            " parent directory is writable and has space; the previous checkpoint is unchanged."
        )
    staging = Path(staged_name)

    # 2. every rank writes, then checksums and fsyncs its own files.
    entries: list[FileEntry] = []
    known: dict[str, tuple[int, str]] = {}
    own_error: BaseException | None = None
    t_write = time.perf_counter()
    try:
        known = dict(write(staging) or {})
        _fault(FaultPoint.AFTER_WRITE, rank)
        t_write = time.perf_counter() - t_write
        if rank != 0:
            for rel in _own_files(staging, rank):
                size, checksum = _checksum(staging / rel, known.get(rel))
                entries.append(FileEntry(rel, size, checksum, rank))
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        own_error = err
    try:
        reports = _all_gather(
            (entries, None if own_error is None else _describe(own_error)), group, world_size
        )
    except Exception as err:
        if rank == 0:
            publisher.discard(staging)
        raise _lost_rank(target, "after writing, before publishing", err) from err
    failures = [(r, msg) for r, (_, msg) in enumerate(reports) if msg is not None]
    if failures:
        if rank == 0:
            publisher.discard(staging)
        if own_error is not None:
            raise own_error
        who = ", ".join(f"rank {r} ({msg})" for r, msg in failures)
        raise CheckpointError(
            f"Saving the checkpoint {str(target)!r} failed on {who}. The partial save was removed and the"
            " previous checkpoint at that path, if any, is unchanged."
        )

    # 3. + 4. rank 0: its files and any unclaimed file, the manifest, the publish.
    outcome: str | None = None
    if rank == 0:
        t_sum = time.perf_counter()
        try:
            claimed = {e.path: e for rank_entries, _ in reports for e in rank_entries}
            for rel in _walk(staging):
                if rel not in claimed and rel != MANIFEST_NAME:
                    size, checksum = _checksum(staging / rel, known.get(rel))
                    claimed[rel] = FileEntry(rel, size, checksum, 0)
            for dirpath, _, _ in os.walk(staging):
                _fsync_dir(Path(dirpath))
            t_sum = time.perf_counter() - t_sum
            _fault(FaultPoint.BEFORE_MANIFEST, rank)
            manifest = Manifest(
                files=sorted(claimed.values(), key=lambda e: e.path),
                world_size=world_size,
                metadata=dict(metadata or {}),
            )
            _write_manifest(staging, manifest)
            _fault(FaultPoint.BEFORE_PUBLISH, rank)
            t_pub = time.perf_counter()
            publisher.publish(staging, target, rank=rank)
            t_pub = time.perf_counter() - t_pub
            log.info(
                "Committed checkpoint %s: %d files, %.1f MB, %d ranks in %.2fs (write %.2fs, checksum %.2fs,"
                " publish %.2fs)",
                target,
                len(manifest.files),
                manifest.total_size / 1e6,
                world_size,
                time.perf_counter() - started,
                t_write,
                t_sum,
                t_pub,
            )
        except Exception as err:
            outcome = _describe(err)
            with contextlib.suppress(Exception):
                if staging.exists():
                    publisher.discard(staging)
    else:
        _fault(FaultPoint.BEFORE_MANIFEST, rank)
        _fault(FaultPoint.BEFORE_PUBLISH, rank)
    try:
        outcome = _broadcast(outcome, src, group, world_size)
    except Exception as err:
        raise _lost_rank(target, "while rank 0 published", err) from err
    if outcome is not None:
        raise CheckpointError(
            f"Publishing the checkpoint {str(target)!r} failed on rank 0: {outcome}. The previous"
            " checkpoint at that path, if any, is unchanged; check the filesystem and save again."
        )


def _lost_rank(target: Path, stage: str, err: Exception) -> CheckpointError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return CheckpointError(
        f"Saving the checkpoint {str(target)!r} failed {stage}: a collective failed, most likely because"
        f" another rank died ({type(err).__name__}: {first}). The path holds the previous checkpoint or"
        " this one, whole, never a mix; check the other ranks' logs, then resume from it."
    )


def _write_manifest(directory: Path, manifest: Manifest) -> None:
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_NAME)
    _fsync_dir(directory)


def commit_file(
    path: str | os.PathLike[str],
    write: Callable[[Path], None],
    *,
    publisher: Publisher | None = None,
) -> None:
    """Write a full checkpoint file at ``path`` atomically; called by one process (rank 0).

    ``write`` is called with a temporary file name next to ``path`` (same directory, so the rename is
    atomic), e.g. ``lambda tmp: torch.save(checkpoint, tmp)``. The file is fsynced, then published
    over ``path`` (a previous file, or a previous sharded directory, swapped atomically), and the
    directory fsynced. A crash at any moment leaves the previous checkpoint or the new file at
    ``path``; an exception in ``write`` removes the temporary file and is re-raised.

    Args:
        path: The checkpoint file.
        write: Writes the whole checkpoint into the path it is given.
        publisher: How to publish; :class:`LocalPublisher` (rename) by default.
    """
    publisher = publisher or LocalPublisher()
    target = Path(path).absolute()
    publisher.prepare(target)
    staged = publisher.stage(target, directory=False)
    try:
        write(staged)
        if not staged.is_file():
            raise CheckpointError(
                f"The write function given to commit_file did not create the file {str(staged)!r} it was"
                f" given; nothing was written to {str(target)!r}."
            )
        _fsync_file(staged)
        _fault(FaultPoint.BEFORE_PUBLISH, 0)
        publisher.publish(staged, target)
    except BaseException:
        with contextlib.suppress(Exception):
            if os.path.lexists(staged):
                publisher.discard(staged)
        raise


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Remove a checkpoint directory or file, with the leftovers of its interrupted saves.

    The checkpoint is first renamed to a hidden ``trash`` sibling (atomic: a crash leaves it either in
    place or gone from ``path``), then deleted. Leftover ``old`` versions are removed first, so an
    interrupted removal never brings an older checkpoint back through :func:`resolve`.

    Raises:
        FileNotFoundError: there is no checkpoint at ``path``.
    """
    target = Path(path).absolute()
    olds = leftovers(target, OLD)
    if not os.path.lexists(target) and not olds:
        raise FileNotFoundError(f"There is no checkpoint to remove at {str(target)!r}.")
    for stale in olds:
        _discard(stale)
    if os.path.lexists(target):
        _discard(target)
    for stale in leftovers(target, STAGING) + leftovers(target, TRASH):
        _delete(stale)
    if target.parent.exists():
        _fsync_dir(target.parent)
