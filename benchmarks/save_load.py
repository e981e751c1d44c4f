"""Rank cases of save and load throughput, full-file memory and verified loads (``benchmarks.run``).

- ``stock-mp``, ``stock-fsdp``, ``ours-mp``, ``ours-fsdp``: a real Lightning ``Trainer`` fits one step,
  then ``trainer.save_checkpoint`` is timed ``--repeats`` times, each followed by the write probes on
  the files it wrote (``benchmarks.faithful.probe_writes``); then a new model and Trainer resume from
  it with ``fit(ckpt_path=...)`` ``--repeats`` times, the page cache of the checkpoint dropped before
  each, timing the restore (:func:`restore_timer`) and recording what each rank read, each followed by
  the read probes of those bytes (``benchmarks.faithful.probe_reads``).
- ``torch``: the same model sharded with ``fully_shard`` without Lightning; each rank ``torch.save``-s its
  local shards (then fsync) and ``torch.load``-s them back cold; also plain ``dcp.save`` / ``dcp.load`` and
  the blocking time of ``dcp.async_save``, torch's own figures.
- ``memory-stock-mp``, ``memory-ours-mp``: resume from one full checkpoint file (written by stock
  ``ModelParallelStrategy`` in the ``stock-mp`` case) into the sharded model, recording the peak resident
  memory (``VmHWM``, reset through ``/proc/self/clear_refs`` before the restore).
- ``verify-ours-mp``: ``ShardedModelParallelStrategy`` resumes with ``verify=True`` and with
  ``verify="during"`` against without, in turn (``--verify-cycles`` rounds); its checkpoint stays at
  ``DIR/kept.ckpt`` for the offline tools' figures (``benchmarks.tools``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from benchmarks.builders import STEPS, STRATEGIES, BenchModel, make_strategy, shards_layers, trainer_for
from benchmarks.faithful import Extent, probe_reads, probe_writes, recording_reads
from benchmarks.ranks import Case
from benchmarks.timing import timer
from benchmarks.world import (
    barrier,
    evict,
    evict_own,
    local_bytes,
    remove,
    reset_peak_rss,
    settle,
    status_kib,
    timed,
    tree_bytes,
    world_size,
)

#: The two calls of Lightning's ``fit(ckpt_path=...)`` that restore a checkpoint.
RESTORE_CALLS = ("_restore_modules_and_callbacks", "restore_training_state")


@contextlib.contextmanager
def restore_timer(trainer: L.Trainer, record: dict[str, float]) -> Iterator[None]:
    """Time the restore of a ``fit(ckpt_path=...)`` inside the block: ``record["restore s"]`` (both calls
    of :data:`RESTORE_CALLS`), the RSS before it and its peak (``"rss before (KiB)"``, ``"peak (KiB)"``,
    ``"peak reset"``: whether the peak could be reset)."""
    connector = trainer._checkpoint_connector

    def before_restore() -> None:
        barrier()
        record["rss before (KiB)"] = status_kib("VmRSS")
        record["peak reset"] = float(reset_peak_rss())

    def done(seconds: float) -> None:
        record["restore s"] = record.get("restore s", 0.0) + seconds
        record["peak (KiB)"] = status_kib("VmHWM")

    with contextlib.ExitStack() as stack:
        stack.enter_context(timer(connector, RESTORE_CALLS[0], done, before=before_restore))
        stack.enter_context(timer(connector, RESTORE_CALLS[1], done))
        yield


def shard_bytes(trainer: L.Trainer) -> int:
    """Bytes of this rank's shard of the model and optimizer state."""
    strategy = trainer.strategy
    return local_bytes(strategy.lightning_module_state_dict()) + sum(
        local_bytes(strategy.optimizer_state(opt)) for opt in trainer.optimizers
    )


class SaveTimer(L.Callback):
    """At the end of fitting, time ``trainer.save_checkpoint`` ``repeats`` times, each followed by the
    write probes on its files (and write a full file)."""

    def __init__(
        self, ckpt: Path, args: argparse.Namespace, record: dict[str, Any], full: Path | None
    ) -> None:
        self.ckpt, self.args, self.record, self.full = ckpt, args, record, full

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        times = []
        for i in range(self.args.repeats):
            if i:
                remove(self.ckpt)
            settle()
            times.append(timed(lambda: trainer.save_checkpoint(self.ckpt)))
            probe_writes(self.args, self.record, self.ckpt, trainer)
        self.record["save s"] = times
        self.record["bytes"] = tree_bytes(self.ckpt)
        self.record["shard bytes"] = shard_bytes(trainer)
        if self.full is not None:  # stock ModelParallelStrategy's full file: one torch.save on rank 0
            strategy = trainer.strategy
            strategy._save_distributed_checkpoint = False  # type: ignore[attr-defined]
            trainer.save_checkpoint(self.full)
            strategy._save_distributed_checkpoint = True  # type: ignore[attr-defined]
            barrier()


def resume(
    strategy: str,
    args: argparse.Namespace,
    ckpt: Path,
    model: BenchModel | None = None,
    reads: list[Extent] | None = None,
    **options: Any,
) -> tuple[L.Trainer, dict[str, float]]:
    """A new model and Trainer (``strategy`` with ``options``) resumed from ``ckpt``: the trainer and
    its :func:`restore_timer` record; with ``reads``, what the resume read is appended to it."""
    if model is None:
        model = BenchModel(args.width, args.layers, shard_layers=shards_layers(strategy))
    trainer = trainer_for(make_strategy(strategy, world_size(), **options))
    restore: dict[str, float] = {}
    recording = recording_reads(reads) if reads is not None else contextlib.nullcontext()
    with restore_timer(trainer, restore), recording:
        trainer.fit(model, ckpt_path=ckpt)
    return trainer, restore


def lightning_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ckpt = args.dir / f"{name}.ckpt"
    full = args.dir / "full.ckpt" if name == "stock-mp" and args.full else None
    record: dict[str, Any] = {}
    model = BenchModel(args.width, args.layers, shard_layers=shards_layers(name))
    trainer = trainer_for(make_strategy(name, world_size()), [SaveTimer(ckpt, args, record, full)])
    trainer.fit(model)
    del trainer, model
    gc.collect()
    loads = []
    for _ in range(args.repeats):
        evict(ckpt)
        reads: list[Extent] = []
        trainer, restore = resume(name, args, ckpt, reads=reads)
        assert trainer.global_step == STEPS, trainer.global_step
        loads.append(restore["restore s"])
        del trainer
        gc.collect()
        probe_reads(args, record, ckpt, reads)
    record["load s"] = loads
    remove(ckpt)
    return record


def memory_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Resume from the full file into the sharded model; peak RSS against this rank's shard."""
    gc.collect()
    baseline = status_kib("VmRSS")
    model = BenchModel(args.width, args.layers, shard_layers=True)
    trainer, restore = resume(name.removeprefix("memory-"), args, args.dir / "full.ckpt", model)
    record = {
        "baseline rss bytes": baseline * 1024,
        "rss before restore bytes": restore["rss before (KiB)"] * 1024,
        "peak rss bytes": restore["peak (KiB)"] * 1024,
        "peak reset": bool(restore["peak reset"]),
        "shard bytes": shard_bytes(trainer),
        "largest tensor bytes": args.width * args.width * 4,
        "restore s": restore["restore s"],
    }
    del trainer, model
    gc.collect()
    return record


def torch_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Plain torch: fully_shard without Lightning; torch.save/load per rank, dcp.save/load/async_save."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import async_save, save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    model = BenchModel(args.width, args.layers, shard_layers=False)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = model.configure_optimizers()
    model.training_step([torch.randn(2, args.width)], 0).backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"state_dict": model_sd, "optimizer_0": optim_sd}

    def local(obj: Any) -> Any:
        if isinstance(obj, DTensor):
            return obj.to_local()
        if isinstance(obj, dict):
            return {k: local(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [local(v) for v in obj]
        return obj

    plain = local(state)
    file = args.dir / f"torch.rank{rank}.pt"

    def torch_save() -> None:
        with open(file, "wb") as f:
            torch.save(plain, f)
            f.flush()
            os.fsync(f.fileno())

    record: dict[str, Any] = {"save s": [], "load s": [], "dcp save s": [], "dcp load s": []}
    for _ in range(args.repeats):
        settle()
        record["save s"].append(timed(torch_save))
        record["bytes"] = file.stat().st_size * dist.get_world_size()
        evict_own(file)
        record["load s"].append(timed(lambda: torch.load(file, weights_only=True)))
    file.unlink()
    ckpt = args.dir / "dcp"
    for _ in range(args.repeats):
        remove(ckpt)
        settle()
        record["dcp save s"].append(timed(lambda: save(state, checkpoint_id=ckpt)))
        record["dcp bytes"] = tree_bytes(ckpt)
        evict(ckpt)
        record["dcp load s"].append(timed(lambda: dcp_load(state, checkpoint_id=ckpt)))
    # Stock async_save (a thread): how long it blocks, and the whole save, against dcp.save above.
    stalls, totals = [], []
    for _ in range(args.repeats):
        remove(ckpt)
        settle()
        start = time.perf_counter()
        future = async_save(state, checkpoint_id=ckpt)
        stalls.append(time.perf_counter() - start)
        assert isinstance(future, Future), future  # no async_stager: a plain Future
        future.result()
        barrier()
        totals.append(time.perf_counter() - start)
    record["async stall s"] = stalls
    record["async total s"] = totals
    remove(ckpt)
    return record


def verify_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Resume with ``verify=True``, with ``verify="during"`` and without, in turn, from one
    ShardedModelParallel checkpoint, left at ``DIR/kept.ckpt`` for the offline tools."""
    ckpt = args.dir / "kept.ckpt"

    class SaveOnce(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            settle()
            trainer.save_checkpoint(ckpt)

    model = BenchModel(args.width, args.layers, shard_layers=True)
    trainer = trainer_for(make_strategy("ours-mp", world_size()), [SaveOnce()])
    trainer.fit(model)
    del trainer, model
    gc.collect()
    keys: dict[bool | str, str] = {
        False: "plain load s",
        True: "verify load s",
        "during": "verify during load s",
    }
    record: dict[str, Any] = {key: [] for key in keys.values()} | {"bytes": tree_bytes(ckpt)}
    for _ in range(args.verify_cycles):
        for verify in keys:
            evict(ckpt)
            trainer, restore = resume("ours-mp", args, ckpt, verify=verify)
            record[keys[verify]].append(restore["restore s"])
            del trainer
            gc.collect()
    return record


CASES: dict[str, Case] = {
    **{name: lightning_case for name in STRATEGIES},
    "torch": torch_case,
    "memory-stock-mp": memory_case,
    "memory-ours-mp": memory_case,
    "verify-ours-mp": verify_case,
}
