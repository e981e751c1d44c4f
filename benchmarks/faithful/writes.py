"""The write half of the faithful limit (see :mod:`benchmarks.faithful`): a checkpoint's layout, and
its files written as a save must write them, at best; a copy as ``consolidate`` must make it."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from benchmarks import disk
from benchmarks.world import barrier, evict_own, remove, settle, timed, world_size
from lightning_sharded.checkpoint.backends.local import fsync_dir

_SHARD = re.compile(r"^__(\d+)_")
_RANK_STATE = re.compile(r"^rank_state/rank-(\d+)\.pt$")


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


def kind(path: str) -> str:
    """What ``path`` (relative to the checkpoint) is: ``"shard"`` (``__<r>_*``, rank r's DCP file),
    ``"rank state"`` (``rank_state/rank-<r>.pt``) or ``"shared"`` (every other file: rank 0's)."""
    if _SHARD.match(path):
        return "shard"
    return "rank state" if _RANK_STATE.match(path) else "shared"


def _owned(path: str) -> bool:
    return kind(path) != "shared"


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
            fsync_dir(staging / directory)
        fsync_dir(staging)
        os.rename(staging, target)
        fsync_dir(target.parent)
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
            probe.append(record, seconds, figures[0].nbytes)
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
            probe.append(record, seconds, share)

    runs = [like(disk.WRITE, True), like(disk.PLAIN_WRITE, False), whole_file]
    turn = len(record.get(disk.WRITE.key, [])) % len(runs)
    for run in runs[turn:] + runs[:turn]:
        run()


def _append(record: dict[str, Any], probe: disk.Probe, seconds: float, nbytes: int) -> None:
    record.setdefault(probe.key, []).append(seconds)
    record.setdefault(probe.bytes_key, []).append(nbytes)


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
                    libc.fadvise(fd, 0, at, "DONTNEED")
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
    fsync_dir(target.parent)
    return read
