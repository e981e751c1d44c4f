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
    for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        evict(file)


def raw_write_read(directory: Path, nbytes: int) -> dict[str, float]:
    """GB/s of a sequential write+fsync and of a cold sequential read of ``nbytes``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "raw.bin"
    chunk = os.urandom(CHUNK)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, chunk[: min(CHUNK, nbytes - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - start
    evict(path)
    buf = bytearray(CHUNK)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - start
    path.unlink()
    return {"write GB/s": nbytes / write_s / 1e9, "read GB/s": nbytes / read_s / 1e9}
