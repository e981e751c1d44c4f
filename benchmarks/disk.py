"""The disk's own limits, measured by the same run that measures the checkpoints.

Sequential write+fsync and cold sequential read of one large file, with random bytes (nothing to
compress) in 64 MiB chunks; the page cache is dropped for the file before reading
(``posix_fadvise(DONTNEED)``), so the read comes from the device. Beside them, the same cold read
into new memory laid out as a resume's (:func:`read_into_new_memory`): what a resume cannot beat.

:data:`PROBES` names every probe a rank records (``benchmarks.world.raw_probe`` runs :func:`probe`
between the timed saves) and the figure ``benchmarks.report`` makes of it: a new probe is one entry
there and one step in :func:`probe`.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CHUNK = 64 << 20


@dataclass(frozen=True)
class Probe:
    """One kind of probe: its seconds per probe in a rank's record (``key``), its GB/s in the report
    (``name``; ``"write GB/s"`` has its list of probes under ``"write probes GB/s"``)."""

    key: str
    name: str


WRITE = Probe("raw write s", "write GB/s")
READ = Probe("raw read s", "read GB/s")
NEW_MEMORY_READ = Probe("raw new-memory read s", "new-memory read GB/s")
PROBES = (WRITE, READ, NEW_MEMORY_READ)


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
    start = time.perf_counter()
    write_fsync(path, nbytes, random_chunk())
    write_s = time.perf_counter() - start
    evict(path)
    start = time.perf_counter()
    read_all(path)
    read_s = time.perf_counter() - start
    path.unlink()
    return {"write GB/s": nbytes / write_s / 1e9, "read GB/s": nbytes / read_s / 1e9}


def read_into_new_memory(path: Path, nbytes: int) -> Callable[[], None]:
    """A cold read of the first ``nbytes`` of ``path`` into memory laid out as a resume's, with the
    reads a resume makes (:class:`~lightning_sharded.checkpoint.backends.dcp_reader.DirectReader`'s:
    two streams, the new memory faulted in ahead of them, the page cache dropped behind them) and no
    DCP, Lightning or strategy around them: a resume's floor on this machine. Returns the read, to time.

    A third of the bytes go into a tensor touched now (the model's shards, which exist before a
    resume), two thirds into tensors the read makes, 32 MiB each (the optimizer state, which a resume
    must make: on a VM that gives free memory back to its host, every new page is a fault).
    """
    import torch

    from lightning_sharded.checkpoint.backends.dcp_reader import DirectReader, _Job

    piece = 32 << 20
    model = torch.ones(nbytes // 3, dtype=torch.uint8)

    class Planner:
        def commit_tensor(self, req: object, tensor: object) -> None:
            pass

    def read() -> None:
        targets = [model[i : i + piece] for i in range(0, model.numel(), piece)]
        targets += [
            torch.empty(min(piece, nbytes - done), dtype=torch.uint8)
            for done in range(model.numel(), nbytes, piece)
        ]
        jobs, offset = [], 0
        for target in targets:
            jobs.append(_Job(None, os.fspath(path), path.name, offset, target))
            offset += target.numel()
        short = DirectReader(path.parent)._read_jobs(jobs, Planner())
        assert not short, f"{path} is shorter than {nbytes} bytes"

    return read


def probe(
    file: Path,
    nbytes: int,
    timed: Callable[[Callable[[], object]], float],
    evict_file: Callable[[Path], None],
) -> dict[str, float]:
    """One probe of each kind of :data:`PROBES` on ``nbytes`` at ``file`` (removed after): seconds by
    probe key. ``timed`` times a call (every rank together), ``evict_file`` drops the file's cache."""
    seconds = {WRITE.key: timed(lambda: write_fsync(file, nbytes, random_chunk()))}
    evict_file(file)
    seconds[READ.key] = timed(lambda: read_all(file))
    read = read_into_new_memory(file, nbytes)
    evict_file(file)
    seconds[NEW_MEMORY_READ.key] = timed(read)
    del read
    file.unlink()
    return seconds
