"""Does a writer *process* train faster than a writer thread? The bytes of a save, written both ways.

Issue 15 asks for a writer process if a thread cannot keep training at 0.9 of its speed while an async
save is in flight. This experiment separates the two things a background save takes from training:
the interpreter lock (a thread shares it, a process does not) and the machine (cores, memory bandwidth,
the page cache: both share those). Each rank stages its local shards (model and optimizer state) into
buffers in shared memory, then writes exactly what a save's writer writes for them (CRC-32 and
``os.write`` in 4 MiB pieces, then ``fsync``), from a thread of the training process
(``throughput-writer-thread-*``) or from a writer process started once (``throughput-writer-process-*``),
niced as our writer thread is. The training windows are those of ``benchmarks/ranks.py``'s throughput
cases, so the rows compare with ``throughput-ours-*`` (our real async save) in the same run::

    python benchmarks/writers.py                      # ShardedFSDP, 2 GB, 512 rows per step
    python benchmarks/writers.py --strategy ours-mp --cycles 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import zlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: What the writer writes at a time (as the DCP writer's checksummed pieces).
PIECE = 4 << 20
#: The writers' ``nice`` increment: our background writer's (``async_save.WRITER_NICE``).
NICE = 10


def write_bytes(buffers: list[torch.Tensor], path: str) -> None:
    """CRC-32 and write every buffer's bytes to ``path``, a piece at a time, then fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for buffer in buffers:
            view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
            for start in range(0, len(view), PIECE):
                piece = view[start : start + PIECE]
                zlib.crc32(piece)
                while piece:
                    piece = piece[os.write(fd, piece) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def local_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards of the model's parameters and the optimizer's state (what a save writes)."""
    found = [*module.parameters()]
    found += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in found]
    return [t.detach() for t in local if t.numel() > 1]


class Staged:
    """Buffers in shared memory holding a copy of the tensors, reused from one :meth:`stage` to the next."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    @torch.no_grad()
    def stage(self, tensors: list[torch.Tensor]) -> bool:
        """Copy ``tensors`` in; ``True`` if the buffers were (re)allocated."""
        new = [(b.shape, b.dtype) for b in self.buffers] != [(t.shape, t.dtype) for t in tensors]
        if new:
            self.buffers = [torch.empty_like(t, device="cpu").share_memory_() for t in tensors]
        for buffer, tensor in zip(self.buffers, tensors, strict=True):
            buffer.copy_(tensor)
        return new


class ThreadWriter:
    """Writes the staged buffers from a thread of this process (niced as our writer)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self, staged: Staged, path: str, _new: bool) -> None:
        def run() -> None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            write_bytes(staged.buffers, path)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    @property
    def writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()


def _serve(conn: Connection) -> None:
    """The writer process: buffers (once, or again when they change), then a path per save."""
    os.setpriority(os.PRIO_PROCESS, 0, NICE)
    torch.set_num_threads(1)
    buffers: list[torch.Tensor] = []
    while True:
        kind, value = conn.recv()
        if kind == "stop":
            return
        if kind == "buffers":
            buffers = value
            continue
        write_bytes(buffers, value)
        conn.send("done")


class ProcessWriter:
    """Writes the staged buffers from a process started once (spawned; the buffers are shared, not
    copied: torch passes shared-memory storages by file descriptor)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        import torch.multiprocessing  # noqa: F401  (registers the tensor reductions for the pipe)

        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child,), daemon=True)
        self._process.start()
        child.close()
        self._pending = False

    def start(self, staged: Staged, path: str, new: bool) -> None:
        if new:
            self._conn.send(("buffers", staged.buffers))
        self._conn.send(("write", path))
        self._pending = True

    @property
    def writing(self) -> bool:
        if self._pending and self._conn.poll():
            self._conn.recv()
            self._pending = False
        return self._pending

    def close(self) -> None:
        while self.writing:
            self._conn.poll(1.0)
        self._conn.send(("stop", None))
        self._process.join(30)


def make_writer(kind: str) -> ThreadWriter | ProcessWriter:
    return ThreadWriter() if kind == "thread" else ProcessWriter()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.run import geometry, run_rank_cases, training_figures

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ours-fsdp", choices=["ours-fsdp", "ours-mp"])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    width, layers = geometry(args.size_gb)
    cases = [f"throughput-{args.strategy}"] + [
        f"throughput-writer-{kind}-{args.strategy}" for kind in ("thread", "process")
    ]
    scratch = Path(tempfile.mkdtemp(prefix="lswriters-"))
    try:
        options = ("--batch", str(args.batch), "--steady", "2", "--cycles", str(args.cycles))
        per_rank = run_rank_cases(cases, scratch, width, layers, *options, timeout=3600)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    figures: dict[str, Any] = {}
    for case in cases:
        records = [r[case] for r in per_rank]
        errors = [r["error"] for r in records if "error" in r]
        figures[case] = {"error": errors[0]} if errors else training_figures(records)  # as run.py counts
    for case, figure in figures.items():
        if "error" in figure:
            print(f"{case}: {figure['error']}")
        else:
            shown = ", ".join(f"{r:.2f}" for r in figure["pairs"])
            print(
                f"{case}: while saving / without {figure['while saving / without']:.2f} ({shown}); window"
                f" {figure['save in flight s']:.1f} s"
            )
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
