"""Does a writer *process* train faster than a writer thread? The bytes of a save, written both ways.

Issue 15 asks for a writer process if a thread cannot keep training at 0.9 of its speed while an async
save is in flight. This experiment separates the two things a background save takes from training:
the interpreter lock (a thread shares it, a process does not) and the machine (cores, memory bandwidth,
the page cache: both share those). Each rank stages its local shards (model and optimizer state) into
buffers in shared memory, then writes exactly what a save's writer writes for them, from a thread of
the training process or from a writer process started once (``benchmarks.staging``). The training
windows are those of ``benchmarks.training``, so the rows compare with ``throughput-ours-*`` (our real
async save) in the same run::

    python -m benchmarks.writers                      # ShardedFSDP, 2 GB, 512 rows per step
    python -m benchmarks.writers --strategy ours-mp --cycles 3
    python -m benchmarks.writers --cpu                # CPU seconds of one save, by thread

``--cpu`` is the profile of what a save takes from training: with training idle, each rank makes
``--cycles`` async saves and as many bare writes of the same staged bytes, and prints the CPU seconds
(user and system) each thread spent from the save's start to its publication (``/proc/self/task``).
It found the page cache's fresh memory in the save thread's system time (what
:mod:`lightning_sharded.checkpoint.writeback` now avoids).

The writer cases, one registry (:data:`CASES`, from :data:`benchmarks.staging.WRITERS` and our
strategies): ``throughput-writer-<kind>-<strategy>`` and ``savecpu-<strategy>``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist

from benchmarks.builders import ThroughputModel, geometry, make_strategy, shards_layers, trainer_for
from benchmarks.ranks import Case, run_rank_cases
from benchmarks.report import training_figures
from benchmarks.staging import WRITERS, Staged, local_tensors, make_writer
from benchmarks.training import AsyncSave, Saver, throughput
from benchmarks.world import all_done, remove, settle

#: Our strategies the writer cases run under.
OURS = ("ours-mp", "ours-fsdp")

ThreadTimes = dict[int, tuple[str, float, float]]


class BareSave:
    """A :class:`benchmarks.training.Saver` that stages this rank's shards and writes their bytes with a
    bare writer of ``kind`` instead of our save."""

    def __init__(self, kind: str) -> None:
        self.writer, self.staged = make_writer(kind), Staged()
        self.staged_bytes = 0

    def start(self, trainer: L.Trainer, path: Path) -> None:
        assert trainer.strategy.model is not None
        new = self.staged.stage(local_tensors(trainer.strategy.model, trainer.optimizers[0]))
        self.staged_bytes = sum(b.numel() * b.element_size() for b in self.staged.buffers)
        self.writer.start(self.staged, str(path), new)

    def writing(self, trainer: L.Trainer) -> bool:
        return self.writer.writing

    def close(self) -> dict[str, Any]:
        self.writer.close()
        return {"staged bytes": self.staged_bytes}


def thread_cpu() -> ThreadTimes:
    """``{thread id: (name, user s, system s)}`` of every thread of this process now (Linux ``/proc``).

    Python threads are named by their ``threading`` name (digits dropped, so a pool's threads add up in
    :func:`by_name`), the main thread ``main``, the others (gloo's, torch's) by their kernel name."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().native_id
    found: ThreadTimes = {}
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


def by_name(before: ThreadTimes, after: ThreadTimes) -> dict[str, list[float]]:
    """``{thread name: [user s, system s]}`` spent between two :func:`thread_cpu` readings."""
    spent: dict[str, list[float]] = {}
    for tid, (name, user, system) in after.items():
        _, user0, system0 = before.get(tid, (name, 0.0, 0.0))
        if user - user0 + system - system0 > 0:
            total = spent.setdefault(name, [0.0, 0.0])
            total[0] += user - user0
            total[1] += system - system0
    return spent


def save_cpu_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """CPU seconds one async save costs this rank, by thread, against the same bytes from a bare thread.

    Training is idle while the save runs (the main thread sleeps until every rank's save is published),
    so the seconds are the save's own: ``--cycles`` times, our async save (``trainer.save_checkpoint``
    with ``async_save=True``) and then the same staged tensors written from a thread (staging
    included). Threads that end during a window (DCP's, the checksum helper's) count their seconds up
    to their last reading, so each window reads every thread's times once more at its end.
    """
    strategy_name = name.removeprefix("savecpu-")
    ckpt = args.dir / f"{name}.ckpt"
    record: dict[str, Any] = {"ours": [], "bare": [], "ours wall s": [], "bare wall s": []}
    savers: dict[str, Saver] = {"ours": AsyncSave(), "bare": BareSave("thread")}
    bare = Path(str(ckpt) + ".bare")

    def window(kind: str, trainer: L.Trainer) -> None:
        settle()
        saver = savers[kind]
        before, start = thread_cpu(), time.perf_counter()
        saver.start(trainer, ckpt if kind == "ours" else bare)
        # Threads the save starts end before the window does: sample them while they live.
        latest = thread_cpu()
        while not all_done(not saver.writing(trainer)):
            time.sleep(0.05)
            latest = {**latest, **thread_cpu()}
        trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
        if isinstance(saver, BareSave):
            saver.writer.close()
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

    model = ThroughputModel(args.width, args.layers, shards_layers(strategy_name), args.batch)
    trainer = trainer_for(make_strategy(strategy_name, dist.get_world_size(), async_save=True), [Measure()])
    trainer.fit(model)
    del trainer, model
    remove(ckpt)
    remove(bare)
    return record


def writer_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``throughput-writer-<kind>-<strategy>``: the training windows of ``benchmarks.training`` with the
    bytes of the save written by a bare writer of ``kind``."""
    kind, _, strategy = name.removeprefix("throughput-writer-").partition("-")
    return throughput(name, args, strategy, args.batch, BareSave(kind))


CASES: dict[str, Case] = {
    **{f"throughput-writer-{kind}-{strategy}": writer_case for kind in WRITERS for strategy in OURS},
    **{f"savecpu-{strategy}": save_cpu_case for strategy in OURS},
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.writers", description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ours-fsdp", choices=list(OURS))
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    parser.add_argument(
        "--cpu", action="store_true", help="instead: CPU seconds of a save by thread, ours against bare bytes"
    )
    args = parser.parse_args(argv)
    width, layers = geometry(args.size_gb)
    figures = cpu_main(args, width, layers) if args.cpu else windows_main(args, width, layers)
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1))
    return figures


def windows_main(args: argparse.Namespace, width: int, layers: int) -> dict[str, Any]:
    """Our async save and each bare writer in the same training windows; prints each case's ratio."""
    cases = [f"throughput-{args.strategy}"] + [
        f"throughput-writer-{kind}-{args.strategy}" for kind in WRITERS
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
        figures[case] = {"error": errors[0]} if errors else training_figures(records)  # as run counts
    for case, figure in figures.items():
        if "error" in figure:
            print(f"{case}: {figure['error']}")
        else:
            shown = ", ".join(f"{r:.2f}" for r in figure["pairs"])
            print(
                f"{case}: while saving / without {figure['while saving / without']:.2f} ({shown}); window"
                f" {figure['save in flight s']:.1f} s"
            )
    return figures


def cpu_main(args: argparse.Namespace, width: int, layers: int) -> dict[str, Any]:
    """``--cpu``: print each rank's median CPU seconds per thread of our save and of the bare bytes."""
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
    return figures


if __name__ == "__main__":
    main()
