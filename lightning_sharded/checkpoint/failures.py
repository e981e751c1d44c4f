"""The one place an ``OSError`` of a save or a load (or torch's report of one) becomes the message of a
:class:`~lightning_sharded.checkpoint.errors.CheckpointError`, with a save's advice on a save and a
load's on a load. With a cause, the message starts with it (``No space left on device (ENOSPC): saving
the checkpoint ... failed on rank(s) 1 ...``) and the error is a ``StorageError`` with its errno.

torch's zip writer swallows the ``OSError`` of a short write and raises ``RuntimeError('... unexpected
pos 704 vs 598')``: the cause is then looked for in the exception's chain, in what DCP gathered from
every rank, and else inferred: a write that failed with less than :data:`NEARLY_FULL` bytes free on
its filesystem ran out of space.
"""

from __future__ import annotations

import contextlib
import errno as errnos
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sharded.checkpoint.errors import CheckpointError, RanksLost, StorageError
from lightning_sharded.checkpoint.progress import MIB, format_size

__all__ = [
    "NEARLY_FULL",
    "Failure",
    "Space",
    "background_failed",
    "dcp_errors",
    "failures_of",
    "free_space",
    "label",
    "named_os_error",
    "os_cause",
    "read_failed",
    "save_failed",
]

#: A write that failed with fewer bytes than this left on its filesystem ran out of space.
NEARLY_FULL = MIB

_CHANGED = (errnos.EISDIR, errnos.ENOTDIR, errnos.EEXIST, errnos.ENOTEMPTY)
_DENIED = (errnos.EACCES, errnos.EPERM)
_BUSY = (errnos.EBUSY, errnos.EAGAIN, errnos.ECONNRESET, errnos.ECONNREFUSED, errnos.ETIMEDOUT, errnos.EPIPE)
# What torch's writers raise when the write under them failed and they dropped its OSError.
_TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed", "iostream error", "basic_ios")


def label(number: int) -> str:
    """``No space left on device (ENOSPC)``: the text of an error number and its name."""
    return f"{os.strerror(number)} ({errnos.errorcode.get(number, str(number))})"


def os_cause(err: BaseException) -> OSError | None:
    """The ``OSError`` with an error number behind ``err``: itself, one in its chain of causes and
    contexts, or one that DCP gathered from a rank (its ``CheckpointException``); ``None`` if none."""
    seen: set[int] = set()
    queue: list[BaseException] = [err]
    while queue:
        current = queue.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno:
            return current
        nested: list[Any] = [current.__cause__, current.__context__, getattr(current, "cause", None)]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            nested += [e for _, e in _rank_errors(failures)]
        queue += [e for e in nested if isinstance(e, BaseException)]
    return None


def _rank_errors(failures: dict[int, Any]) -> list[tuple[int, Any]]:
    """DCP's ``CheckpointException.failures`` (``{rank: (exception, traceback)}``) as (rank, exception)."""
    return [(rank, f[0] if isinstance(f, tuple) else f) for rank, f in sorted(failures.items())]


def named_os_error(err: BaseException, path: str | os.PathLike[str]) -> OSError | None:
    """``err`` as an ``OSError`` naming ``path`` when it is one without a file name (a write's), or
    ``None`` when ``err`` is no ``OSError`` or names its file already."""
    if not isinstance(err, OSError) or not err.errno or err.filename is not None:
        return None
    return OSError(err.errno, err.strerror or os.strerror(err.errno), os.fspath(path))


def free_space(path: str | os.PathLike[str], *, writable: bool = False) -> int | None:
    """Bytes this process may still write on the filesystem of ``path`` (its nearest existing parent),
    from ``statvfs``: the blocks free to unprivileged users, or all free blocks for root (who may use
    the reserved ones). ``None`` where ``statvfs`` is not available. With ``writable``, a filesystem
    mounted read-only raises ``OSError(EROFS)`` naming that parent (its free space means nothing)."""
    if not hasattr(os, "statvfs"):
        return None
    current = Path(path)
    while not current.exists() and current != current.parent:
        current = current.parent
    try:
        stats = os.statvfs(current)
    except OSError:
        return None
    if writable and stats.f_flag & getattr(os, "ST_RDONLY", 1):
        raise OSError(errnos.EROFS, os.strerror(errnos.EROFS), os.fspath(current))
    root = getattr(os, "geteuid", lambda: -1)() == 0
    return (stats.f_bfree if root else stats.f_bavail) * stats.f_frsize


@dataclass(frozen=True)
class Space:
    """A save's bytes (every rank's estimate, margin excluded), the bytes :func:`free_space` found free
    on rank 0 when it started, and the directory measured."""

    needed: int
    free: int | None
    where: str

    def figures(self, *, free: bool = True) -> str:
        """``This save needed about 52.3 MiB there; 31.0 MiB were free when it started (...).``; with
        ``free=False`` (a quota, which ``statvfs`` does not see) the first half only."""
        if not free or self.free is None:
            return f"This save needed about {format_size(self.needed)} there."
        return (
            f"This save needed about {format_size(self.needed)} there; {format_size(self.free)} were free"
            f" when it started (statvfs of {self.where!r})."
        )


@dataclass(frozen=True)
class Failure:
    """One rank's failure in a save or a load, as it travels between ranks (picklable, small).

    Attributes:
        text: ``"TypeName: message"`` of the error.
        errno: The cause's error number (also when inferred from a full filesystem), if any.
        written: Bytes of ``filename`` on disk when it failed (a write's progress), if it is a file.
        free: Bytes free on ``filename``'s filesystem when it failed, if measured.
        inferred: Whether ``errno`` was inferred from the free space (torch hid the ``OSError``).
        reason, advice: The cause's own :attr:`StorageError.reason` and :attr:`StorageError.advice`.
    """

    rank: int
    text: str
    errno: int | None = None
    filename: str | None = None
    written: int | None = None
    free: int | None = None
    inferred: bool = False
    reason: str | None = None
    advice: str | None = None

    @property
    def cause(self) -> str:
        """What leads a message about it: ``No space left on device (ENOSPC)``, or its reason."""
        return self.reason or (label(self.errno) if self.errno else "")

    @classmethod
    def of(
        cls,
        err: BaseException,
        rank: int,
        near: str | os.PathLike[str] | None = None,
        file: str | os.PathLike[str] | None = None,
    ) -> Failure:
        """What ``err`` on ``rank`` was caused by; ``near``: a local directory the failing write was in,
        for an error that names no file (torch's zip writer); ``file``: the file being written, for a
        cause that names none."""
        cause = os_cause(err)
        if cause is not None:
            named = cause.filename if cause.filename is not None else file
            filename = os.fsdecode(named) if named is not None else None
            return cls(
                rank,
                _text(cause),
                cause.errno,
                filename,
                _size(filename),
                free_space(filename) if filename is not None and cause.errno == errnos.ENOSPC else None,
                reason=getattr(cause, "reason", None),
                advice=getattr(cause, "advice", None),
            )
        text = _text(err)
        if near is not None and any(marker in str(err) for marker in _TORCH_WRITE_FAILED):
            free = free_space(near)
            if free is not None and free < NEARLY_FULL:
                return cls(rank, text, errnos.ENOSPC, os.fspath(near), None, free, inferred=True)
        return cls(rank, text)

    def detail(self) -> str:
        """``rank 1: '.../__1_0.distcp', 12.0 MiB written, 0 B free: OSError: [Errno 28] ...``."""
        where = f" {self.filename!r}" if self.filename else ""
        figures = [f"{format_size(self.written)} written"] if self.written is not None else []
        if self.free is not None:
            figures.append(f"{format_size(self.free)} free")
        shown = f"{where} ({', '.join(figures)})" if figures else where
        if self.inferred:
            return f"rank {self.rank}:{shown}: torch's writer failed ({self.text}) on a full filesystem"
        return f"rank {self.rank}:{shown}{':' if shown else ''} {self.text}"


def _text(err: BaseException) -> str:
    if isinstance(err, StorageError):
        return err.summary or str(err)
    if isinstance(err, OSError) and err.errno and err.strerror:
        return str(err.strerror)  # the file and the errno are shown beside it
    message = str(err).strip().splitlines()
    return f"{type(err).__name__}: {message[0] if message else ''}".rstrip(": ")


def _size(filename: str | None) -> int | None:
    try:
        return os.stat(filename).st_size if filename is not None and os.path.isfile(filename) else None
    except OSError:
        return None


def failures_of(err: BaseException, rank: int, near: str | os.PathLike[str] | None = None) -> list[Failure]:
    """The failures behind ``err``: the ranks DCP named (a save or load through DCP fails on every rank
    with every failing rank's error), or this rank's own."""
    named = getattr(err, "rank_failures", None)
    if isinstance(named, list) and named:
        return named
    raw = getattr(err, "failures", None)  # DCP's own CheckpointException: {rank: (exception, traceback)}
    if isinstance(raw, dict) and raw:
        return [Failure.of(e, r, near) for r, e in _rank_errors(raw)]
    return [Failure.of(err, rank, near)]


def _hint(number: int | None, saving: bool, advice: str | None = None) -> str:
    if advice is not None:
        return advice
    uid = getattr(os, "geteuid", lambda: None)()
    user = f" (user id {uid})" if uid is not None else ""
    if saving:
        if number == errnos.ENOSPC:
            return (
                "Free space there (keep fewer checkpoints: `ModelCheckpoint(save_top_k=...)`), or save to"
                " another filesystem, then save again."
            )
        if number == errnos.EDQUOT:
            return (
                "Your disk quota there is used up (see `quota -s` or your cluster's quota tool): free some"
                " of it, ask for more, or save to another filesystem."
            )
        if number == errnos.EROFS:
            return "The filesystem is mounted read-only: remount it read-write, or save to another path."
        if number in _DENIED:
            return (
                f"This process{user} may not write there: fix the directory's permissions, or save elsewhere."
            )
        if number in _CHANGED:
            return (
                "Something else changed that path while the save ran (another job saving there?): make"
                " sure one job at a time saves to a checkpoint path."
            )
    elif number == errnos.ENOENT:
        return "A file of the checkpoint is missing: restore it from a copy, or load an earlier checkpoint."
    elif number in _DENIED:
        return f"This process{user} may not read it: fix the permissions of the checkpoint's files."
    if number == errnos.EIO:
        return "The device reported an I/O error: check the disk and the kernel log (`dmesg`)."
    if number in (errnos.EMFILE, errnos.ENFILE):
        return "Too many open files: raise the limit (`ulimit -n`)."
    if number in _BUSY:
        return "The storage is busy or did not answer: try again later."
    if saving:
        return "Check that the storage is writable and has space."
    return "Check that the checkpoint is complete and readable (every *.distcp file its .metadata names)."


def _error(what: str, lead: Failure | None, rest: str) -> CheckpointError:
    """``what`` (then ``rest``), led by the cause of ``lead``, the lowest rank's failure with an error
    number (a :class:`StorageError` then)."""
    if lead is None:
        return CheckpointError(f"{what[0].upper()}{what[1:]}{rest}")
    message = f"{lead.cause}: {what[0].lower()}{what[1:]}{rest}"
    return StorageError(message, lead.errno, lead.filename, reason=lead.reason, advice=lead.advice)


def save_failed(
    target: object,
    failures: list[Failure],
    *,
    stage: str,
    space: Space | None = None,
    place: str = "path",
) -> CheckpointError:
    """The error of a save of ``target`` that failed on the ranks of ``failures``, the same on every rank.
    ``stage``: ``"prepare"`` (nothing written yet), ``"write"`` (the partial save was removed) or
    ``"publish"`` (rank 0 failed to make the complete save visible); ``space`` is shown for a full disk
    or a quota; ``place``: "path" or "URL"."""
    by_rank: dict[int, Failure] = {}
    for failure in failures:
        if failure.rank not in by_rank or (failure.errno and not by_rank[failure.rank].errno):
            by_rank[failure.rank] = failure
    ordered = [by_rank[r] for r in sorted(by_rank)]
    lead = next((f for f in ordered if f.errno), None)
    ranks = ", ".join(str(f.rank) for f in ordered)
    figures = ""
    if space is not None and lead is not None and lead.errno in (errnos.ENOSPC, errnos.EDQUOT):
        figures = f" {space.figures(free=lead.errno == errnos.ENOSPC)}"
    before = {
        "prepare": "Nothing was written; the",
        "write": "The partial save was removed; the",
        "publish": "The",
    }
    after = f"{before[stage]} previous checkpoint at that {place}, if any, is unchanged."
    number = lead.errno if lead is not None else None
    if number is None and any(
        f.text.startswith(("IsADirectoryError", "NotADirectoryError")) for f in ordered
    ):
        number = errnos.EISDIR  # a refusal of ours: something else put a directory at the path
    hint = _hint(number, saving=True, advice=lead.advice if lead is not None else None)
    details = "; ".join(f.detail() for f in ordered)
    what = f"saving the checkpoint {str(target)!r} failed on rank(s) {ranks}"
    return _error(what, lead, f" ({details}).{figures} {hint} {after}")


def read_failed(err: BaseException, what: str) -> StorageError | None:
    """The error of a read of ``what`` (``"the Lightning metadata '...'"``) that failed because the
    storage did (an ``OSError`` behind ``err``: permissions, an I/O error, a missing file), with a load's
    advice; ``None`` when no such cause is behind it (the file itself is bad)."""
    cause = os_cause(err)
    if cause is None:
        return None
    failure = Failure.of(cause, 0)
    return StorageError(
        f"{failure.cause}: could not read {what}: {failure.text}. {_hint(cause.errno, saving=False)}"
        " Nothing on disk was changed.",
        cause.errno,
        failure.filename,
        reason=failure.reason,
    )


def background_failed(path: object, cause: BaseException, rank: int) -> CheckpointError:
    """The error of a background save of ``path`` that failed with ``cause`` on ``rank``: the commit's
    own error (it starts with the cause and names the ranks), said to come from the background."""
    where = f"The background save of the checkpoint {str(path)!r} failed"
    if isinstance(cause, RanksLost):
        return RanksLost(f"{cause} ({where}.)", cause.ranks)
    if isinstance(cause, StorageError):
        return StorageError(
            f"{cause} ({where}.)", cause.errno, cause.filename, reason=cause.reason, advice=cause.advice
        )
    if isinstance(cause, CheckpointError):
        return CheckpointError(f"{cause} ({where}.)")
    failure = Failure.of(cause, rank)
    message = (
        f"{where}: {cause!r}. The previous checkpoint at that path, if any, is unchanged; fix the cause"
        " (disk space, permissions) and save again."
    )
    if failure.errno:
        return StorageError(f"{label(failure.errno)}: {message}", failure.errno, failure.filename)
    return CheckpointError(message)


@contextlib.contextmanager
def dcp_errors(what: str, *, saving: bool = False) -> Iterator[None]:
    """Around a DCP call: its ``CheckpointException`` (a ``BaseException``) becomes a ``CheckpointError``
    for ``what`` ("Saving the sharded checkpoint to '...'"), the same on every rank, with a save's advice
    or a load's (``saving``). It keeps the failures it names (``rank_failures``), so that a commit
    reports them as the failing ranks' own."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as ex:
        failures = [Failure.of(e, rank) for rank, e in _rank_errors(ex.failures)]
        lead = next((f for f in failures if f.errno), None)
        details = "; ".join(f.detail() for f in failures) or repr(ex)
        hint = _hint(lead.errno if lead else None, saving, lead.advice if lead else None)
        error = _error(f"{what} failed on rank(s) {sorted(ex.failures)}", lead, f" ({details}). {hint}")
        error.rank_failures = failures  # type: ignore[attr-defined]
        raise error from None
