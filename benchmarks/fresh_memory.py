"""How fast this machine hands out memory a process touches for the first time, by how much is held.

Run: ``python -m benchmarks.fresh_memory [--block-gb 2] [--blocks 6] [--rounds 2] [--pause-s 60]
[--way touch|huge-pages|direct-read] [--out FILE]``. Each round allocates ``--blocks`` blocks one after
the other, each written once, holding the earlier ones, and times each block's first touch; then frees
them all and waits ``--pause-s`` before the next round. The ratio is each block's rate against the
round's fastest. The ways of the first touch (``--way``): ``touch``, ``torch.empty`` then ``fill_``;
``huge-pages``, the same on memory advised ``MADV_HUGEPAGE`` (2 MiB pages where the kernel has them);
``direct-read``, a read of a cold file straight into the new memory (``O_DIRECT`` where the file system
takes it: the disk's DMA, not the CPU, touches the pages), with the same file read into the round's
first block again at the end of the round (memory touched before) as that way's reference.

Why: a resume reads into new memory (the optimizer state; with ``verify=True`` also the model's
staging buffers), and on a virtual machine that returns freed memory to its host (free page
reporting, a balloon) that memory can cost the host's page faults. Here (a Firecracker VM, 24 GiB) the
first 4-8 GB held came at 4-6 GB/s and every block past them at 0.2-0.6 GB/s, a minute after the same
memory had been freed; so a figure at 8 GB whose resume needs more new memory (``verify=True``) is this
machine's memory, not the code (docs/benchmarks.md, "At 8 GB"). Its balloon device reports free
pages to the host (virtio-balloon's ``VIRTIO_BALLOON_F_REPORTING``; the figures' ``"free page
reporting"``), which takes them back; huge pages and reads straight into the memory were tried as ways
around it (``--way``), and neither is one: the host backs each page at the same rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WAYS = ("touch", "huge-pages", "direct-read")
#: ``madvise`` advice: back this range with transparent huge pages (``<linux/mman.h>``).
_MADV_HUGEPAGE = 14
#: The feature bit of a virtio balloon that reports free pages to the host (``<linux/virtio_balloon.h>``).
_BALLOON_F_REPORTING = 5
_PIECE = 8 << 20


def free_page_reporting(devices: Path = Path("/sys/bus/virtio/devices")) -> bool | None:
    """Whether this machine's virtio balloon reports free pages to its host (``None``: no balloon seen)."""
    for device in sorted(devices.glob("*")) if devices.is_dir() else []:
        with contextlib.suppress(OSError):
            if int((device / "device").read_text(), 16) == 5:  # virtio device id 5: the balloon
                features = (device / "features").read_text().strip()
                return len(features) > _BALLOON_F_REPORTING and features[_BALLOON_F_REPORTING] == "1"
    return None


def _read_into(path: Path, memory: mmap.mmap) -> bool:
    """``path``'s first ``len(memory)`` bytes read into ``memory``, cold; whether ``O_DIRECT`` took them."""
    view = memoryview(memory)
    try:
        fd, direct = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), hasattr(os, "O_DIRECT")
    except OSError:  # a file system without O_DIRECT (tmpfs): a buffered read of the evicted file
        fd, direct = os.open(path, os.O_RDONLY), False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        done = 0
        while done < len(memory):
            try:
                read = os.preadv(fd, [view[done : done + _PIECE]], done)
            except OSError:
                if not direct:
                    raise
                os.close(fd)  # O_DIRECT refused at read time (an unaligned end): go on buffered, once
                fd, direct = os.open(path, os.O_RDONLY), False
                continue
            if read <= 0:
                raise OSError(f"{str(path)!r} ended at byte {done} of {len(memory)}")
            done += read
    finally:
        view.release()
        os.close(fd)
    return direct


def _first_touch(way: str, nbytes: int, source: Path | None, direct: list[bool]) -> Callable[[], mmap.mmap]:
    """A function that allocates ``nbytes`` of new memory and touches every page of it the ``way`` asked
    (a ``direct-read`` appends to ``direct`` whether ``O_DIRECT`` took it)."""
    import torch

    from lightning_sharded.checkpoint import libc

    def block() -> mmap.mmap:
        memory = mmap.mmap(-1, nbytes)  # anonymous, page-aligned, untouched
        if way == "direct-read":
            assert source is not None
            direct.append(_read_into(source, memory))
            return memory
        if way == "huge-pages":
            address = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
            libc.madvise(address, nbytes, _MADV_HUGEPAGE)
        torch.frombuffer(memory, dtype=torch.uint8).fill_(1)
        return memory

    return block


def first_touch_rounds(
    block_bytes: int,
    blocks: int,
    rounds: int,
    pause_s: float,
    way: str = "touch",
    scratch: Path | None = None,
) -> tuple[list[list[float]], dict[str, Any]]:
    """GB/s of each block's first touch, per round (``blocks`` blocks of ``block_bytes`` held at once),
    and for a ``direct-read`` its reference per round (the same read into memory touched before) and
    whether every read took ``O_DIRECT`` (empty for the other ways)."""
    with contextlib.ExitStack() as stack:
        source = None
        if way == "direct-read":
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=scratch)))
            source = folder / "source.bin"
            with open(source, "wb") as out:
                chunk = os.urandom(min(block_bytes, _PIECE))
                for offset in range(0, block_bytes, len(chunk)):
                    out.write(chunk[: block_bytes - offset])
                out.flush()
                os.fsync(out.fileno())
        direct: list[bool] = []
        block = _first_touch(way, block_bytes, source, direct)
        rates: list[list[float]] = []
        references: list[float] = []
        for round_index in range(rounds):
            if round_index:
                time.sleep(pause_s)
            held: list[mmap.mmap] = []
            row = []
            for _ in range(blocks):
                start = time.perf_counter()
                held.append(block())
                row.append(block_bytes / (time.perf_counter() - start) / 1e9)
            if source is not None:
                start = time.perf_counter()
                _read_into(source, held[0])
                references.append(block_bytes / (time.perf_counter() - start) / 1e9)
            for memory in held:
                memory.close()
            rates.append(row)
        if source is None:
            return rates, {}
        return rates, {"the same read into memory touched before, GB/s": references, "O_DIRECT": all(direct)}


def summary(
    rates: list[list[float]], block_bytes: int, way: str = "touch", extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The rounds' rates, each block's ratio to its round's fastest, and the bytes held at each block
    (with the way's ``extra`` figures)."""
    figures: dict[str, Any] = {"way": way, "free page reporting": free_page_reporting(), **(extra or {})}
    return figures | {
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
    parser.add_argument("--way", choices=WAYS, default="touch", help="how each block is first touched")
    parser.add_argument(
        "--scratch", type=Path, default=None, help="where --way direct-read writes its file (a disk folder)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    args = parser.parse_args(argv)
    block_bytes = int(args.block_gb * 1e9)
    rates, extra = first_touch_rounds(
        block_bytes, args.blocks, args.rounds, args.pause_s, args.way, args.scratch
    )
    result = summary(rates, block_bytes, args.way, extra)
    references = extra.get("the same read into memory touched before, GB/s", [])
    print(f"free page reporting (virtio balloon): {result['free page reporting']}; first touch: {args.way}")
    for index, row in enumerate(result["GB/s"]):
        held = " ".join(f"{rate:5.2f}" for rate in row)
        print(f"round {index}: first touch GB/s with {args.block_gb:g} GB more held at each block: {held}")
        if references:
            print(f"         the same read into memory touched before: {references[index]:5.2f} GB/s")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
