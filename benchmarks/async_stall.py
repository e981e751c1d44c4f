"""Rank cases ``async-[small-|mc-]ours-{mp,fsdp}``: how long an async save blocks training.

With ``async_save=True``, how long ``trainer.save_checkpoint`` blocks the training loop, against a
synchronous save of the same state in the same process (``--async-repeats`` of each, alternating).
One more async save than timed comes first: it allocates the staging buffers and is reported apart.
``async-ours-*`` use the run's model; ``async-small-ours-*`` a model of :data:`SMALL_GB` (the size
users start with, where the fixed costs of a save show). ``async-mc-ours-*`` save as users do:
``ModelCheckpoint(every_n_train_steps=1, save_top_k=1)``, so each save also removes the one before;
the time is that of ``ModelCheckpoint.on_train_batch_end``, each save alone (the one before drained).
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from benchmarks.builders import BenchModel, geometry, make_strategy, trainer_for
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


#: Checkpoint size (model + Adam) of the small-model cases, in GB (about 50 MB).
SMALL_GB = 0.05


class _TimedModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` saving every step and keeping one: the first two saves async (the buffers
    allocated), then odd steps sync and even ones async, each timed alone (the save before drained)."""

    def __init__(self, dirpath: Any, record: dict[str, Any]) -> None:
        super().__init__(dirpath=dirpath, filename="step{step}", every_n_train_steps=1, save_top_k=1)
        self.record = record

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        strategy: Any = trainer.strategy
        strategy.wait_for_checkpoint()
        step = trainer.global_step
        strategy.async_save = step < 3 or step % 2 == 0
        settle()
        start = time.perf_counter()
        super().on_train_batch_end(trainer, *args, **kwargs)
        elapsed = time.perf_counter() - start
        if step >= 3:
            self.record["async stall s" if strategy.async_save else "sync s"].append(elapsed)
        elif step == 1:
            self.record["first async stall s"].append(elapsed)


def model_checkpoint_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Our strategy saving through ``ModelCheckpoint`` every step, sync and async alternating."""
    strategy = name.removeprefix("async-mc-")
    record: dict[str, Any] = {"first async stall s": [], "sync s": [], "async stall s": []}
    width, layers = geometry(SMALL_GB)
    dirpath = args.dir / name
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size(),
        strategy=make_strategy(strategy, world_size(), async_save=True),
        max_steps=2 + 2 * args.async_repeats,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[_TimedModelCheckpoint(dirpath, record)],
    )
    trainer.fit(BenchModel(width, layers, shard_layers=True))
    trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
    barrier()
    del trainer
    gc.collect()
    remove(dirpath)
    return record


def async_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Our strategy with ``async_save=True``: blocking time of ``trainer.save_checkpoint`` vs a sync save."""
    small = name.startswith("async-small-")
    strategy = name.removeprefix("async-small-" if small else "async-")
    record: dict[str, Any] = {}
    ckpt = args.dir / f"{name}.ckpt"
    width, layers = geometry(SMALL_GB) if small else (args.width, args.layers)
    model = BenchModel(width, layers, shard_layers=True)
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


CASES: dict[str, Case] = {
    **{f"async-{size}ours-{s}": async_case for size in ("", "small-") for s in ("mp", "fsdp")},
    **{f"async-mc-ours-{s}": model_checkpoint_case for s in ("mp", "fsdp")},
}
