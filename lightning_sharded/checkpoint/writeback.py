"""Write-behind for large checkpoint files: their write-back starts as they are written, and the pages
already on disk leave the page cache.

A save writes each rank's shard once and does not read it back. Left to the kernel, every byte stays
in the page cache as new pages: a 1 GB shard takes 1 GB of memory the machine had free, while the
previous checkpoint at the same path is still cached (it is replaced only once the new one is
published). Taking that much fresh memory costs CPU (on a VM that gives free memory back to its host,
as the project's machines do with free page reporting, every new page is a fault on the host too),
and a background save takes that CPU from training. Measured on the project's machine (two
processes, 1 GB each, CRC-32 in 4 MiB pieces): 1.0-3.3 s of CPU per GB written plainly against
1.1-1.2 s with write-behind, in as much wall time (``benchmarks/writers.py --cpu`` does it for a real
save).

:class:`WriteBehind` starts the write-back of what each write added (``sync_file_range``) and drops the
pages more than :data:`WINDOW` behind the writes once they are on disk (``POSIX_FADV_DONTNEED``), so a
file keeps about :data:`WINDOW` bytes in the page cache, reusing the same pages; a smaller file is left
alone. Linux only (elsewhere, or where the calls fail, it does nothing), and advice, not durability:
the save's ``fsync`` is what makes the bytes durable.
"""

from __future__ import annotations

import collections
import os
import threading

from lightning_sharded.checkpoint import libc

__all__ = ["WINDOW", "RangedWriteBehind", "WriteBehind", "drop_written"]

#: Bytes of a file allowed in the page cache while it is written (those not yet confirmed on disk).
#: Large enough to keep the disk's queue full (a few MiB per request), small against a shard.
WINDOW = 32 << 20


class WriteBehind:
    """The write-behind of one file written sequentially through ``fd`` (which it does not close),
    keeping about ``window`` bytes of it in the page cache; see the module docstring."""

    def __init__(self, fd: int, *, window: int = WINDOW) -> None:
        self._on = hasattr(os, "posix_fadvise")
        self._fd = fd
        self._window = window
        self._started = 0  # bytes whose write-back has been started
        self._dropped = 0  # bytes waited for and dropped from the page cache
        self._written = 0  # bytes said written

    def advance(self, written: int) -> None:
        """Say that the first ``written`` bytes of the file are written (handed to the kernel).

        The write-back starts on whole pages only: a page the next write fills further is left for a
        later call (or the ``fsync``). Started mid-page, as a save's writes end (``torch.save``'s
        records put a tensor's bytes at 64-byte offsets), a save of 1 GB per rank took 1.19x the time of
        the faithful write of its bytes, against 1.05x on whole pages (``python -m benchmarks.save_pages``,
        ``benchmarks/results/save-pages.json``).
        """
        self._written = max(self._written, written)
        whole = written // libc.PAGE * libc.PAGE
        if not self._on or whole <= self._started:
            return
        if not libc.sync_file_range(
            self._fd, self._started, whole - self._started, libc.SYNC_FILE_RANGE_WRITE
        ):
            self._on = False  # not supported here (no such call, not a regular file): write as before
            return
        self._started = whole
        # Whole pages only, and only those the sequential writes have left behind for good.
        upto = (written - self._window) // libc.PAGE * libc.PAGE
        if upto > self._dropped:
            self._drop(upto)

    def finish(self) -> None:
        """After the file's last write (and its ``fsync``): drop what is left of it from the page cache."""
        if self._on and self._written > self._window:
            self._drop(self._written)

    def _drop(self, upto: int) -> None:
        drop_written(self._fd, self._dropped, upto - self._dropped)
        self._dropped = upto


class RangedWriteBehind:
    """Write-behind for a file written in ranges anywhere, from several threads (a consolidation's chunks
    placed at their offsets): each range's write-back starts as it is written, and once more than
    ``limit`` bytes are in flight the oldest ranges are waited for and dropped from the page cache."""

    def __init__(self, fd: int, *, limit: int = WINDOW) -> None:
        self._fd = fd
        self._limit = limit
        self._lock = threading.Lock()
        self._ranges: collections.deque[tuple[int, int]] = collections.deque()
        self._bytes = 0

    def wrote(self, start: int, nbytes: int) -> None:
        """Say that bytes ``start`` to ``start + nbytes`` are written (handed to the kernel)."""
        libc.sync_file_range(self._fd, start, nbytes, libc.SYNC_FILE_RANGE_WRITE)
        with self._lock:
            self._ranges.append((start, nbytes))
            self._bytes += nbytes
            while self._bytes > self._limit:
                self._drop_oldest()

    def finish(self) -> None:
        """After the last write: every range waited for and dropped."""
        with self._lock:
            while self._ranges:
                self._drop_oldest()

    def _drop_oldest(self) -> None:
        start, nbytes = self._ranges.popleft()
        drop_written(self._fd, start, nbytes)
        self._bytes -= nbytes


def drop_written(fd: int, start: int, nbytes: int) -> None:
    """Wait for the write-back of bytes ``start`` to ``start + nbytes`` of ``fd`` (a page still dirty or
    under write-back is not dropped), then drop them from the page cache."""
    waits = libc.SYNC_FILE_RANGE_WAIT_BEFORE | libc.SYNC_FILE_RANGE_WRITE | libc.SYNC_FILE_RANGE_WAIT_AFTER
    libc.sync_file_range(fd, start, nbytes, waits)
    libc.fadvise(fd, start, nbytes, "DONTNEED")
