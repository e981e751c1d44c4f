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
    python benchmarks/writers.py --cpu                # CPU seconds of one save, by thread

``--cpu`` is the profile of what a save takes from training: with training idle, each rank makes
``--cycles`` async saves and as many bare writes of the same staged bytes, and prints the CPU seconds
(user and system) each thread spent from the save's start to its publication (``/proc/self/task``).
It found the page cache's fresh memory in the save thread's system time (what
:mod:`lightning_sharded.checkpoint.writeback` now avoids).
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
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
            view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
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


def thread_cpu() -> dict[int, tuple[str, float, float]]:
    """``{thread id: (name, user s, system s)}`` of every thread of this process now (Linux ``/proc``).

    Python threads are named by their ``threading`` name (digits dropped, so a pool's threads add up in
    :func:`by_name`), the main thread ``main``, the others (gloo's, torch's) by their kernel name."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().native_id
    found: dict[int, tuple[str, float, float]] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{task}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended
            continue
        tid = int(task)
        name = "main" if tid == main_id else names.get(tid, comm)
        name = "".join(c for c in name if not c.isdigit()).rstrip("_-")
        found[tid] = (name, int(fields[11]) / tick, int(fields[12]) / tick)
    return found


def by_name(
    before: dict[int, tuple[str, float, float]], after: dict[int, tuple[str, float, float]]
) -> dict[str, list[float]]:
    """``{thread name: [user s, system s]}`` spent between two :func:`thread_cpu` readings."""
    spent: dict[str, list[float]] = {}
    for tid, (name, user, system) in after.items():
        _, user0, system0 = before.get(tid, (name, 0.0, 0.0))
        if user - user0 + system - system0 > 0:
            total = spent.setdefault(name, [0.0, 0.0])
            total[0] += user - user0
            total[1] += system - system0
    return spent


def save_cpu_case(name: str, args: Any) -> dict[str, Any]:
    """CPU seconds one async save costs this rank, by thread, against the same bytes from a bare thread.

    Training is idle while the save runs (the main thread sleeps until every rank's save is published),
    so the seconds are the save's own: ``--cycles`` times, our async save (``trainer.save_checkpoint``
    with ``async_save=True``) and then :func:`write_bytes` of the same staged tensors from a thread
    (staging included). Threads that end during a window (DCP's, the checksum helper's) count their
    seconds up to their last reading, so each window reads every thread's times once more at its end.
    """
    import time

    import lightning as L
    import torch.distributed as dist

    from benchmarks.ranks import ThroughputModel, _all_done, make_strategy, remove, settle, trainer_for

    strategy_name = name.removeprefix("savecpu-")
    ckpt = args.dir / f"{name}.ckpt"
    record: dict[str, Any] = {"ours": [], "bare": [], "ours wall s": [], "bare wall s": []}
    staged, writer = Staged(), ThreadWriter()

    def window(kind: str, trainer: L.Trainer) -> None:
        settle()
        before, start = thread_cpu(), time.perf_counter()
        if kind == "ours":
            trainer.save_checkpoint(ckpt)
        else:
            assert trainer.strategy.model is not None
            new = staged.stage(local_tensors(trainer.strategy.model, trainer.optimizers[0]))
            writer.start(staged, str(ckpt) + ".bare", new)
        saver = trainer.strategy._async_saver  # type: ignore[attr-defined]
        # Threads the save starts end before the window does: sample them while they live.
        latest = thread_cpu()
        while not _all_done(not (saver.writing if kind == "ours" else writer.writing)):
            time.sleep(0.05)
            latest = {**latest, **thread_cpu()}
        trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
        writer.close()
        wall = time.perf_counter() - start
        record[kind].append(by_name(before, {**latest, **thread_cpu()}))
        record[f"{kind} wall s"].append(wall)

    class Measure(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            for i in range(args.cycles + 1):  # the first of each allocates the staging buffers
                for kind in ("ours", "bare"):
                    window(kind, trainer)
                    if i == 0:
                        record[kind].pop()
                        record[f"{kind} wall s"].pop()

    model = ThroughputModel(args.width, args.layers, strategy_name.endswith("mp"), args.batch)
    trainer = trainer_for(make_strategy(strategy_name, dist.get_world_size(), async_save=True), [Measure()])
    trainer.fit(model)
    del trainer, model
    remove(ckpt)
    remove(Path(str(ckpt) + ".bare"))
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.run import geometry, run_rank_cases, training_figures

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ours-fsdp", choices=["ours-fsdp", "ours-mp"])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    parser.add_argument(
        "--cpu", action="store_true", help="instead: CPU seconds of a save by thread, ours against bare bytes"
    )
    args = parser.parse_args(argv)
    width, layers = geometry(args.size_gb)
    if args.cpu:
        return cpu_main(args, width, layers)
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


def cpu_main(args: argparse.Namespace, width: int, layers: int) -> dict[str, Any]:
    """``--cpu``: print each rank's median CPU seconds per thread of our save and of the bare bytes."""
    import statistics

    from benchmarks.run import run_rank_cases

    case = f"savecpu-{args.strategy}"
    scratch = Path(tempfile.mkdtemp(prefix="lswriters-"))
    try:
        options = ("--batch", str(args.batch), "--cycles", str(args.cycles))
        per_rank = [r[case] for r in run_rank_cases([case], scratch, width, layers, *options, timeout=3600)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    figures: dict[str, Any] = {}
    for rank, record in enumerate(per_rank):
        if "error" in record:
            print(f"rank {rank}: {record['error']}")
            continue
        for kind in ("ours", "bare"):
            threads = sorted({t for window in record[kind] for t in window})
            median = {
                t: [statistics.median(w.get(t, [0.0, 0.0])[i] for w in record[kind]) for i in (0, 1)]
                for t in threads
            }
            total = sum(u + s for u, s in median.values())
            wall = statistics.median(record[f"{kind} wall s"])
            print(f"rank {rank} {kind}: {total:.2f} CPU s in a {wall:.2f} s window")
            for t, (u, s) in sorted(median.items(), key=lambda kv: -sum(kv[1])):
                print(f"    {t:<40} user {u:6.2f}  system {s:6.2f}")
            figures[f"rank {rank} {kind}"] = {"threads": median, "cpu s": total, "window s": wall}
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
