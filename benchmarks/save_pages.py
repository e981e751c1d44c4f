"""A save's writer against the faithful write of the same bytes, with the write-back started on whole
pages (the writer now) or up to wherever each piece ended (the writer before, mid-page).

Run: ``python -m benchmarks.save_pages [--gb-per-rank 1] [--rounds 6] [--dir DIR] [--out FILE]``. Two
ranks (gloo, loopback); each holds ``--gb-per-rank`` of float32 tensors of 64 MiB under its own keys,
so every rank writes all of its own. Every round times, in an order that turns from round to round,
``dcp.save`` of that state through the library's ``ChecksummingWriter``
with :class:`~lightning_sharded.checkpoint.writeback.WriteBehind` as it is (``whole pages``) and as it
was (``mid-page``: each piece's write-back started up to its last byte), and the faithful write of the
same bytes (``benchmarks.disk.write_file``: 8 MiB pieces from offset 0, so always whole pages), each
after ``os.sync`` and a barrier, the slowest rank counting. Prints and writes each kind's seconds and
its median against the faithful write's.

Why: the saves stayed at 0.82-0.85 of the faithful write while their write calls and write-back waits
matched the probe's one by one (``benchmarks/results/save-profile.txt``); ``torch.save``'s records put
a tensor's bytes at 64-byte offsets, so every 8 MiB piece of a save ended mid-page.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, cast

KINDS = ("whole pages", "mid-page", "faithful write")
PIECE = 16 << 20  # float32 elements per tensor: 64 MiB


def _mid_page_advance(behind: Any, written: int) -> None:
    """``WriteBehind.advance`` as it was before the write-back started on whole pages only."""
    from lightning_sharded.checkpoint import libc

    if not behind._on or written <= behind._started:
        return
    libc.sync_file_range(behind._fd, behind._started, written - behind._started, libc.SYNC_FILE_RANGE_WRITE)
    behind._started = written
    behind._written = max(behind._written, written)
    upto = (written - behind._window) // libc.PAGE * libc.PAGE
    if upto > behind._dropped:
        behind._drop(upto)


def _rank(rank: int, world: int, port: int, root: str, gb: float, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from benchmarks import disk
    from lightning_sharded.checkpoint import writeback
    from lightning_sharded.checkpoint.backends.dcp_writer import ChecksummingWriter

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    torch.manual_seed(rank)
    count = max(1, int(gb * 1e9) // (PIECE * 4))
    state = {f"rank{rank}.t{i}": torch.randn(PIECE) for i in range(count)}
    buffers = [memoryview(cast(Any, t.view(torch.uint8).numpy())) for t in state.values()]
    advance = writeback.WriteBehind.advance
    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for round_index in range(rounds):
        turn = round_index % len(KINDS)
        for kind in KINDS[turn:] + KINDS[:turn]:
            target = Path(root) / kind.replace(" ", "-")
            dist.barrier()
            if rank == 0:
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir()
            os.sync()
            dist.barrier()
            chosen: Any = _mid_page_advance if kind == "mid-page" else advance
            writeback.WriteBehind.advance = chosen  # type: ignore[method-assign]
            start = time.perf_counter()
            if kind == "faithful write":
                disk.write_file(
                    target / f"rank{rank}.bin", count * PIECE * 4, disk.Source(buffers), behind=True
                )
            else:
                dcp_save(state, storage_writer=ChecksummingWriter(target, thread_count=1))
            dist.barrier()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seconds[kind].append(float(elapsed))
    writeback.WriteBehind.advance = advance  # type: ignore[method-assign]
    if rank == 0:
        bar = statistics.median(seconds["faithful write"])
        report = {
            "what": __doc__.splitlines()[0] if __doc__ else "",
            "bytes per rank": count * PIECE * 4,
            "ranks": world,
            "seconds": seconds,
            "median / faithful write (time)": {k: statistics.median(v) / bar for k, v in seconds.items()},
        }
        print(json.dumps(report["median / faithful write (time)"], indent=1), flush=True)
        if out:
            Path(out).write_text(json.dumps(report, indent=1) + "\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    from torch.multiprocessing.spawn import spawn

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.save_pages", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--gb-per-rank", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dir", type=Path, default=None, help="where the files are written (a new folder)")
    parser.add_argument("--out", default="", help="write the figures here (JSON)")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="lsbench-pages-", dir=args.dir)
    with socket.socket() as s:  # a free port for the process group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        spawn(_rank, args=(2, port, root, args.gb_per_rank, args.rounds, args.out), nprocs=2)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
