"""The bytes of a save, staged in shared memory and written by a bare thread or a writer process.

The two writers that ``benchmarks.writers`` compares with our async save: each writes exactly what a
save's writer writes for the staged tensors (CRC-32 and ``os.write`` in 4 MiB pieces, then ``fsync``),
niced as our writer thread is. :data:`WRITERS` is the registry of them by kind. This module imports
torch only: a writer process starts by importing it.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Protocol

import torch

from lightning_sharded.checkpoint.checksum import crc32

#: What the writer writes at a time (as the DCP writer's checksummed pieces).
PIECE = 4 << 20
#: The writers' ``nice`` increment: our background writer's (``async_save.WRITER_NICE``).
NICE = 10


def write_bytes(buffers: list[torch.Tensor], path: str) -> None:
    """CRC-32 and write every buffer's bytes to ``path``, a piece at a time, then fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for buffer in buffers:
            view = buffer.reshape(-1).view(torch.uint8).numpy().data
            for start in range(0, len(view), PIECE):
                piece = view[start : start + PIECE]
                crc32(piece)
                while piece:
                    piece = piece[os.write(fd, piece) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def local_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards of the model's parameters and the optimizer's state (what a save writes)."""
    found: list[torch.Tensor] = [*module.parameters()]
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

    def start(self, staged: Staged, path: str, new: bool) -> None:
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


class Writer(Protocol):
    """A bare writer of the staged buffers: one write at a time."""

    def start(self, staged: Staged, path: str, new: bool) -> None:
        """Write ``staged``'s buffers to ``path`` in the background (``new``: the buffers changed)."""

    @property
    def writing(self) -> bool:
        """Whether the last write is still running."""

    def close(self) -> None:
        """Wait for the last write, then stop."""


#: The bare writers by kind.
WRITERS: dict[str, Callable[[], Writer]] = {"thread": ThreadWriter, "process": ProcessWriter}


def make_writer(kind: str) -> Writer:
    """A new writer of ``kind`` (one of :data:`WRITERS`)."""
    return WRITERS[kind]()
