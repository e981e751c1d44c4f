"""The C library functions the checkpoint code calls through ``ctypes``, each looked up once.

``renameat2`` (publish by exchange), ``madvise`` (give back or fault in the pages of a tensor) and
``sync_file_range`` (start a write-back) are Linux calls with no binding in :mod:`os`. A function libc
does not have is ``None``: every caller then does without it. :func:`fadvise` is :mod:`os`'s
``posix_fadvise``, with the same rule (nothing where it is missing or fails), :func:`reserve` its
``posix_fallocate``; :func:`pwrite_all` loops ``pwrite`` until every byte is written.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
from typing import Any

__all__ = [
    "MADV_DONTNEED",
    "MADV_POPULATE_WRITE",
    "PAGE",
    "SYNC_FILE_RANGE_WAIT_AFTER",
    "SYNC_FILE_RANGE_WAIT_BEFORE",
    "SYNC_FILE_RANGE_WRITE",
    "fadvise",
    "function",
    "madvise",
    "populate_write_works",
    "pwrite_all",
    "reserve",
    "sync_file_range",
]

PAGE = mmap.PAGESIZE
MADV_DONTNEED = 4
MADV_POPULATE_WRITE = 23  # Linux 5.14: make pages present (as if written), their bytes untouched
SYNC_FILE_RANGE_WAIT_BEFORE, SYNC_FILE_RANGE_WRITE, SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4


@functools.cache
def function(name: str, *argtypes: Any) -> Any:
    """libc's ``name`` taking ``argtypes`` and returning an ``int`` (``errno`` kept), or ``None``."""
    try:
        found = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    found.argtypes = list(argtypes)
    found.restype = ctypes.c_int
    return found


def madvise(start: int, nbytes: int, advice: int) -> bool:
    """``madvise`` on the whole pages inside ``[start, start + nbytes)``; ``False`` if it did nothing
    (no such call, no whole page, or an error)."""
    call = function("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    first = -(-start // PAGE) * PAGE
    last = (start + nbytes) // PAGE * PAGE
    return call is not None and last > first and call(first, last - first, advice) == 0


def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> bool:
    """``sync_file_range`` on a file range (``nbytes`` 0: to the end); ``False`` if it did nothing
    (no such call, or an error such as a descriptor that is not a regular file's)."""
    call = function("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return call is not None and call(fd, offset, nbytes, flags) == 0


def fadvise(fd: int, offset: int, nbytes: int, advice: str) -> bool:
    """``posix_fadvise(POSIX_FADV_<advice>)`` on a file range (``nbytes`` 0: to the end); ``False`` if it
    did nothing (no such call here, or an error). ``"DONTNEED"`` drops the range's clean pages from the
    page cache: only the folios wholly inside it (large ones: 2 MiB on the project's machine), no dirty
    page; ``"SEQUENTIAL"`` asks for a larger read-ahead."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.posix_fadvise(fd, offset, nbytes, getattr(os, f"POSIX_FADV_{advice}"))
    except OSError:
        return False
    return True


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Every byte of ``data`` (a buffer) written at ``offset`` of ``fd``, however many ``pwrite`` calls
    that takes."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def reserve(fd: int, size: int) -> None:
    """The first ``size`` bytes of the file allocated now (``posix_fallocate``): a full disk fails here
    with ``ENOSPC``, not mid-write (nor, in a mapped file, with ``SIGBUS``); a filesystem that cannot
    allocate ahead does without."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


@functools.cache
def populate_write_works() -> bool:
    """Whether this kernel has ``MADV_POPULATE_WRITE`` (tried once on a page of its own)."""
    probe = mmap.mmap(-1, PAGE)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(probe))  # the buffer export ends here
        return madvise(address, PAGE, MADV_POPULATE_WRITE)
    finally:
        probe.close()
