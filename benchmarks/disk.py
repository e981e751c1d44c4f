"""The disk's own limits, measured by the same run that measures the checkpoints.

Sequential write+fsync and cold sequential read of one large file, with random bytes (nothing to
compress) in 64 MiB chunks; the page cache is dropped for the file before reading
(``posix_fadvise(DONTNEED)``), so the read comes from the device.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CHUNK = 64 << 20


def evict(path: Path) -> None:
    """Drop ``path``'s pages from the page cache, so the next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_tree(path: Path) -> None:
    """:func:`evict` every file under ``path`` (or ``path`` itself if it is a file)."""
    for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        evict(file)


def write_fsync(path: Path, nbytes: int, chunk: bytes | None = None) -> None:
    """Write ``nbytes`` of random bytes to ``path`` sequentially in 64 MiB chunks, then fsync."""
    view = memoryview(chunk if chunk is not None else os.urandom(CHUNK))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, view[: min(len(view), nbytes - written)])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_all(path: Path) -> None:
    """Read ``path`` sequentially in 64 MiB chunks (evict it first for a cold read)."""
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def raw_write_read(directory: Path, nbytes: int) -> dict[str, float]:
    """GB/s of a sequential write+fsync and of a cold sequential read of ``nbytes``, one process."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "raw.bin"
    chunk = os.urandom(CHUNK)
    start = time.perf_counter()
    write_fsync(path, nbytes, chunk)
    write_s = time.perf_counter() - start
    evict(path)
    start = time.perf_counter()
    read_all(path)
    read_s = time.perf_counter() - start
    path.unlink()
    return {"write GB/s": nbytes / write_s / 1e9, "read GB/s": nbytes / read_s / 1e9}
