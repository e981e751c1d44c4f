"""Bounded retries, with exponential backoff and jitter, of object-store requests that throttle or drop.

An object store answers a burst of requests (every rank of a large job saving at once) with ``503
SlowDown``, and a connection may drop midway; ``s3fs``'s own few retries last about 1.5 s in all. Every
request a backend makes through :class:`Retrying` (each idempotent) is tried again as
``docs/troubleshooting.md``, "An object store that throttles or drops connections", says, then fails
with a :class:`~lightning_sharded.checkpoint.errors.StorageError`. DCP's own shard I/O has ``s3fs``'s.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from lightning_sharded.checkpoint.errors import StorageError

__all__ = [
    "ADVICE",
    "BACKOFF_ENV",
    "DEFAULT_BACKOFF_S",
    "DEFAULT_RETRIES",
    "MAX_WAIT_S",
    "RETRIES_ENV",
    "Retrying",
    "attempts",
    "transient",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Environment variable: how many times a throttled or dropped request is tried again.
RETRIES_ENV = "LIGHTNING_SHARDED_STORE_RETRIES"
#: Environment variable: seconds of the first wait between tries (it doubles each time).
BACKOFF_ENV = "LIGHTNING_SHARDED_STORE_BACKOFF"
DEFAULT_RETRIES = 6
#: What to do when the tries are spent.
ADVICE = f"Try again later, spread the saves out, or allow more tries ({RETRIES_ENV}, {BACKOFF_ENV})."
DEFAULT_BACKOFF_S = 0.5
#: The longest wait between two tries.
MAX_WAIT_S = 20.0

_THROTTLED = (
    "SlowDown",
    "reduce your request rate",
    "ServiceUnavailable",
    "Service Unavailable",
    "Throttl",
    "TooManyRequests",
    "Too Many Requests",
    "HTTP 503",
    "status 503",
)
_DROPPED_TYPES = (
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ServerDisconnectedError",
    "ClientConnectionError",
    "ClientOSError",
    "ClientPayloadError",
    "IncompleteRead",
    "ProtocolError",
    "FSTimeoutError",
    "HTTPClientError",
)
_DROPPED_ERRNOS = (errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE)


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def transient(err: BaseException) -> str | None:
    """Why ``err`` of a request is worth another try (``"throttled (503 SlowDown)"``, ``"connection
    dropped"``), or ``None`` if it is not (a missing object, a refusal, a bad argument)."""
    if isinstance(err, FileNotFoundError | PermissionError | IsADirectoryError):
        return None
    chain = _chain(err)
    if any(marker in f"{type(e).__name__} {e}" for e in chain for marker in _THROTTLED):
        return "throttled (503 SlowDown)"
    for e in chain:
        if isinstance(e, ConnectionError | TimeoutError) or type(e).__name__ in _DROPPED_TYPES:
            return "connection dropped"
        if isinstance(e, OSError) and e.errno in _DROPPED_ERRNOS:
            return "connection dropped"
    return None


def attempts() -> tuple[int, float]:
    """``(tries after the first, seconds of the first wait)`` from the environment."""
    try:
        retries = max(0, int(os.environ.get(RETRIES_ENV, DEFAULT_RETRIES)))
        backoff = max(0.0, float(os.environ.get(BACKOFF_ENV, DEFAULT_BACKOFF_S)))
    except ValueError as err:
        raise ValueError(
            f"{RETRIES_ENV} must be a whole number and {BACKOFF_ENV} a number of seconds: {err}"
        ) from None
    return retries, backoff


def call(request: Callable[[], T], what: str) -> T:
    """``request()``, tried again while it fails for a :func:`transient` reason, at most the configured
    number of times; ``what`` (``"put 'b/k/meta.pt'"``) names it in the error."""
    retries, backoff = attempts()
    started = time.monotonic()
    for attempt in range(retries + 1):
        try:
            return request()
        except Exception as err:
            reason = transient(err)
            if reason is None:
                raise
            if attempt == retries:
                spent = time.monotonic() - started
                throttled = reason.startswith("throttled")
                cause = (
                    "kept throttling the requests (503 SlowDown)"
                    if throttled
                    else "kept dropping the connection"
                )
                summary = (
                    f"{what} failed {attempt + 1} time(s) over {spent:.1f} s; the last error:"
                    f" {type(err).__name__}: {str(err).rstrip('.')}"
                )
                raise StorageError(
                    f"The object store {cause}: {summary}. {ADVICE}",
                    errno.EBUSY if throttled else errno.ECONNRESET,
                    reason=f"The object store {cause}",
                    summary=summary,
                    advice=ADVICE,
                ) from err
            wait = random.uniform(0, min(MAX_WAIT_S, backoff * 2**attempt))
            log.warning("Object store %s (%s); trying again in %.2f s: %s", what, reason, wait, err)
            time.sleep(wait)
    raise AssertionError("unreachable")


#: The filesystem methods :class:`Retrying` retries, and how each names its request.
_RETRIED = {
    "ls": "list",
    "exists": "check",
    "isfile": "check",
    "info": "stat",
    "open": "open",
    "cat_file": "get",
    "get_file": "download",
    "pipe_file": "put",
    "put_file": "upload",
    "rm": "delete",
    "find": "list",
}


class Retrying:
    """An fsspec filesystem whose requests are retried as :func:`call` does; anything else is the
    filesystem's own."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._fs, name)
        verb = _RETRIED.get(name)
        if verb is None or not callable(value):
            return value

        def retried(*args: Any, **kwargs: Any) -> Any:
            target = args[-1] if name == "put_file" and args else (args[0] if args else "")
            return call(lambda: value(*args, **kwargs), f"{verb} {str(target)!r}")

        return retried
