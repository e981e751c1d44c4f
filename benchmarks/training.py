"""Rank cases of training while a save is in flight: steps per second with a save, against without.

- ``throughput-ours-mp``, ``throughput-ours-fsdp``: a training step of ``--batch`` rows (matmul-bound at
  the full run's 512 rows; the rest of the step is FSDP's all-gathers and reduce-scatters over gloo)
  while our async save is in flight, against the steps just before it without one;
- ``throughput-light-ours-mp``: the same with ``--light-batch`` rows (8: a step that is all
  communication and memory traffic, which a save's copies compete with directly).

:func:`throughput` measures any :class:`Saver`; ``benchmarks.writers`` gives it the bare bytes of a
save written by a thread or a process instead of our save.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from typing import Any, Protocol

import lightning as L

from benchmarks.builders import ThroughputModel, make_strategy, shards_layers, trainer_for
from benchmarks.ranks import Case
from benchmarks.world import all_done, barrier, remove, world_size

#: Steps before the first window (the first of them starts a save: it allocates the staging buffers).
WARMUP = 2


class Saver(Protocol):
    """What a throughput window saves with: started once per window, polled after every step."""

    def start(self, trainer: L.Trainer, path: Path) -> None:
        """Start a save of ``trainer``'s state to ``path``; return while it runs."""

    def writing(self, trainer: L.Trainer) -> bool:
        """Whether this rank's save is still in flight."""

    def close(self) -> dict[str, Any]:
        """Once the fit ended: stop, and what to add to the case's figures."""


class AsyncSave:
    """Our strategy's own async save (``trainer.save_checkpoint`` with ``async_save=True``)."""

    def start(self, trainer: L.Trainer, path: Path) -> None:
        trainer.save_checkpoint(path)

    def writing(self, trainer: L.Trainer) -> bool:
        saver = trainer.strategy._async_saver  # type: ignore[attr-defined]
        return saver is not None and bool(saver.writing)

    def close(self) -> dict[str, Any]:
        return {}


class _Windows(L.Callback):
    """Alternates windows of ``steady`` steps without a save and windows from a save's start until every
    rank's save is published (a completion check after every step in both), ``cycles`` times."""

    def __init__(self, saver: Saver, ckpt: Path, steady: int, cycles: int, record: dict[str, Any]) -> None:
        self.saver, self.ckpt, self.steady, self.cycles, self.record = saver, ckpt, steady, cycles, record
        self.mode, self.count, self.start, self.done_cycles = "warmup", 0, 0.0, 0

    def _begin(self, mode: str, trainer: L.Trainer) -> None:
        self.mode, self.count = mode, 0
        barrier()
        self.start = time.perf_counter()
        if mode == "saving":
            self.saver.start(trainer, self.ckpt)

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        strategy: Any = trainer.strategy
        self.count += 1
        done = all_done(not self.saver.writing(trainer))
        if self.mode == "warmup":
            if self.count == 1:
                self.saver.start(trainer, self.ckpt)  # allocates the staging buffers
            if self.count >= WARMUP and done:
                strategy.wait_for_checkpoint()
                self._begin("steady", trainer)
        elif self.mode == "steady" and self.count >= self.steady:
            self.record["steady steps/s"].append(self.count / (time.perf_counter() - self.start))
            self._begin("saving", trainer)
        elif self.mode == "saving" and done:
            elapsed = time.perf_counter() - self.start
            self.record["saving steps/s"].append(self.count / elapsed)
            self.record["save window s"].append(elapsed)
            self.record["steps"].append(self.count)
            strategy.wait_for_checkpoint()
            self.done_cycles += 1
            if self.done_cycles >= self.cycles:
                trainer.should_stop = True
                self.mode = "done"
            else:
                self._begin("steady", trainer)


def throughput(
    name: str, args: argparse.Namespace, strategy: str, batch: int, saver: Saver
) -> dict[str, Any]:
    """Steps per second of ``strategy`` (with ``async_save=True``) at ``batch`` rows per step while
    ``saver`` saves, against the steps without: ``--cycles`` pairs of windows of ``--steady`` steps."""
    ckpt = args.dir / f"{name}.ckpt"
    record: dict[str, Any] = {
        "steady steps/s": [],
        "saving steps/s": [],
        "save window s": [],
        "steps": [],
        "batch": batch,
    }
    windows = _Windows(saver, ckpt, args.steady, args.cycles, record)
    model = ThroughputModel(args.width, args.layers, shards_layers(strategy), batch)
    trainer = trainer_for(make_strategy(strategy, world_size(), async_save=True), [windows])
    trainer.fit_loop.epoch_loop.max_steps = 10_000
    trainer.fit(model)
    record.update(saver.close())
    del trainer, model
    gc.collect()
    remove(ckpt)
    return record


def throughput_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``throughput-[light-]<strategy>``: our async save in flight."""
    light = name.startswith("throughput-light-")
    strategy = name.removeprefix("throughput-").removeprefix("light-")
    return throughput(name, args, strategy, args.light_batch if light else args.batch, AsyncSave())


CASES: dict[str, Case] = {
    name: throughput_case
    for name in (
        "throughput-ours-mp",
        "throughput-ours-fsdp",
        "throughput-light-ours-mp",
        "throughput-light-ours-fsdp",
    )
}
