"""The rank side of ``benchmarks/run.py``: one process per rank, started by its launcher.

Every rank runs the cases named on the command line one after the other, in the same process group,
and writes its own figures to ``OUT/rank<R>.json`` after each case (so a case that fails leaves the
others). Cases:

- ``stock-mp``, ``stock-fsdp``, ``ours-mp``, ``ours-fsdp``: a real Lightning ``Trainer`` (2 ranks, CPU,
  gloo) fits one step of a model of ``--layers`` ``Linear(width, width)`` with Adam (so the checkpoint is
  the model plus two Adam moments), then ``trainer.save_checkpoint`` is timed ``--repeats`` times; then a
  new model and Trainer resume from it with ``fit(ckpt_path=...)`` ``--repeats`` times, the page cache of
  the checkpoint dropped before each, timing the restore (``_restore_modules_and_callbacks`` plus
  ``restore_training_state``, the two calls Lightning makes for it).
- ``torch``: the same model sharded with ``fully_shard`` without Lightning; each rank ``torch.save``-s its
  local shards (then fsync) and ``torch.load``-s them back cold; also plain ``dcp.save`` / ``dcp.load`` and
  the blocking time of ``dcp.async_save``, torch's own figures.
- ``memory-stock-mp``, ``memory-ours-mp``: resume from one full checkpoint file (written by stock
  ``ModelParallelStrategy`` in the ``stock-mp`` case) into the sharded model, recording the peak resident
  memory (``VmHWM``, reset through ``/proc/self/clear_refs`` before the restore).
- ``async-ours-mp``, ``async-ours-fsdp``: ``async_save=True``: how long ``save_checkpoint`` blocks the
  training loop, against a synchronous save of the same state in the same process (``--async-repeats``
  of each).
- ``verify-ours-mp``: ``ShardedModelParallelStrategy`` resumes with ``verify=True`` and with
  ``verify="during"`` against without, in turn (``--verify-cycles`` rounds); its checkpoint stays for
  the offline tools' figures.
- ``throughput-ours-mp``, ``throughput-ours-fsdp``: steps per second of a training step of ``--batch``
  rows (matmul-bound at the full run's 512: about half the step is the matmuls, the rest FSDP's
  all-gathers and reduce-scatters over gloo) while an async save is in flight, against the steps just
  before it without one; ``throughput-light-ours-mp``: the same with ``--light-batch`` rows (8: a step
  that is all communication and memory traffic, which a save's copies compete with directly).

Times are taken on every rank between barriers; the launcher keeps the slowest rank.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.disk import CHUNK, evict_tree, read_all, read_into_new_memory, write_fsync  # noqa: E402

STEPS = 1


class BenchModel(L.LightningModule):
    """``layers`` bias-free ``Linear(width, width)``; FSDP2 shards each in ``configure_model``."""

    def __init__(self, width: int, layers: int, shard_layers: bool) -> None:
        super().__init__()
        self.width = width
        self.shard_layers = shard_layers
        self.layers = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])

    def configure_model(self) -> None:
        if not self.shard_layers or self._device_mesh is None:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.layers[0], FSDPModule):
            return
        mesh = self._device_mesh["data_parallel"]
        for layer in self.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(torch.randn(8, self.width)), batch_size=2)


class StockCpuFSDP(FSDPStrategy):
    """Stock ``FSDPStrategy``; the subclass passes the GPU check, and the wrap gets ``device_id=cpu``."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


def make_strategy(name: str, world: int, **options: Any) -> Any:
    wrap = {nn.Linear}
    if name == "stock-mp":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    if name == "stock-fsdp":
        return StockCpuFSDP(auto_wrap_policy=wrap, state_dict_type="sharded")
    import lightning_sharded

    if name == "ours-mp":
        return lightning_sharded.ShardedModelParallelStrategy(
            data_parallel_size=world, tensor_parallel_size=1, **options
        )
    if name == "ours-fsdp":
        return lightning_sharded.ShardedFSDPStrategy(auto_wrap_policy=wrap, **options)
    raise SystemExit(f"unknown strategy {name!r}")


def trainer_for(strategy: Any, callbacks: list[Any] | None = None) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks or [],
    )


# ------------------------------------------------------------------------------------------- helpers


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def settle() -> None:
    """Flush every dirty page of the machine (untimed), so a timed write does not pay for older ones.

    ext4 commits its journal on fsync; with dirty data of earlier files (a full checkpoint written
    without fsync, deleted checkpoints) that made the first timed write of each case 3-6x slower.
    """
    barrier()
    os.sync()
    barrier()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes on this rank, between barriers (so all ranks start together)."""
    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    barrier()
    if dist.get_rank() == 0:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
    barrier()


def evict(path: Path) -> None:
    """Drop the page cache of the checkpoint files (rank 0), so the next read comes from the disk."""
    barrier()
    if dist.get_rank() == 0:
        evict_tree(path)
    barrier()


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (``clear_refs`` 5); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_RANDOM = os.urandom(CHUNK)


def raw_probe(args: argparse.Namespace, record: dict[str, Any]) -> None:
    """The disk's raw bandwidth, taken the way the checkpoints use it: every rank writes (then fsyncs)
    and cold-reads its share of ``--raw-bytes`` at once, then cold-reads it again into new memory laid
    out as a resume's (``benchmarks/disk.py``, :func:`read_into_new_memory`). Interleaved with the
    timed saves, so both see the same disk (its bandwidth drifts by 2x on these machines)."""
    if not args.raw_bytes:
        return
    file = args.dir / f"raw.rank{dist.get_rank()}.bin"
    share = args.raw_bytes // dist.get_world_size()
    settle()
    record.setdefault("raw write s", []).append(timed(lambda: write_fsync(file, share, _RANDOM)))
    evict_own(file)
    record.setdefault("raw read s", []).append(timed(lambda: read_all(file)))
    read = read_into_new_memory(file, share)
    evict_own(file)
    record.setdefault("raw new-memory read s", []).append(timed(read))
    del read
    file.unlink()


def local_bytes(obj: Any) -> int:
    """Bytes of this rank's part of every tensor in ``obj`` (a nested dict/list of tensors)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return local_bytes(obj.to_local())
    if isinstance(obj, torch.Tensor):
        if type(obj).__name__ == "ShardedTensor":
            return sum(local_bytes(shard.tensor) for shard in obj.local_shards())  # type: ignore[attr-defined]
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(local_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(local_bytes(v) for v in obj)
    return 0


@contextlib.contextmanager
def timing_restore(trainer: L.Trainer, record: dict[str, float]) -> Iterator[None]:
    """Time the two calls of a ``fit(ckpt_path=...)`` that restore the checkpoint (and their peak RSS)."""
    connector = trainer._checkpoint_connector
    originals = {
        name: getattr(connector, name)
        for name in ("_restore_modules_and_callbacks", "restore_training_state")
    }

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            if name == "_restore_modules_and_callbacks":
                barrier()
                record["rss before (KiB)"] = status_kib("VmRSS")
                record["peak reset"] = float(reset_peak_rss())
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record["restore s"] = record.get("restore s", 0.0) + time.perf_counter() - start
                record["peak (KiB)"] = status_kib("VmHWM")

        return timed_call

    for name, fn in originals.items():
        setattr(connector, name, wrap(name, fn))
    yield


class SaveTimer(L.Callback):
    """At the end of fitting, time ``trainer.save_checkpoint`` ``repeats`` times (and write a full file)."""

    def __init__(
        self, ckpt: Path, args: argparse.Namespace, record: dict[str, Any], full: Path | None
    ) -> None:
        self.ckpt, self.args, self.record, self.full = ckpt, args, record, full

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        times = []
        for i in range(self.args.repeats):
            if i:
                remove(self.ckpt)
            raw_probe(self.args, self.record)
            settle()
            times.append(timed(lambda: trainer.save_checkpoint(self.ckpt)))
        self.record["save s"] = times
        self.record["bytes"] = tree_bytes(self.ckpt)
        self.record["shard bytes"] = local_bytes(trainer.strategy.lightning_module_state_dict()) + sum(
            local_bytes(trainer.strategy.optimizer_state(opt)) for opt in trainer.optimizers
        )
        if self.full is not None:  # stock ModelParallelStrategy's full file: one torch.save on rank 0
            strategy = trainer.strategy
            strategy._save_distributed_checkpoint = False  # type: ignore[attr-defined]
            trainer.save_checkpoint(self.full)
            strategy._save_distributed_checkpoint = True  # type: ignore[attr-defined]
            barrier()


# --------------------------------------------------------------------------------------------- cases


def lightning_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    ckpt = args.dir / f"{name}.ckpt"
    full = args.dir / "full.ckpt" if name == "stock-mp" and args.full else None
    record: dict[str, Any] = {}
    model = BenchModel(args.width, args.layers, shard_layers=name.endswith("mp"))
    trainer = trainer_for(make_strategy(name, world), [SaveTimer(ckpt, args, record, full)])
    trainer.fit(model)
    del trainer, model
    gc.collect()
    loads = []
    for _ in range(args.repeats):
        evict(ckpt)
        restore: dict[str, float] = {}
        model = BenchModel(args.width, args.layers, shard_layers=name.endswith("mp"))
        trainer = trainer_for(make_strategy(name, world))
        with timing_restore(trainer, restore):
            trainer.fit(model, ckpt_path=ckpt)
        assert trainer.global_step == STEPS, trainer.global_step
        loads.append(restore["restore s"])
        del trainer, model
        gc.collect()
    record["load s"] = loads
    remove(ckpt)
    return record


def memory_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Resume from the full file into the sharded model; peak RSS against this rank's shard."""
    world = dist.get_world_size()
    full = args.dir / "full.ckpt"
    gc.collect()
    baseline = status_kib("VmRSS")
    model = BenchModel(args.width, args.layers, shard_layers=True)
    trainer = trainer_for(make_strategy(name.removeprefix("memory-"), world))
    restore: dict[str, float] = {}
    with timing_restore(trainer, restore):
        trainer.fit(model, ckpt_path=full)
    shard = local_bytes(trainer.strategy.lightning_module_state_dict()) + sum(
        local_bytes(trainer.strategy.optimizer_state(opt)) for opt in trainer.optimizers
    )
    record = {
        "baseline rss bytes": baseline * 1024,
        "rss before restore bytes": restore["rss before (KiB)"] * 1024,
        "peak rss bytes": restore["peak (KiB)"] * 1024,
        "peak reset": bool(restore["peak reset"]),
        "shard bytes": shard,
        "largest tensor bytes": args.width * args.width * 4,
        "restore s": restore["restore s"],
    }
    del trainer, model
    gc.collect()
    return record


def torch_case(args: argparse.Namespace) -> dict[str, Any]:
    """Plain torch: fully_shard without Lightning; torch.save/load per rank, dcp.save/load/async_save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
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
        record["dcp save s"].append(timed(lambda: dcp.save(state, checkpoint_id=ckpt)))
        record["dcp bytes"] = tree_bytes(ckpt)
        evict(ckpt)
        record["dcp load s"].append(timed(lambda: dcp.load(state, checkpoint_id=ckpt)))
    # Stock async_save (a thread): how long it blocks, and the whole save, against dcp.save above.
    stalls, totals = [], []
    for _ in range(args.repeats):
        remove(ckpt)
        settle()
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=ckpt)
        stalls.append(time.perf_counter() - start)
        future.result()
        barrier()
        totals.append(time.perf_counter() - start)
    record["async stall s"] = stalls
    record["async total s"] = totals
    remove(ckpt)
    return record


def evict_own(file: Path) -> None:
    barrier()
    evict_tree(file)
    barrier()


def async_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Our strategy with ``async_save=True``: blocking time of ``trainer.save_checkpoint`` vs a sync save."""
    world = dist.get_world_size()
    strategy_name = name.removeprefix("async-")
    record: dict[str, Any] = {}
    ckpt = args.dir / f"{name}.ckpt"

    first: list[float] = []

    class Saves(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            strategy: Any = trainer.strategy
            sync, stall, total = [], [], []
            # One more async save than timed: the first allocates the staging buffers (kept apart).
            for i in range(args.async_repeats + 1):
                if i:
                    strategy.async_save = False
                    settle()
                    sync.append(timed(lambda i=i: trainer.save_checkpoint(ckpt.with_suffix(f".sync{i}"))))
                strategy.async_save = True
                settle()
                start = time.perf_counter()
                trainer.save_checkpoint(ckpt.with_suffix(f".async{i}"))
                (stall if i else first).append(time.perf_counter() - start)
                strategy.wait_for_checkpoint()
                barrier()
                if i:
                    total.append(time.perf_counter() - start)
            record["first async stall s"] = first
            record.update({"sync s": sync, "async stall s": stall, "async total s": total})

    model = BenchModel(args.width, args.layers, shard_layers=True)
    trainer = trainer_for(make_strategy(strategy_name, world, async_save=True), [Saves()])
    trainer.fit(model)
    del trainer, model
    gc.collect()
    for i in range(args.async_repeats + 1):
        remove(ckpt.with_suffix(f".sync{i}"))
        remove(ckpt.with_suffix(f".async{i}"))
    return record


def verify_case(args: argparse.Namespace) -> dict[str, Any]:
    """Resume with ``verify=True``, with ``verify="during"`` and without, in turn, from one
    ShardedModelParallel checkpoint.

    The checkpoint is left at ``DIR/kept.ckpt`` for the offline tools' figures of ``benchmarks/run.py``.
    """
    world = dist.get_world_size()
    ckpt = args.dir / "kept.ckpt"

    class SaveOnce(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            settle()
            trainer.save_checkpoint(ckpt)

    model = BenchModel(args.width, args.layers, shard_layers=True)
    trainer = trainer_for(make_strategy("ours-mp", world), [SaveOnce()])
    trainer.fit(model)
    del trainer, model
    gc.collect()
    keys = {False: "plain load s", True: "verify load s", "during": "verify during load s"}
    record: dict[str, Any] = {key: [] for key in keys.values()} | {"bytes": tree_bytes(ckpt)}
    for _ in range(args.verify_cycles):
        for verify in keys:
            evict(ckpt)
            restore: dict[str, float] = {}
            model = BenchModel(args.width, args.layers, shard_layers=True)
            trainer = trainer_for(make_strategy("ours-mp", world, verify=verify))
            with timing_restore(trainer, restore):
                trainer.fit(model, ckpt_path=ckpt)
            record[keys[verify]].append(restore["restore s"])
            del trainer, model
            gc.collect()
    return record


class _Rows(torch.utils.data.Dataset[tuple[torch.Tensor]]):
    """The same random row, as often as a long fit asks (a compute-bound step needs no real data)."""

    def __init__(self, width: int) -> None:
        self.row = torch.randn(width)

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        return (self.row,)


class ThroughputModel(BenchModel):
    """:class:`BenchModel` whose step runs a batch of ``batch`` rows: the step is matmul-bound."""

    def __init__(self, width: int, layers: int, shard_layers: bool, batch: int) -> None:
        super().__init__(width, layers, shard_layers)
        self.batch = batch

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_Rows(self.width), batch_size=self.batch)


def _all_done(local: bool) -> bool:
    flag = torch.tensor([1 if local else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def throughput_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Steps per second of training while an async save is in flight, against the same run without.

    Alternates ``--cycles`` windows: ``STEADY`` steps with no save in flight, then an async save and
    the steps that run until every rank's save is published (checked after each step, in both windows
    alike). The first save (which allocates the staging buffers) is made during the warm-up.
    """
    world = dist.get_world_size()
    light = name.startswith("throughput-light-")
    strategy_name = name.removeprefix("throughput-").removeprefix("light-")
    # throughput-writer-{thread,process}-*: the bytes of the save, written by benchmarks/writers.py's
    # thread or process instead of our async save (the experiment of that module).
    mimic = None
    if strategy_name.startswith("writer-"):
        from benchmarks.writers import Staged, local_tensors, make_writer

        kind, _, strategy_name = strategy_name.removeprefix("writer-").partition("-")
        mimic, staged = make_writer(kind), Staged()
    batch = args.light_batch if light else args.batch
    ckpt = args.dir / f"{name}.ckpt"
    record: dict[str, Any] = {
        "steady steps/s": [],
        "saving steps/s": [],
        "save window s": [],
        "steps": [],
        "batch": batch,
    }
    warmup, steady = 2, args.steady

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.mode, self.count, self.start, self.cycles = "warmup", 0, 0.0, 0

        def _begin(self, mode: str, trainer: L.Trainer) -> None:
            self.mode, self.count = mode, 0
            barrier()
            self.start = time.perf_counter()
            if mode == "saving":
                self._save(trainer)

        def _save(self, trainer: L.Trainer) -> None:
            if mimic is None:
                trainer.save_checkpoint(ckpt)
            else:
                assert trainer.strategy.model is not None
                new = staged.stage(local_tensors(trainer.strategy.model, trainer.optimizers[0]))
                record["staged bytes"] = sum(b.numel() * b.element_size() for b in staged.buffers)
                mimic.start(staged, str(ckpt), new)

        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            saver = trainer.strategy._async_saver  # type: ignore[attr-defined]
            self.count += 1
            writing = mimic.writing if mimic is not None else saver is not None and saver.writing
            done = _all_done(not writing)
            if self.mode == "warmup":
                if self.count == 1:
                    self._save(trainer)  # allocates the staging buffers
                if self.count >= warmup and done:
                    trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
                    self._begin("steady", trainer)
            elif self.mode == "steady" and self.count >= steady:
                record["steady steps/s"].append(self.count / (time.perf_counter() - self.start))
                self._begin("saving", trainer)
            elif self.mode == "saving" and done:
                elapsed = time.perf_counter() - self.start
                record["saving steps/s"].append(self.count / elapsed)
                record["save window s"].append(elapsed)
                record["steps"].append(self.count)
                trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
                self.cycles += 1
                if self.cycles >= args.cycles:
                    trainer.should_stop = True
                    self.mode = "done"
                else:
                    self._begin("steady", trainer)

    model = ThroughputModel(args.width, args.layers, strategy_name.endswith("mp"), batch)
    trainer = trainer_for(make_strategy(strategy_name, world, async_save=True), [Measure()])
    trainer.fit_loop.epoch_loop.max_steps = 10_000
    trainer.fit(model)
    if mimic is not None:
        mimic.close()
    del trainer, model
    gc.collect()
    remove(ckpt)
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--raw-bytes", type=int, default=0, help="probe the disk with this many bytes")
    parser.add_argument("--full", action="store_true", help="stock-mp also writes the full file")
    parser.add_argument("--batch", type=int, default=16, help="rows per step of the throughput cases")
    parser.add_argument(
        "--light-batch", type=int, default=8, help="rows per step of the throughput-light-* cases"
    )
    parser.add_argument("--steady", type=int, default=6, help="steps per window without a save")
    parser.add_argument("--cycles", type=int, default=2, help="save windows of the throughput cases")
    parser.add_argument("--async-repeats", type=int, default=None, help="timed async saves (--repeats)")
    parser.add_argument("--verify-cycles", type=int, default=None, help="verify case's loads (--cycles)")
    args = parser.parse_args()
    args.async_repeats = args.async_repeats or args.repeats
    args.verify_cycles = args.verify_cycles or args.cycles
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    out = args.out / f"rank{rank}.json"
    for case in args.cases:
        torch.manual_seed(0)
        start = time.perf_counter()
        try:
            if case == "torch":
                results[case] = torch_case(args)
            elif case.startswith("memory-"):
                results[case] = memory_case(case, args)
            elif case == "verify-ours-mp":
                results[case] = verify_case(args)
            elif case.startswith("throughput-"):
                results[case] = throughput_case(case, args)
            elif case.startswith("savecpu-"):
                from benchmarks.writers import save_cpu_case

                results[case] = save_cpu_case(case, args)
            elif case.startswith("async-"):
                results[case] = async_case(case, args)
            else:
                results[case] = lightning_case(case, args)
        except Exception as ex:  # record it; the other cases still run
            import traceback

            results[case] = {"error": f"{ex!r}", "traceback": traceback.format_exc()[-4000:]}
        results[case]["case s"] = time.perf_counter() - start
        out.write_text(json.dumps(results, indent=1))
        print(f"rank {rank}: {case} done in {time.perf_counter() - start:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
