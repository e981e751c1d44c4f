"""Errors raised for invalid or corrupt checkpoints and failed saves, and DCP's errors turned into them."""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "CheckpointError",
    "MissingCheckpointError",
    "OptimizerCountError",
    "RanksLost",
    "StorageError",
    "first_line",
]


def first_line(err: BaseException) -> str:
    """``Type: message`` of an exception, its message's last line of its own (DCP's
    ``CheckpointException`` puts the original exception at the end of its traceback text)."""
    text = str(err).strip().splitlines()
    last = [line for line in text if line and not line.startswith((" ", "Traceback"))]
    return f"{type(err).__name__}: {last[-1] if last else ''}"


class CheckpointError(ValueError):
    """A checkpoint is invalid, incomplete or corrupt, or does not fit the model it is loaded into; the
    message names what was wrong (the key, the file or the rank) and what to do about it."""


class OptimizerCountError(CheckpointError, RuntimeError):
    """The checkpoint holds another number of optimizer states than there are configured optimizers.

    Also the ``RuntimeError`` Lightning's ``FSDPStrategy`` raises for it, whose words its message starts
    with (``You have configured 1 optimizers but the checkpoint contains 2 optimizers to load``), so code
    written against the stock strategy keeps catching it.
    """


class MissingCheckpointError(CheckpointError, FileNotFoundError):
    """Nothing is at the path a load was given: a ``FileNotFoundError``, and a ``ValueError`` as the stock
    strategies' ``... does not point to a valid checkpoint ...``, whose words its message holds."""


class StorageError(CheckpointError, OSError):
    """A save or load failed because the storage did (a full disk, a read-only filesystem, a quota...).

    A :class:`CheckpointError` whose message starts with the cause (``No space left on device
    (ENOSPC): ...``), and an ``OSError`` whose :attr:`errno` and :attr:`filename` are the cause's, so
    ``except OSError as err: if err.errno == errno.ENOSPC: ...`` works as for the ``OSError`` itself.

    Args:
        reason: The cause in words where its errno's text would mislead (``"The object store kept
            throttling the requests (503 SlowDown)"``); a message that names this error's cause leads
            with it.
        summary: What happened without the advice, for a message that quotes this error.
        advice: What to do, where the storage that raised it knows better than the errno (an object
            store's retries); a message that names this error's cause ends with it.
    """

    def __init__(
        self,
        message: str,
        errno: int | None = None,
        filename: str | None = None,
        *,
        reason: str | None = None,
        summary: str | None = None,
        advice: str | None = None,
    ) -> None:
        super().__init__(message)
        self.errno = errno
        self.strerror = os.strerror(errno) if errno else None
        self.filename = filename
        self.reason = reason
        self.summary = summary
        self.advice = advice

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        # errno and filename are OSError's own slots; the rest travels as state (set by __setstate__)
        state = {"reason": self.reason, "summary": self.summary, "advice": self.advice}
        return type(self), (str(self), self.errno, self.filename), state


class RanksLost(CheckpointError):
    """A collective of a save or a load failed because other ranks did not reach it (dead, hung, slow):
    their global ranks are :attr:`ranks` (empty when every rank did and the collective itself failed)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.ranks)
