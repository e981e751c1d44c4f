"""Async-save scenarios, one process per rank (``tests/test_async_save.py`` starts them).

Usage: ``python scenario_async.py PHASE --dir DIR --strategy {mp,fsdp}``; results go to
``DIR/<phase>.rank<R>.pt``.

- ``main``: fits 4 steps; after step 2 saves ``sync`` (synchronous) then ``async`` (``async_save``)
  and keeps training while the background write runs; records the full values as saved. Then resumes
  from each of the two and records the restored values. Then checks errors: a background write that
  fails (``OSError(ENOSPC)`` raised by the shard writer on rank 1) over an existing checkpoint, raised
  in the training process by the next ``save_checkpoint``, and by the end of ``fit`` (teardown) when no
  save follows; the previous checkpoint must stay. Last, a registered per-rank object whose
  ``state_dict()`` fails on rank 1 only: that ``save_checkpoint`` returns on both ranks (an async save
  takes no collective in the training thread) and the next save raises the same error on both; once
  the object is mended, the save after goes through.
- ``kill``: saves version 1 synchronously at step 1, records its values, then at step 2 starts an
  async save over it with ``LIGHTNING_SHARDED_FAULT=after_write@1``: rank 1 SIGKILLs itself in the
  background thread after writing its shards. The launcher kills what is left; the test then checks
  that the checkpoint on disk is version 1, whole.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_sharded import (  # noqa: E402
    ShardedFSDPStrategy,
    ShardedModelParallelStrategy,
    register_rank_state,
)
from lightning_sharded.checkpoint import checksum as writer_module  # noqa: E402
from tests import _compare as compare  # noqa: E402
from tests.fault_injection import FAULT_ENV, install  # noqa: E402


class Model(L.LightningModule):
    def __init__(self, shard: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shard = shard
        self.layers = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))

    def configure_model(self) -> None:
        if not self.shard or self._device_mesh is None:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not isinstance(self.layers[0], FSDPModule):
            mesh = self._device_mesh["data_parallel"]
            fully_shard(self.layers[0], mesh=mesh)
            fully_shard(self.layers[2], mesh=mesh)
            fully_shard(self, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(64, 32, generator=g)), batch_size=4)


def strategy(name: str, async_save: bool) -> Any:
    if name == "mp":
        return ShardedModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, async_save=async_save
        )
    return ShardedFSDPStrategy(auto_wrap_policy={nn.Linear}, async_save=async_save)


def trainer(name: str, steps: int, callbacks: list[Any], async_save: bool = False) -> L.Trainer:
    return compare.quiet_trainer(callbacks, devices=2, strategy=strategy(name, async_save), max_steps=steps)


def full_values(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """Model and optimizer state gathered with torch's helpers (collective), as plain tensors."""
    # the optimizer's state under optim.*, as test_async_save names what it reads from a checkpoint
    values = compare.full_values(trainer.strategy.model, trainer.optimizers, optimizer_key="optim")
    values["global_step"] = torch.tensor(trainer.global_step)
    return values


class SaveAt(L.Callback):
    """Runs ``action(trainer)`` once, after the training step that brings ``global_step`` to ``step``."""

    def __init__(self, step: int, action: Any) -> None:
        self.step, self.action = step, action

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.action(trainer)


def fail_next_background_write_on(rank: int) -> None:
    """Make the next shard write on ``rank`` raise ENOSPC (after some bytes), as a full disk would."""
    original = writer_module.HashingStream.write
    state = {"armed": dist.get_rank() == rank}

    def write(self: Any, b: Any) -> int:
        if state["armed"] and len(memoryview(b)) > 1024:
            state["armed"] = False
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return original(self, b)

    writer_module.HashingStream.write = write  # type: ignore[method-assign]


def resume_values(name: str, ckpt: Path) -> dict[str, torch.Tensor]:
    t = trainer(name, 2, [])
    t.fit(Model(shard=name == "mp"), ckpt_path=ckpt)
    return full_values(t)


def main_phase(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    d = args.dir

    def save_both(t: L.Trainer) -> None:
        strategy: Any = t.strategy
        strategy.async_save = False
        t.save_checkpoint(d / "sync")
        strategy.async_save = True
        t.save_checkpoint(d / "async")
        # The optimizer state is copied after save_checkpoint returns, before the next step.
        result["deferred bytes"] = strategy._async_saver.buffers.deferred_bytes
        result["saved"] = full_values(t)  # the values both checkpoints hold; training goes on after

    t = trainer(args.strategy, 4, [SaveAt(2, save_both)])
    t.fit(Model(shard=args.strategy == "mp"))
    result["after_training"] = full_values(t)
    result["resumed_sync"] = resume_values(args.strategy, d / "sync")
    result["resumed_async"] = resume_values(args.strategy, d / "async")

    # A background write fails: raised by the next save, previous checkpoint untouched.
    def fail_then_save(t: L.Trainer) -> None:
        fail_next_background_write_on(1)
        t.save_checkpoint(d / "sync")  # over the complete checkpoint of above
        try:
            t.save_checkpoint(d / "other")
        except Exception as err:
            result["next_save_error"] = f"{type(err).__name__}: {err}"
        else:
            result["next_save_error"] = None

    t = trainer(args.strategy, 2, [SaveAt(1, fail_then_save)], async_save=True)
    t.fit(Model(shard=args.strategy == "mp"))

    # ... and by the end of fit when no save follows.
    def fail_last(t: L.Trainer) -> None:
        fail_next_background_write_on(1)
        t.save_checkpoint(d / "sync")

    t = trainer(args.strategy, 2, [SaveAt(2, fail_last)], async_save=True)
    try:
        t.fit(Model(shard=args.strategy == "mp"))
    except Exception as err:
        result["teardown_error"] = f"{type(err).__name__}: {err}"
    else:
        result["teardown_error"] = None

    # A registered object's state_dict() fails on rank 1 only: raised on both ranks by the next save.
    class Mix:
        def state_dict(self) -> dict[str, int]:
            if dist.get_rank() == 1:
                raise ValueError("not now")
            return {"level": 0}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    class Mended(Mix):
        def state_dict(self) -> dict[str, int]:
            return {"level": 1}

    def registered_fails(t: L.Trainer) -> None:
        register_rank_state(t.lightning_module, "mix", Mix())
        for where, target in (("registered_save_error", "sync"), ("registered_next_error", "other")):
            try:
                t.save_checkpoint(d / target)
            except Exception as err:
                result[where] = f"{type(err).__name__}: {err}"
            else:
                result[where] = None
        # Past the failure: with the object mended, the next save goes through on every rank.
        register_rank_state(t.lightning_module, "mix", Mended(), replace=True)
        result["other before"] = (d / "other").exists()
        t.save_checkpoint(d / "other")
        t.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]

    t = trainer(args.strategy, 2, [SaveAt(1, registered_fails)], async_save=True)
    t.fit(Model(shard=args.strategy == "mp"))
    return result


def kill_phase(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    ckpt = args.dir / "kill"

    def save_v1(t: L.Trainer) -> None:
        t.save_checkpoint(ckpt)  # async_save=True, but waited for below
        t.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
        result["v1"] = full_values(t)
        torch.save(result, args.dir / f"kill.rank{dist.get_rank()}.pt")

    def save_v2_and_die(t: L.Trainer) -> None:
        os.environ[FAULT_ENV] = "after_write@1"
        install()
        t.save_checkpoint(ckpt)

    t = trainer(args.strategy, 6, [SaveAt(1, save_v1), SaveAt(2, save_v2_and_die)], async_save=True)
    t.fit(Model(shard=args.strategy == "mp"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["main", "kill"])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--strategy", choices=["mp", "fsdp"], default="mp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = main_phase(args) if args.phase == "main" else kill_phase(args)
    except BaseException:
        traceback.print_exc()
        raise
    torch.save(result, args.dir / f"{args.phase}.rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
