"""The read half of the faithful limit (see :mod:`benchmarks.faithful`): what a resume read, recorded
from the real resume, and those bytes read as a resume must read them, at best."""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import disk
from benchmarks.faithful.writes import kind, layout_of
from benchmarks.timing import patched
from benchmarks.world import evict, settle, timed

#: Reading threads per rank: as our reader (two streams got 2.56 GB/s in all here, one 1.14, four 1.85).
STREAMS = 2
#: Bytes per read call, as our reader's with the page cache dropped behind.
READ_PIECE = 4 << 20
#: Items read whole through torch's path (not dropped behind) below this size, as in our reader.
SMALL = 1 << 20


@dataclass(frozen=True)
class Extent:
    """Bytes a resume reads: ``length`` at ``offset`` of ``path`` (relative to the checkpoint);
    ``fresh``: they go into memory the resume makes (optimizer state), not into the model's."""

    path: str
    offset: int
    length: int
    fresh: bool = False


@contextlib.contextmanager
def recording_reads(into: list[Extent]) -> Iterator[None]:
    """Inside the block, every item a DCP file-system reader reads (torch's ``FileSystemReader`` and
    ours) is appended to ``into``: where its stored bytes are, and whether it is optimizer state. Only
    the outermost ``read_data`` call counts (ours hands torch's path what it does not read itself)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    owners: list[type] = [FileSystemReader]
    with contextlib.suppress(ImportError):
        from lightning_sharded.checkpoint.backends.dcp_reader import DirectReader

        owners.append(DirectReader)
    depth = threading.local()

    def recorder(original: Callable[..., Any]) -> Callable[..., Any]:
        def read_data(self: Any, plan: Any, planner: Any) -> Any:
            level = getattr(depth, "level", 0)
            if level == 0:
                for item in plan.items:
                    info = self.storage_data[item.storage_index]
                    fresh = item.storage_index.fqn.split(".", 1)[0].startswith("optimizer")
                    into.append(Extent(info.relative_path, info.offset, info.length, fresh))
            depth.level = level + 1
            try:
                return original(self, plan, planner)
            finally:
                depth.level = level

        return read_data

    with contextlib.ExitStack() as stack:
        for owner_class in owners:
            stack.enter_context(
                patched(owner_class, "read_data", recorder(owner_class.__dict__["read_data"]))
            )
        yield


def resume_extents(recorded: list[Extent], checkpoint: Path, rank: int) -> list[Extent]:
    """What rank ``rank`` must read of ``checkpoint`` on a resume, each byte once, in file order: the
    items its resume read (``recorded``; overlapping ones merged), plus the small files (rank 0:
    every file that is no shard and no per-rank state; each rank: its own per-rank state file)."""
    merged: list[Extent] = []
    for extent in sorted(set(recorded), key=lambda e: (e.path, e.offset, -e.length)):
        last = merged[-1] if merged else None
        if last is not None and last.path == extent.path and extent.offset < last.offset + last.length:
            end = max(last.offset + last.length, extent.offset + extent.length)
            merged[-1] = Extent(last.path, last.offset, end - last.offset, last.fresh or extent.fresh)
        else:
            merged.append(extent)
    read = {e.path for e in merged}
    for file in layout_of(checkpoint).files:
        what = kind(file.path)
        wanted = file.rank == rank if what == "rank state" else rank == 0 and what == "shared"
        if wanted and file.path not in read:
            merged.append(Extent(file.path, 0, file.size))
    return sorted(merged, key=lambda e: (e.path, e.offset))


def read_like(
    checkpoint: Path, extents: list[Extent], *, streams: int = STREAMS, piece: int = READ_PIECE
) -> int:
    """Read ``extents`` of ``checkpoint`` as a resume must, at best (see the module doc); returns the
    bytes read. Raises ``OSError`` when a file is shorter than an extent."""
    from lightning_sharded.checkpoint import libc
    from lightning_sharded.checkpoint.backends.dcp_reader import split_parts  # cut as our reader cuts

    errors: list[BaseException] = []

    def read(part: list[Extent]) -> None:
        buffer = memoryview(bytearray(piece))
        files: dict[str, int] = {}
        try:
            for extent in part:
                fd = files.get(extent.path)
                if fd is None:
                    fd = files[extent.path] = os.open(checkpoint / extent.path, os.O_RDONLY)
                done = 0
                while done < extent.length:
                    n = os.preadv(fd, [buffer[: min(piece, extent.length - done)]], extent.offset + done)
                    if not n:
                        raise OSError(f"{extent.path} ended at {extent.offset + done}, before {extent}")
                    done += n
                    if extent.length >= SMALL:
                        libc.fadvise(fd, extent.offset, done, "DONTNEED")
        except BaseException as err:
            errors.append(err)
        finally:
            for fd in files.values():
                os.close(fd)

    parts = split_parts(extents, lambda e: e.length, streams)
    threads = [threading.Thread(target=read, args=(part,)) for part in parts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return sum(e.length for e in extents)


def read_into_resume_memory(checkpoint: Path, extents: list[Extent]) -> Callable[[], None]:
    """The read of ``extents`` into memory laid out as a resume's, ready to time: the model's items
    into one buffer touched now (the model's shards exist before a resume), the optimizer's into new
    tensors made by the read (the optimizer state, which a resume makes: on a VM that gives free memory
    back to its host every new page is a fault), with our reader's own reads (two streams, the new
    memory faulted in ahead of them, the page cache dropped behind), no DCP, Lightning or strategy."""
    import torch

    from lightning_sharded.checkpoint.backends.dcp_reader import DirectReader, _Job

    large = [e for e in extents if e.length >= SMALL]
    touched = torch.ones(sum(e.length for e in large if not e.fresh), dtype=torch.uint8)

    class Planner:
        def commit_tensor(self, req: object, tensor: object) -> None:
            pass

    def read() -> None:
        jobs, at = [], 0
        for extent in large:
            if extent.fresh:
                target = torch.empty(extent.length, dtype=torch.uint8)
            else:
                target, at = touched[at : at + extent.length], at + extent.length
            path = os.fspath(checkpoint / extent.path)
            jobs.append(_Job(None, path, extent.path, extent.offset, target))
        short = DirectReader(checkpoint)._read_jobs(jobs, Planner())
        assert not short, f"{checkpoint} has files shorter than the extents read"
        read_like(checkpoint, [e for e in extents if e.length < SMALL], streams=1)

    return read


def probe_reads(
    args: argparse.Namespace, record: dict[str, Any], checkpoint: Path, recorded: list[Extent]
) -> None:
    """Right after a timed resume from ``checkpoint`` whose reads are ``recorded``: the read probes of
    :data:`benchmarks.disk.PROBES` on the real checkpoint's files, evicted before each, every rank at
    once; each appended to ``record`` (with the bytes this rank read)."""
    if not args.raw_bytes:
        return
    import torch.distributed as dist

    extents = resume_extents(recorded, checkpoint, dist.get_rank())
    settle()
    evict(checkpoint)
    read_bytes: list[int] = []
    seconds = timed(lambda: read_bytes.append(read_like(checkpoint, extents)))
    disk.READ.append(record, seconds, read_bytes[0])
    read = read_into_resume_memory(checkpoint, extents)
    evict(checkpoint)
    disk.NEW_MEMORY_READ.append(record, timed(read), read_bytes[0])
    del read
