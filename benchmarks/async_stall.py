"""Rank cases ``async-ours-mp``, ``async-ours-fsdp``: how long an async save blocks training.

With ``async_save=True``, how long ``trainer.save_checkpoint`` blocks the training loop, against a
synchronous save of the same state in the same process (``--async-repeats`` of each, alternating).
One more async save than timed comes first: it allocates the staging buffers and is reported apart.
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
from typing import Any

import lightning as L

from benchmarks.builders import BenchModel, make_strategy, trainer_for
from benchmarks.ranks import Case
from benchmarks.world import barrier, remove, settle, timed, world_size


class _Saves(L.Callback):
    """At the end of fitting: the first async save, then ``repeats`` x (sync save, async save)."""

    def __init__(self, args: argparse.Namespace, ckpt: Any, record: dict[str, Any]) -> None:
        self.args, self.ckpt, self.record = args, ckpt, record

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy: Any = trainer.strategy
        first: list[float] = []
        sync: list[float] = []
        stall: list[float] = []
        total: list[float] = []
        for i in range(self.args.async_repeats + 1):
            if i:
                strategy.async_save = False
                settle()
                sync.append(
                    timed(functools.partial(trainer.save_checkpoint, self.ckpt.with_suffix(f".sync{i}")))
                )
            strategy.async_save = True
            settle()
            start = time.perf_counter()
            trainer.save_checkpoint(self.ckpt.with_suffix(f".async{i}"))
            (stall if i else first).append(time.perf_counter() - start)
            strategy.wait_for_checkpoint()
            barrier()
            if i:
                total.append(time.perf_counter() - start)
        self.record["first async stall s"] = first
        self.record.update({"sync s": sync, "async stall s": stall, "async total s": total})


def async_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Our strategy with ``async_save=True``: blocking time of ``trainer.save_checkpoint`` vs a sync save."""
    strategy = name.removeprefix("async-")
    record: dict[str, Any] = {}
    ckpt = args.dir / f"{name}.ckpt"
    model = BenchModel(args.width, args.layers, shard_layers=True)
    trainer = trainer_for(
        make_strategy(strategy, world_size(), async_save=True), [_Saves(args, ckpt, record)]
    )
    trainer.fit(model)
    del trainer, model
    gc.collect()
    for i in range(args.async_repeats + 1):
        remove(ckpt.with_suffix(f".sync{i}"))
        remove(ckpt.with_suffix(f".async{i}"))
    return record


CASES: dict[str, Case] = {"async-ours-mp": async_case, "async-ours-fsdp": async_case}
