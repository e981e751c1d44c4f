"""Storage that fails on purpose, for the fault tests: a disk that fills up after N bytes, and an fsspec
filesystem that throttles or drops the first requests (an object store under load)."""

from __future__ import annotations

import builtins
import errno
import fnmatch
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fsspec.implementations.memory import MemoryFileSystem

_real_open = builtins.open


class _Limited:
    """A file open for writing that raises ``OSError(number)`` once ``budget`` bytes are written (what
    fits is written first, as a real short write does)."""

    def __init__(self, f: Any, budget: int, number: int) -> None:
        self._f = f
        self._left = budget
        self._number = number

    def write(self, data: Any) -> int:
        size = len(data) if isinstance(data, str) else memoryview(data).nbytes
        if size > self._left:
            if self._left:
                part = (
                    data[: self._left] if isinstance(data, str) else memoryview(data).cast("B")[: self._left]
                )
                self._f.write(part)
                self._f.flush()
            self._left = 0
            raise OSError(self._number, os.strerror(self._number))
        self._left -= size
        return int(self._f.write(data))

    def __enter__(self) -> _Limited:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@contextmanager
def filling_disk(root: Path, pattern: str, after: int, number: int = errno.ENOSPC) -> Iterator[list[str]]:
    """Inside, files under ``root`` whose name matches ``pattern`` fail with ``OSError(number)`` (a full
    disk: ``ENOSPC``; a quota: ``EDQUOT``) once ``after`` bytes of them are written. Yields the names
    of the files it cut."""
    cut: list[str] = []

    def limited_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = _real_open(file, mode, *args, **kwargs)
        if isinstance(file, str | os.PathLike) and ("w" in mode or "a" in mode):
            path = Path(os.fspath(file))
            if path.is_relative_to(root) and fnmatch.fnmatch(path.name, pattern):
                cut.append(path.name)
                return _Limited(f, after, number)
        return f

    builtins.open = limited_open
    try:
        yield cut
    finally:
        builtins.open = _real_open


class FlakyFileSystem(MemoryFileSystem):  # type: ignore[misc]
    """``flaky://``: an in-memory object store whose requests fail while :attr:`failures` is above 0
    (each failed request takes one), with an error of :attr:`kind`: ``"throttle"`` (what s3fs raises
    for ``503 SlowDown`` once its own retries are spent) or ``"drop"`` (a connection reset).

    Class-level state: the test sets it, the filesystem instances (one per URL) share it.
    """

    protocol = "flaky"
    store: dict[str, Any] = {}
    pseudo_dirs = [""]
    failures = 0
    kind = "throttle"
    failed: list[str] = []

    def _maybe_fail(self, method: str) -> None:
        cls = type(self)
        if cls.failures <= 0:
            return
        cls.failures -= 1
        cls.failed.append(method)
        if cls.kind == "throttle":
            raise OSError(errno.EBUSY, "Please reduce your request rate.")
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self._maybe_fail("ls")
        return super().ls(path, detail=detail, **kwargs)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
        self._maybe_fail("cat_file")
        return super().cat_file(path, start=start, end=end, **kwargs)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> Any:
        self._maybe_fail("pipe_file")
        return super().pipe_file(path, value, **kwargs)
