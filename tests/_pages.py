"""Page-cache residency of files, for the tests of what the checkpoint I/O leaves cached."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Any


def resident(path: Path, start: int = 0, end: int | None = None) -> float:
    """The fraction of the file's pages in ``[start, end)`` that are in the page cache (``mincore``)."""
    size = path.stat().st_size
    end = size if end is None else end
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        pages = -(-size // mmap.PAGESIZE)
        vector = (ctypes.c_ubyte * pages)()
        mincore = ctypes.CDLL(None, use_errno=True).mincore
        mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        assert mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
        first, last = start // mmap.PAGESIZE, -(-end // mmap.PAGESIZE)
        return sum(vector[i] & 1 for i in range(first, last)) / max(1, last - first)


def drops_pages(folder: Path) -> bool:
    """Whether ``POSIX_FADV_DONTNEED`` drops the clean pages of a file in ``folder`` (not on tmpfs)."""
    probe = folder / "probe"
    with open(probe, "wb") as f:
        f.write(os.urandom(64 << 10))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    dropped = resident(probe) == 0
    probe.unlink()
    return dropped


def write_back_starts(monkeypatch: Any) -> list[tuple[int, int]]:
    """The ``(offset, nbytes)`` of every write-back started from now on (``sync_file_range`` with
    ``SYNC_FILE_RANGE_WRITE`` alone, as the write-behind starts it), in order; the calls still run."""
    from lightning_sharded.checkpoint import libc

    started: list[tuple[int, int]] = []
    real = libc.sync_file_range

    def recording(fd: int, offset: int, nbytes: int, flags: int) -> bool:
        if flags == libc.SYNC_FILE_RANGE_WRITE:
            started.append((offset, nbytes))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(libc, "sync_file_range", recording)
    return started
