"""What the ranks of a benchmark do together: barriers, timed calls, files, the page cache, memory.

Every rank case uses these; each is collective (all ranks call it, in the same order) unless it says
otherwise. Times are taken on every rank between barriers; the report keeps the slowest rank.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import disk


def world_size() -> int:
    """The ranks of the job (from the environment before the process group exists)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def settle() -> None:
    """Flush every dirty page of the machine (untimed), so a timed write does not pay for older ones.

    ext4 commits its journal on fsync; with dirty data of earlier files (a full checkpoint written
    without fsync, deleted checkpoints) the first timed write of each case was several times slower.
    """
    barrier()
    os.sync()
    barrier()


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes on this rank, between barriers (so all ranks start together)."""
    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start


def all_done(local: bool) -> bool:
    """Whether ``local`` holds on every rank (an all-reduce)."""
    flag = torch.tensor([1 if local else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def tree_bytes(path: Path) -> int:
    """Bytes of the file ``path`` or of every file under it (not collective)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    """Remove the file or folder ``path`` (rank 0)."""
    barrier()
    if dist.get_rank() == 0:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
    barrier()


def evict(path: Path) -> None:
    """Drop the page cache of the checkpoint files (rank 0), so the next read comes from the disk."""
    barrier()
    if dist.get_rank() == 0:
        disk.evict_tree(path)
    barrier()


def evict_own(file: Path) -> None:
    """Drop the page cache of this rank's own ``file`` (each rank its own)."""
    barrier()
    disk.evict_tree(file)
    barrier()


def local_bytes(obj: Any) -> int:
    """Bytes of this rank's part of every tensor in ``obj`` (a nested dict/list of tensors)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return local_bytes(obj.to_local())
    if isinstance(obj, torch.Tensor):
        if type(obj).__name__ == "ShardedTensor":  # not imported: it warns of its deprecation
            sharded: Any = obj
            return sum(local_bytes(shard.tensor) for shard in sharded.local_shards())
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(local_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(local_bytes(v) for v in obj)
    return 0


def status_kib(field: str) -> int:
    """A field of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``; not collective)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (``clear_refs`` 5); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
