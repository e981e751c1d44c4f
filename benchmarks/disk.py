"""The disk's own limits, measured by the same run that measures the checkpoints: the probes' registry
and the file primitives they are made of.

:data:`PROBES` names every probe a rank records and the figure ``benchmarks.report`` makes of it. The
bars of the report are the *faithful* probes (``benchmarks.faithful``): the checkpoint's own files,
written as a save must write them at best and read as a resume must read them at best
(:data:`WRITE`, :data:`READ`). The others are kept because they explain something: the same files
written plainly (:data:`PLAIN_WRITE`: what write-behind gives), the probe the report used before
issue 34 (:data:`WHOLE_FILE_WRITE`, :data:`WHOLE_FILE_READ`: one file per rank of random bytes,
written plainly and read by one stream; the saves beat it), and the resume's reads into memory laid out
as a resume's (:data:`NEW_MEMORY_READ`: what fresh memory costs a resume here).

Every probe runs on every rank at once (each its share); a rank records, per probe, its seconds
(``key``) and the bytes it moved (``bytes_key``); the report takes the slowest rank's seconds and the
sum of the ranks' bytes.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHUNK = 64 << 20
#: The pieces a write probe hands to the kernel: those of a save's writer (``HashingStream``).
WRITE_PIECE = 8 << 20


@dataclass(frozen=True)
class Probe:
    """One kind of probe: seconds per probe in a rank's record (``key``), its GB/s in the report
    (``name``; the list of every probe's GB/s under ``"<name> probes"``), what a save or load is
    divided by it as (``short``: ``"save / disk write"``), and whether it is a bar of the report."""

    key: str
    name: str
    short: str
    kind: str  # "write" or "read"
    bar: bool
    what: str

    @property
    def bytes_key(self) -> str:
        """Where a rank records the bytes it moved in each probe."""
        return self.key.removesuffix(" s") + " bytes"

    def append(self, record: dict[str, Any], seconds: float, nbytes: int) -> None:
        """Add one probe's seconds and this rank's bytes to a rank's ``record``."""
        record.setdefault(self.key, []).append(seconds)
        record.setdefault(self.bytes_key, []).append(nbytes)

    @property
    def ratio(self) -> str:
        """The name of a throughput row's ratio against this probe."""
        return f"{'save' if self.kind == 'write' else 'load'} / {self.short}"


WRITE = Probe(
    "write probe s",
    "write GB/s",
    "disk write",
    "write",
    True,
    "the checkpoint's files at their sizes, each rank its own, from its own state's bytes; write-behind"
    " as a save's writer; fsync per file and per directory; manifest last; rename publish",
)
PLAIN_WRITE = Probe(
    "plain write probe s",
    "plain write GB/s",
    "plain write",
    "write",
    False,
    "the same files, bytes and fsyncs, written plainly (no write-behind): what write-behind gives",
)
WHOLE_FILE_WRITE = Probe(
    "whole-file write probe s",
    "whole-file write GB/s",
    "whole-file write",
    "write",
    False,
    "one file per rank of half the checkpoint, a 64 MiB random chunk over and over, write+fsync:"
    " the probe before issue 34",
)
READ = Probe(
    "read probe s",
    "read GB/s",
    "disk read",
    "read",
    True,
    "the bytes each rank's resume read (recorded from the real resume), from the real checkpoint's"
    " files evicted, two streams, the page cache dropped behind, into reused buffers",
)
WHOLE_FILE_READ = Probe(
    "whole-file read probe s",
    "whole-file read GB/s",
    "whole-file read",
    "read",
    False,
    "the whole-file probe's file read back cold by one stream: the probe before issue 34",
)
NEW_MEMORY_READ = Probe(
    "new-memory read probe s",
    "new-memory read GB/s",
    "new-memory read",
    "read",
    False,
    "the same reads into memory laid out as the resume's (the model's items into memory touched"
    " before, the optimizer's into new tensors) with the reader's own reads",
)
PROBES = (WRITE, PLAIN_WRITE, WHOLE_FILE_WRITE, READ, WHOLE_FILE_READ, NEW_MEMORY_READ)


@functools.cache
def random_chunk() -> bytes:
    """64 MiB of random bytes, made once per process."""
    return os.urandom(CHUNK)


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


def dirty_bytes() -> int:
    """The machine's dirty and under-write-back page cache now (``/proc/meminfo``), 0 where unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return 0
    return sum(int(fields.get(name, "0 kB").split()[0]) * 1024 for name in ("Dirty", "Writeback"))


class Source:
    """Bytes for a write probe, in order and over again: a rank's own state (what its save writes), or
    random bytes when it has none. Each probe takes a new ``Source``, so each writes the same bytes."""

    def __init__(self, buffers: Sequence[memoryview] = ()) -> None:
        self._buffers = [b.cast("B") for b in buffers if b.nbytes] or [memoryview(random_chunk())]
        self._index = 0
        self._at = 0

    def take(self, nbytes: int) -> memoryview:
        """The next bytes, at most ``nbytes`` (fewer at the end of a buffer)."""
        buffer = self._buffers[self._index]
        piece = buffer[self._at : self._at + nbytes]
        self._at += len(piece)
        if self._at >= len(buffer):
            self._index = (self._index + 1) % len(self._buffers)
            self._at = 0
        return piece


@dataclass
class Written:
    """What a write probe did on one rank: bytes written, seconds in ``fsync``, and the machine's dirty
    page cache right before the ``fsync`` of its largest file (the write-back left for the fsync)."""

    nbytes: int = 0
    fsync_s: float = 0.0
    dirty_at_fsync: int = 0
    files: list[str] = field(default_factory=list)

    def add(self, other: Written) -> None:
        self.nbytes += other.nbytes
        self.fsync_s += other.fsync_s
        self.dirty_at_fsync = max(self.dirty_at_fsync, other.dirty_at_fsync)
        self.files += other.files


def write_file(path: Path, size: int, source: Source, *, behind: bool) -> Written:
    """Write ``size`` bytes of ``source`` to a new file ``path`` in :data:`WRITE_PIECE` pieces, then
    ``fsync`` it. With ``behind``, the write-back of each piece starts as it is written and the pages
    on disk leave the page cache (a save's :class:`~lightning_sharded.checkpoint.writeback.WriteBehind`,
    the library's own), as a save's shard files are written."""
    from lightning_sharded.checkpoint.writeback import WINDOW, WriteBehind

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_behind = WriteBehind(fd) if behind else None
        written = 0
        while written < size:
            piece = source.take(min(WRITE_PIECE, size - written))
            while piece:
                n = os.write(fd, piece)
                written += n
                piece = piece[n:]
            if write_behind is not None:
                write_behind.advance(written)
        dirty = dirty_bytes() if size > WINDOW else 0
        start = time.perf_counter()
        os.fsync(fd)
        fsync_s = time.perf_counter() - start
        if write_behind is not None:
            write_behind.finish()
    finally:
        os.close(fd)
    return Written(size, fsync_s, dirty, [path.name])


def write_fsync(path: Path, nbytes: int, chunk: bytes | None = None) -> None:
    """Write ``nbytes`` of random bytes to ``path`` sequentially in 64 MiB chunks, then fsync (the
    whole-file probe's write)."""
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


def whole_file_probe(
    file: Path,
    nbytes: int,
    timed: Callable[[Callable[[], object]], float],
    evict_file: Callable[[Path], None],
) -> dict[str, float]:
    """The probe before issue 34 on ``nbytes`` at ``file`` (removed after): a write+fsync of random
    bytes, then a cold read by one stream. Seconds by probe key; ``timed`` times a call (every rank
    together), ``evict_file`` drops the file's cache."""
    seconds = {WHOLE_FILE_WRITE.key: timed(lambda: write_fsync(file, nbytes, random_chunk()))}
    evict_file(file)
    seconds[WHOLE_FILE_READ.key] = timed(lambda: read_all(file))
    file.unlink()
    return seconds
