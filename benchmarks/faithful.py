"""The faithful limit: what a save and a load of the benchmark's checkpoint must do at best, on the
checkpoint's own files, with nothing of DCP, Lightning or the strategies around it.

- **Write** (:func:`write_like`, collective): every rank writes the files it wrote in the save just
  timed, at the sizes the save gave them (:func:`layout_of` reads them from the checkpoint: the shard
  ``__<r>_*.distcp`` and the per-rank state file are rank ``r``'s, every other file rank 0's), from its
  own state's bytes (what the save wrote, so the disk sees the same data), in a staging directory next
  to the target; each file is ``fsync``-ed, rank 0 then writes ``.metadata`` (through a temporary name
  and a rename, as DCP does), ``meta.pt`` and the manifest last (temporary name, rename), ``fsync``-s
  every directory and publishes with a rename, then ``fsync``-s the parent, as the commit does. With
  ``behind`` the large files are written as a save's writer writes them
  (:class:`~lightning_sharded.checkpoint.writeback.WriteBehind`: write-back started as each piece is
  written, the pages on disk dropped behind); without, plainly (the kernel starts the write-back at
  the ``fsync``).
- **Read** (:func:`read_like`): every rank reads, cold (the real checkpoint's files evicted), exactly
  the bytes its resume read: the DCP items of the resume's plan, recorded from the real resume
  (:func:`recording_reads`), each once, plus the small files a resume needs (rank 0: ``.metadata``,
  ``meta.pt``, the manifest; each rank: its own per-rank state file). Two streams per rank, each its
  contiguous half in file order, pieces of 4 MiB into a reused buffer, the page cache dropped behind
  every large item: the way our reader reads
  (:class:`~lightning_sharded.checkpoint.backends.dcp_reader.DirectReader`), which is the best this
  disk was measured to allow (one stream per rank got half the bandwidth).
- **Read into the resume's memory** (:func:`read_into_resume_memory`): the same bytes into memory laid
  out as the resume's (the model's items into memory touched before, the optimizer's into new tensors),
  through the reader's own reads.

``probe_writes`` and ``probe_reads`` are the rank cases' calls: after each timed save and after each
timed resume, interleaved with them so both see the same disk.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from benchmarks import disk
from benchmarks.timing import patched
from benchmarks.world import barrier, evict, evict_own, remove, settle, timed, world_size

#: Reading threads per rank: as our reader (two streams got 2.56 GB/s in all here, one 1.14, four 1.85).
STREAMS = 2
#: Bytes per read call, as our reader's with the page cache dropped behind.
READ_PIECE = 4 << 20
#: Items read whole through torch's path (not dropped behind) below this size, as in our reader.
SMALL = 1 << 20
_SHARD = re.compile(r"^__(\d+)_")
_RANK_STATE = re.compile(r"^rank_state/rank-(\d+)\.pt$")


# ------------------------------------------------------------------------------------------- write


@dataclass(frozen=True)
class File:
    """A checkpoint file: its path inside the checkpoint, its size, the rank that writes it in a save."""

    path: str
    size: int
    rank: int


@dataclass(frozen=True)
class Layout:
    """The files of a checkpoint, as a save writes them."""

    files: tuple[File, ...]

    def own(self, rank: int) -> list[File]:
        """The files ``rank`` writes before the ranks meet (its shards, its per-rank state)."""
        return [f for f in self.files if f.rank == rank and _owned(f.path)]

    def last(self) -> list[File]:
        """What rank 0 writes once every rank's shards are written: ``.metadata`` first, the manifest
        last (the publish order of a save)."""
        from lightning_sharded.checkpoint import names

        rest = [f for f in self.files if not _owned(f.path)]
        order = {names.DCP_METADATA: 0, names.MANIFEST_NAME: 2}
        return sorted(rest, key=lambda f: (order.get(f.path, 1), f.path))

    def directories(self) -> list[str]:
        """The directories inside the checkpoint, parents first."""
        found = {str(Path(f.path).parent) for f in self.files} - {"."}
        return sorted(found, key=lambda d: (d.count("/"), d))

    def bytes_of(self, rank: int) -> int:
        """Bytes ``rank`` writes."""
        return sum(f.size for f in self.files if f.rank == rank)


def _owned(path: str) -> bool:
    return bool(_SHARD.match(path) or _RANK_STATE.match(path))


def owner(path: str) -> int:
    """The rank that writes ``path`` (relative to the checkpoint) in a save: ``__<r>_*`` and
    ``rank_state/rank-<r>.pt`` are rank ``r``'s, every other file rank 0's."""
    found = _SHARD.match(path) or _RANK_STATE.match(path)
    return int(found.group(1)) if found else 0


def layout_of(checkpoint: Path) -> Layout:
    """The files of the checkpoint directory ``checkpoint`` (sizes from the directory listing)."""
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    relative = [p.relative_to(checkpoint).as_posix() for p in files]
    return Layout(
        tuple(File(rel, p.stat().st_size, owner(rel)) for rel, p in zip(relative, files, strict=True))
    )


def write_like(
    layout: Layout,
    target: Path,
    rank: int,
    source: disk.Source,
    *,
    behind: bool,
    meet: Callable[[], None] = barrier,
) -> disk.Written:
    """Write a checkpoint of ``layout`` at ``target`` (which must not exist) as a save must, at best (see
    the module doc); collective (``meet`` is the ranks' barrier). Returns what this rank wrote."""
    from lightning_sharded.checkpoint import names

    staging = target.parent / f".{target.name}.staging"
    if rank == 0:
        staging.mkdir()
        for directory in layout.directories():
            (staging / directory).mkdir()
    meet()
    written = disk.Written()
    for file in layout.own(rank):
        written.add(disk.write_file(staging / file.path, file.size, source, behind=behind))
    meet()
    if rank == 0:
        for file in layout.last():
            final = staging / file.path
            renamed = file.path in (names.DCP_METADATA, names.MANIFEST_NAME)
            path = final.with_name(f".{final.name}.tmp") if renamed else final
            written.add(disk.write_file(path, file.size, source, behind=behind))
            if renamed:
                os.rename(path, final)
        for directory in reversed(layout.directories()):
            disk.fsync_dir(staging / directory)
        disk.fsync_dir(staging)
        os.rename(staging, target)
        disk.fsync_dir(target.parent)
    return written


def state_buffers(trainer: Any) -> list[memoryview]:
    """This rank's shards of the model and of every optimizer's state, as bytes (what its save writes)."""
    import torch

    from benchmarks.staging import local_tensors

    tensors = [
        t
        for optimizer in trainer.optimizers
        for t in local_tensors(trainer.lightning_module, optimizer)
        if t.device.type == "cpu"
    ]
    if not trainer.optimizers:
        tensors = [p.detach() for p in trainer.lightning_module.parameters()]
    views = []
    seen: set[int] = set()
    for tensor in tensors:
        if tensor.data_ptr() in seen or not tensor.numel():
            continue
        seen.add(tensor.data_ptr())
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        views.append(memoryview(cast(Any, flat.numpy())))
    return views


def probe_writes(args: argparse.Namespace, record: dict[str, Any], checkpoint: Path, trainer: Any) -> None:
    """Right after a timed save of ``checkpoint``: the write probes of :data:`benchmarks.disk.PROBES`
    (the faithful write with and without write-behind, and the whole-file probe of before), on every
    rank at once, in an order that turns from one call to the next; each appended to ``record``."""
    if not args.raw_bytes:
        return
    import torch.distributed as dist

    rank = dist.get_rank()
    layout = layout_of(checkpoint)
    buffers = state_buffers(trainer)
    target = args.dir / "probe.ckpt"
    record["layout"] = {f.path: f.size for f in layout.files}

    def like(probe: disk.Probe, behind: bool) -> Callable[[], None]:
        def run() -> None:
            remove(target)
            settle()
            figures: list[disk.Written] = []
            seconds = timed(
                lambda: figures.append(write_like(layout, target, rank, disk.Source(buffers), behind=behind))
            )
            _append(record, probe, seconds, figures[0].nbytes)
            record.setdefault(probe.key.removesuffix(" s") + " fsync s", []).append(figures[0].fsync_s)
            record.setdefault(probe.key.removesuffix(" s") + " dirty bytes", []).append(
                figures[0].dirty_at_fsync
            )
            remove(target)

        return run

    def whole_file() -> None:
        share = args.raw_bytes // world_size()
        settle()
        file = args.dir / f"raw.rank{rank}.bin"
        for key, seconds in disk.whole_file_probe(file, share, timed, evict_own).items():
            probe = next(p for p in disk.PROBES if p.key == key)
            _append(record, probe, seconds, share)

    runs = [like(disk.WRITE, True), like(disk.PLAIN_WRITE, False), whole_file]
    turn = len(record.get(disk.WRITE.key, [])) % len(runs)
    for run in runs[turn:] + runs[:turn]:
        run()


def _append(record: dict[str, Any], probe: disk.Probe, seconds: float, nbytes: int) -> None:
    record.setdefault(probe.key, []).append(seconds)
    record.setdefault(probe.bytes_key, []).append(nbytes)


# -------------------------------------------------------------------------------------------- read


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
        state = _RANK_STATE.match(file.path)
        wanted = int(state.group(1)) == rank if state else rank == 0 and not _SHARD.match(file.path)
        if wanted and file.path not in read:
            merged.append(Extent(file.path, 0, file.size))
    return sorted(merged, key=lambda e: (e.path, e.offset))


def _parts(extents: list[Extent], streams: int) -> list[list[Extent]]:
    """``extents`` cut into up to ``streams`` contiguous parts of about equal bytes (whole extents),
    as our reader cuts its items."""
    total = sum(e.length for e in extents)
    parts: list[list[Extent]] = [[]]
    done = 0
    for extent in extents:
        if done >= total * len(parts) / streams and len(parts) < streams:
            parts.append([])
        parts[-1].append(extent)
        done += extent.length
    return [part for part in parts if part]


def read_like(
    checkpoint: Path, extents: list[Extent], *, streams: int = STREAMS, piece: int = READ_PIECE
) -> int:
    """Read ``extents`` of ``checkpoint`` as a resume must, at best (see the module doc); returns the
    bytes read. Raises ``OSError`` when a file is shorter than an extent."""
    from lightning_sharded.checkpoint import libc

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
                        libc.drop_cached(fd, extent.offset, done)
        except BaseException as err:
            errors.append(err)
        finally:
            for fd in files.values():
                os.close(fd)

    threads = [threading.Thread(target=read, args=(part,)) for part in _parts(extents, streams)]
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


def copy_like(sources: list[Path], target: Path, size: int) -> int:
    """What a one-process copy of ``sources`` into one new file of ``size`` bytes at ``target`` must do,
    at best (``consolidate``'s bar): every source read once, cold, in pieces, its page cache dropped
    behind; each piece written as it arrives, with write-back started behind it and its pages dropped
    once on disk (a save's write-behind); ``fsync``; published by a rename, the directory ``fsync``-ed.
    The sources' bytes are written over again when ``size`` is more than they hold. Returns the bytes
    read."""
    from lightning_sharded.checkpoint import libc
    from lightning_sharded.checkpoint.writeback import WriteBehind

    staged = target.with_name(f".{target.name}.tmp")
    buffer = memoryview(bytearray(disk.WRITE_PIECE))
    out = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    read = written = 0

    def write(piece: memoryview) -> None:
        nonlocal written
        piece = piece[: size - written]
        while piece:
            n = os.write(out, piece)
            written += n
            piece = piece[n:]
        behind.advance(written)

    try:
        behind = WriteBehind(out)
        for source in sources:
            fd = os.open(source, os.O_RDONLY)
            try:
                at = 0
                while n := os.readv(fd, [buffer]):
                    at += n
                    libc.drop_cached(fd, 0, at)
                    write(buffer[:n])
                read += at
            finally:
                os.close(fd)
        while written < size:  # an output larger than its sources (headers): the last bytes again
            write(buffer)
        os.fsync(out)
        behind.finish()
    finally:
        os.close(out)
    os.rename(staged, target)
    disk.fsync_dir(target.parent)
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
    _append(record, disk.READ, seconds, read_bytes[0])
    read = read_into_resume_memory(checkpoint, extents)
    evict(checkpoint)
    _append(record, disk.NEW_MEMORY_READ, timed(read), read_bytes[0])
    del read
