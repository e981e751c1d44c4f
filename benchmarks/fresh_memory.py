"""How fast this machine hands out memory a process touches for the first time, by how much is held.

Run: ``python -m benchmarks.fresh_memory [--block-gb 2] [--blocks 6] [--rounds 2] [--pause-s 60]
[--out FILE]``. Each round allocates ``--blocks`` blocks one after the other, each written once
(``torch.empty`` then ``fill_``: the first touch of every page), holding the earlier ones, and times
each block's first touch; then frees them all and waits ``--pause-s`` before the next round. The ratio
is each block's rate against the round's fastest.

Why: a resume reads into new memory (the optimizer state; with ``verify=True`` also the model's
staging buffers), and on a virtual machine that returns freed memory to its host (free page
reporting, a balloon) that memory can cost the host's page faults. Here (a Firecracker VM, 24 GiB) the
first 4-8 GB held came at 4-6 GB/s and every block past them at 0.2-0.6 GB/s, a minute after the same
memory had been freed; so a figure at 8 GB whose resume needs more new memory (``verify=True``) is this
machine's memory, not the code (docs/benchmarks.md, "At 8 GB").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def first_touch_rounds(block_bytes: int, blocks: int, rounds: int, pause_s: float) -> list[list[float]]:
    """GB/s of each block's first touch, per round (``blocks`` blocks of ``block_bytes`` held at once)."""
    import torch

    rates: list[list[float]] = []
    for round_index in range(rounds):
        if round_index:
            time.sleep(pause_s)
        held = []
        row = []
        for _ in range(blocks):
            start = time.perf_counter()
            block = torch.empty(block_bytes, dtype=torch.uint8)
            block.fill_(1)
            row.append(block_bytes / (time.perf_counter() - start) / 1e9)
            held.append(block)
        del held
        rates.append(row)
    return rates


def summary(rates: list[list[float]], block_bytes: int) -> dict[str, Any]:
    """The rounds' rates, each block's ratio to its round's fastest, and the bytes held at each block."""
    return {
        "block bytes": block_bytes,
        "held bytes at each block": [block_bytes * (k + 1) for k in range(len(rates[0]))],
        "GB/s": rates,
        "ratio to the round's fastest": [[rate / max(row) for rate in row] for row in rates],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fresh_memory", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--block-gb", type=float, default=2.0)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pause-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    args = parser.parse_args(argv)
    block_bytes = int(args.block_gb * 1e9)
    result = summary(first_touch_rounds(block_bytes, args.blocks, args.rounds, args.pause_s), block_bytes)
    for index, row in enumerate(result["GB/s"]):
        held = " ".join(f"{rate:5.2f}" for rate in row)
        print(f"round {index}: first touch GB/s with {args.block_gb:g} GB more held at each block: {held}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
