"""Checksums of checkpoint files: CRC-32 of whole files, and a stream that checksums what it writes.

CRC-32 (zlib's, computed by ISA-L in :func:`crc32` where the ``isal`` package is installed, as it
is on Linux: 7.8 GB/s on one core of the project's machine, zlib's 2.4) runs well above the 1.0-1.6
GB/s at which these disks write (blake2b: 0.9 GB/s, sha256: 1.8 GB/s); it catches every 1- and 2-bit
error and every burst up to 32 bits, which is what a checkpoint needs (protection against
corruption, not against an attacker). ``benchmarks/checksum_throughput.py`` reproduces the figures.

:class:`HashingStream` is the one stream that checksums bytes on their way to a file: a large write is
hashed in a helper thread while the same buffer is written, both done before the write returns, so
the CRC is of the bytes written, from memory the caller still owns (torch frees DCP's buffers right
after); :func:`crc32` and file writes release the GIL, so the two overlap. Standard library only.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any

from lightning_sharded.checkpoint import libc
from lightning_sharded.checkpoint.manifest import CHECKSUM_ALGORITHM

try:  # ISA-L's CRC-32: the same checksum as zlib's, about 3x as fast (a dependency on Linux)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - platforms without an isal wheel
    from zlib import crc32 as _crc32

if TYPE_CHECKING:
    from lightning_sharded.checkpoint.writeback import WriteBehind

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CHUNK_SIZE",
    "HashingStream",
    "bytes_checksum",
    "crc32",
    "crc32_combine",
    "cuts",
    "file_checksum",
    "hex_crc",
    "pieces_crc",
    "ranges_checksum",
    "stream_checksum",
]

#: Bytes read per call while checksumming a file.
CHUNK_SIZE = 8 << 20
#: Threads that read a large file's bytes to checksum them, each its contiguous part: as a load's reader
#: (``backends.dcp_reader``), since this disk reads a cold file faster with a second stream.
STREAMS = 2
# Smaller gaps are read by one stream.
_SPLIT_FROM = 64 << 20
# Smaller writes (zip headers, pickles) are hashed inline: a thread hand-off costs more than the CRC.
_HASH_INLINE_BELOW = 1 << 20


def crc32(data: Any, value: int = 0) -> int:
    """``zlib.crc32(data, value)``, computed by ISA-L where it is installed (it releases the GIL)."""
    return int(_crc32(data, value))


def hex_crc(crc: int) -> str:
    """A CRC-32 as the manifest writes it: 8 lowercase hex digits."""
    return f"{crc & 0xFFFFFFFF:08x}"


# CRC-32 of pieces joined without their bytes (zlib's crc32_combine, which Python does not expose):
# multiplication modulo the (reflected) CRC polynomial, and x**(2**k) modulo it for every k.
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial (both reflected, as zlib keeps them)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x**1, then x**(2**k)
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``.

    What zlib's ``crc32_combine`` computes, in about 30 multiplications modulo the polynomial: pieces
    checksummed as they arrive, in any order, give the checksum of the whole without reading it again.
    """
    p, k, n = 1 << 31, 3, len2  # x**(8 * len2): k = 3 counts bytes as 8 bits
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1 & 0xFFFFFFFF) ^ (crc2 & 0xFFFFFFFF)


def pieces_crc(pieces: Iterable[tuple[int, int, int]], start: int, size: int) -> int | None:
    """The CRC-32 of bytes ``start`` to ``start + size`` from ``(offset, length, crc32)`` pieces checksummed
    as they were written, in any order; ``None`` unless the pieces cover the range exactly once."""
    crc, end = 0, start
    for offset, length, piece in sorted(pieces):
        if offset != end:
            return None
        crc, end = crc32_combine(crc, piece, length), offset + length
    return crc if end == start + size else None


def bytes_checksum(data: bytes) -> tuple[int, str]:
    """``(size, crc32 as 8 lowercase hex digits)`` of ``data``."""
    return len(data), hex_crc(crc32(data))


def stream_checksum(f: IO[bytes]) -> tuple[int, str]:
    """``(size, crc32 hex)`` of everything left to read in the binary file ``f``, in chunks."""
    crc = size = 0
    buffer = bytearray(CHUNK_SIZE)
    view = memoryview(buffer)
    readinto = getattr(f, "readinto", None)
    while True:
        if readinto is not None:
            n = readinto(buffer)
            chunk: Any = view[:n] if n else b""
        else:
            chunk = f.read(CHUNK_SIZE)
            n = len(chunk)
        if not n:
            break
        crc = crc32(chunk, crc)
        size += n
    return size, hex_crc(crc)


def file_checksum(path: str | os.PathLike[str], *, fsync: bool = False) -> tuple[int, str]:
    """``(size, crc32 hex)`` of a local file, read as :func:`ranges_checksum` reads it; with ``fsync``,
    its bytes are on disk too before it is listed in a manifest."""
    figures = ranges_checksum(path, os.stat(path).st_size, ())
    if fsync:
        with open(path, "rb", buffering=0) as f:
            os.fsync(f.fileno())
    return figures


def ranges_checksum(
    path: str | os.PathLike[str], size: int, known: Sequence[tuple[int, int, int]]
) -> tuple[int, str]:
    """``(bytes counted, crc32 hex)`` of the first ``size`` bytes of a local file (fewer counted: it is
    shorter), reading only the bytes between the ranges ``known`` already checksummed (by a load's
    reads): ``(offset, length, crc32)`` in any order, one that overlaps one before it ignored (its bytes
    are read instead)."""
    pieces: list[tuple[int, int, int | None]] = []  # (start, end, its CRC-32, or None: to read)
    position = 0
    for offset, length, known_crc in sorted(known):
        if offset < position or offset + length > size:
            continue
        pieces += [(position, offset, None)] if offset > position else []
        pieces.append((offset, offset + length, known_crc))
        position = offset + length
    pieces += [(position, size, None)] if position < size else []
    gaps = {start: cuts(start, end) for start, end, part in pieces if part is None}
    reads = [cut for gap in gaps.values() for cut in gap]
    crc, position = 0, 0
    with contextlib.ExitStack() as stack:
        found: Iterator[tuple[int, int]] = (_range_crc(path, *cut) for cut in reads)
        if len(reads) > 1:  # a pool only for several reads: a small file is read on this thread
            pool = stack.enter_context(
                ThreadPoolExecutor(STREAMS, thread_name_prefix="lightning-sharded-crc32")
            )
            found = pool.map(lambda cut: _range_crc(path, *cut), reads)  # in file order, STREAMS at a time
        for start, end, part in pieces:
            if part is not None:
                crc, position = crc32_combine(crc, part, end - start), end
                continue
            for cut_start, cut_end in gaps[start]:
                cut_crc, n = next(found)
                crc, position = crc32_combine(crc, cut_crc, n), position + n
                if n < cut_end - cut_start:  # the file ended early
                    return position, hex_crc(crc)
    return position, hex_crc(crc)


def cuts(start: int, end: int) -> list[tuple[int, int]]:
    """Bytes ``start`` to ``end`` in :data:`STREAMS` contiguous parts, or one if fewer than
    :data:`_SPLIT_FROM`."""
    n = STREAMS if end - start >= _SPLIT_FROM else 1
    return [(start + k * (end - start) // n, start + (k + 1) * (end - start) // n) for k in range(n)]


def _range_crc(path: str | os.PathLike[str], start: int, end: int) -> tuple[int, int]:
    """CRC-32 of bytes ``start`` to ``end`` of a file and how many there were (fewer: it ended early),
    read by their own file descriptor in :data:`CHUNK_SIZE` pieces, the page cache dropped behind (no
    ``POSIX_FADV_SEQUENTIAL``: its larger read-ahead made ``verify`` of a 2 GB checkpoint 1.37-1.42 s
    against 1.27-1.33 s without, cold, on the project's machine)."""
    crc, position = 0, start
    buffer = memoryview(bytearray(min(CHUNK_SIZE, end - start)))
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        while position < end:
            n = os.preadv(fd, [buffer[: end - position]], position)
            if not n:
                break
            crc = crc32(buffer[:n], crc)
            position += n
            libc.fadvise(fd, start, position - start, "DONTNEED")
    return crc, position - start


class HashingStream(io.RawIOBase):
    """A write-only binary stream that passes every write on to ``raw`` (a file or an fsspec file, which
    it does not close; a large write in :data:`CHUNK_SIZE` pieces) and keeps its size and CRC-32.
    ``write_behind``, a local file's :class:`~lightning_sharded.checkpoint.writeback.WriteBehind`, is
    told the file's size after every large piece."""

    def __init__(self, raw: IO[bytes], *, write_behind: WriteBehind | None = None) -> None:
        super().__init__()
        self._raw = raw
        self._behind = write_behind
        self._size = 0
        self._crc = 0
        self._pool: ThreadPoolExecutor | None = None
        #: The ``OSError`` a write to ``raw`` raised (a full disk...), kept: a ``torch.save`` writing
        #: through this stream drops it and raises its own ``RuntimeError`` instead.
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        """Write ``b`` whole and hash it; returns once both are done (``b`` is not kept)."""
        view = memoryview(b).cast("B")
        if len(view) < _HASH_INLINE_BELOW:
            self._crc = crc32(view, self._crc)
            self._write(view)
            return len(view)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-sharded-crc32")
        for start in range(0, len(view), CHUNK_SIZE):
            piece = view[start : start + CHUNK_SIZE]
            crc = self._pool.submit(crc32, piece, self._crc)
            try:
                self._write(piece)
            finally:
                self._crc = crc.result()  # joined before going on, whatever the write did
            if self._behind is not None:
                self._behind.advance(self._size)
        return len(view)

    def _write(self, view: memoryview) -> None:
        try:
            n = self._raw.write(view)
        except OSError as err:
            self.error = err
            raise
        if n is not None and n != len(view):  # a buffered writer writes everything or raises
            raise OSError(f"short write: {n} of {len(view)} bytes")
        self._size += len(view)

    def tell(self) -> int:
        return self._size

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def result(self) -> tuple[int, str]:
        """``(size, crc32 as 8 hex digits)`` of all bytes written so far; stops the helper thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        return self._size, hex_crc(self._crc)

    def close(self) -> None:
        # DCP closes the stream inside `create_stream`; the file itself is closed by its owner. The
        # helper thread stops here too, so a stream left by an error (``with``) leaves no thread behind.
        self._raw.flush()
        self.result()
