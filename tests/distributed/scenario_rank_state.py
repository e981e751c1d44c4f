"""Exact resume with per-rank state, one process per rank (``tests/test_rank_state.py`` starts them).

The issue's scenario: a tiny model with dropout, a random augmentation (torch, ``random`` and NumPy
draws in the dataset), a ``torchdata`` ``StatefulDataLoader`` with its own shuffle per rank (each rank
seeds differently, no distributed sampler), and a ``DTensor`` attribute updated with random numbers
at every step, trained for 20 steps of 10-batch epochs with ``ModelCheckpoint(every_n_train_steps=7)``.

Usage: ``python scenario_rank_state.py OUT``: imports once, then forks the 2 ranks of each phase in
turn (new processes, as a launcher would start them, without paying the imports again); results go
to ``OUT/<case>.<phase>.rank<R>.pt``.

- ``unbroken`` (2 ranks): every case of :data:`CASES` trains 20 steps unbroken and saves at step 7
  (and 14); records each step's loss and the final local shards of parameters and attribute;
- ``resume`` (2 ranks, new processes, other seeds): every case resumes from its step-7 checkpoint and
  records the same; then stock Lightning's ``ModelParallelStrategy`` resumes the ``mp-sharded``
  checkpoint (``stock-mp``). Then rank 1 leaves and rank 0 goes on alone (a group of one, so no third
  launch): a plain single-device Trainer without this library resumes the ``fsdp-full`` file
  (``stock-single``); the ``mp-sharded`` directory and the ``fsdp-full`` file resume at 1 rank with
  the library's strategies, recording the warnings (``smaller-mp-sharded``, ``smaller-fsdp-full``).
"""

from __future__ import annotations

import functools
import os
import random
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
#: Seconds each phase may take before its ranks are killed.
TIMEOUT_S = 240

import lightning as L  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from lightning_sharded import (  # noqa: E402
    ShardedFSDPStrategy,
    ShardedModelParallelStrategy,
    ShardedStateMixin,
)
from tests._compare import quiet_trainer  # noqa: E402
from tests.distributed.launch import fork  # noqa: E402

#: case -> (strategy, state_dict_type, async_save)
CASES = {
    "mp-sharded": ("mp", "sharded", True),
    "fsdp-sharded": ("fsdp", "sharded", False),
    "mp-full": ("mp", "full", False),
    "fsdp-full": ("fsdp", "full", False),
}
STEPS = 20
SAVED_AT = 7
#: Global shape of the DTensor attribute (sharded by rows over every rank).
NOISE_SHAPE = (4, 2)


def checkpoint_of(out: Path, case: str) -> Path:
    return out / case / f"epoch=0-step={SAVED_AT}.ckpt"


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """20 samples of this rank's own data, each augmented with torch, ``random`` and NumPy draws."""

    def __init__(self, rank: int) -> None:
        g = torch.Generator().manual_seed(10 + rank)
        self.x = torch.randn(20, 4, generator=g)
        self.y = torch.randn(20, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(4) * 0.1 * (1.0 + random.random()) + float(np.random.normal()) * 0.01
        return self.x[i] + noise, self.y[i]


class ExactModel(ShardedStateMixin, L.LightningModule):
    """Dropout, a DTensor attribute ``noise`` changed with random numbers each step."""

    def __init__(self, shard_in_configure: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shard_in_configure = shard_in_configure
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 2))

    def configure_model(self) -> None:
        if hasattr(self, "noise"):
            return
        if not dist.is_initialized():  # a plain single-device Trainer: a buffer the full file fills
            self.register_buffer("noise", torch.zeros(NOISE_SHAPE))
            return
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.noise = distribute_tensor(torch.zeros(NOISE_SHAPE), mesh, [Shard(0)])
        if self.shard_in_configure:  # stock ModelParallelStrategy has no policy: shard here
            from torch.distributed.fsdp import fully_shard

            dp = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=dp)
            fully_shard(self.net, mesh=dp)

    def local_noise(self) -> torch.Tensor:
        noise = self.noise
        return noise.to_local() if isinstance(noise, DTensor) else noise

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        local = self.local_noise()
        loss = nn.functional.mse_loss(self.net(x), y) + local.pow(2).mean()
        with torch.no_grad():
            local.add_(torch.randn(local.shape) * 0.1)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> StatefulDataLoader:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return StatefulDataLoader(Augmented(rank), batch_size=2, shuffle=True)


class Record(L.Callback):
    """Each step's loss by global step, and the model's state at train start."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.start_step = -1
        self.start_state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"].item())


def local_values(trainer: L.Trainer) -> list[torch.Tensor]:
    """This rank's shards of every parameter, then of the ``noise`` attribute, after training."""
    model = trainer.strategy.model
    assert model is not None
    values = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    module = trainer.lightning_module
    assert isinstance(module, ExactModel)
    return [v.detach().clone() for v in [*values, module.local_noise()]]


def strategy_for(name: str, state_dict_type: str, async_save: bool = False) -> Any:
    if name == "mp":
        return ShardedModelParallelStrategy(
            fully_shard_policy={nn.Linear}, state_dict_type=state_dict_type, async_save=async_save
        )
    return ShardedFSDPStrategy(
        auto_wrap_policy={nn.Linear}, state_dict_type=state_dict_type, async_save=async_save
    )


def trainer(strategy: Any, devices: int, callbacks: list[Any]) -> L.Trainer:
    return quiet_trainer(
        callbacks,
        strategy=strategy,
        devices=devices,
        max_steps=STEPS,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def result(out: Path, case: str, phase: str, value: dict[str, Any]) -> None:
    torch.save(value, out / f"{case}.{phase}.rank{rank()}.pt")


def unbroken(out: Path, case: str) -> None:
    name, kind, async_save = CASES[case]
    L.seed_everything(100 + rank(), verbose=False)  # every rank its own shuffle, dropout, augmentation
    record = Record()
    saver = ModelCheckpoint(dirpath=out / case, every_n_train_steps=SAVED_AT, save_top_k=-1)
    t = trainer(strategy_for(name, kind, async_save), 2, [record, saver])
    t.fit(ExactModel())
    result(out, case, "unbroken", {"losses": record.losses, "values": local_values(t)})


def resume(out: Path, case: str) -> None:
    name, kind, _ = CASES[case]
    L.seed_everything(7 + rank(), verbose=False)  # other seeds: what continues must come from the file
    record = Record()
    t = trainer(strategy_for(name, kind), 2, [record])
    t.fit(ExactModel(), ckpt_path=checkpoint_of(out, case))
    result(
        out, case, "resume", {"losses": record.losses, "values": local_values(t), "start": record.start_step}
    )


def stock_mp(out: Path) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    L.seed_everything(7 + rank(), verbose=False)
    record = Record()
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    t = trainer(strategy, 2, [record])
    t.fit(ExactModel(shard_in_configure=True), ckpt_path=checkpoint_of(out, "mp-sharded"))
    result(out, "stock-mp", "resume", {"losses": record.losses, "start": record.start_step})


class Start(Record):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        model = trainer.strategy.model
        assert model is not None
        state = model.state_dict()
        self.start_state = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()
        }


def stock_single(out: Path) -> None:
    record = Start()
    t = trainer("auto", 1, [record])
    t.fit(ExactModel(), ckpt_path=checkpoint_of(out, "fsdp-full"))
    result(
        out,
        "stock-single",
        "resume",
        {"losses": record.losses, "start": record.start_step, "state": record.start_state},
    )


def smaller(out: Path, case: str) -> None:
    name, kind, _ = CASES[case]
    record = Start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer(strategy_for(name, kind), 1, [record])
        t.fit(ExactModel(), ckpt_path=checkpoint_of(out, case))
    messages = [str(w.message) for w in caught if "per-rank state" in str(w.message)]
    value = {
        "losses": record.losses,
        "start": record.start_step,
        "state": record.start_state,
        "warnings": messages,
    }
    result(out, f"smaller-{case}", "resume", value)


def run(out: Path, label: str, job: Any) -> None:
    try:
        job()
    except BaseException:  # the test reads the traceback from the result file
        result(out, label, "failed", {"failed": traceback.format_exc()})
        raise


def alone() -> None:
    """Leave the 2-rank group; rank 0 goes on as a world of one (a new group, on a new port)."""
    from lightning_sharded._launch import free_port

    dist.destroy_process_group()
    if rank() != 0:
        sys.stdout.flush()
        os._exit(0)
    os.environ.update(WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(free_port()))


def phase_of_rank(out: Path, phase: str) -> None:
    """One rank's part of ``phase`` (in a forked process, with its rank environment set)."""
    if phase == "unbroken":
        for case in CASES:
            run(out, case, lambda case=case: unbroken(out, case))
        return
    for case in CASES:
        run(out, case, lambda case=case: resume(out, case))
    run(out, "stock-mp", lambda: stock_mp(out))
    alone()
    run(out, "stock-single", lambda: stock_single(out))
    for case in ("mp-sharded", "fsdp-full"):
        run(out, f"smaller-{case}", lambda case=case: smaller(out, case))


def fork_ranks(out: Path, phase: str) -> list[int]:
    """Fork 2 ranks for ``phase`` (new processes, sharing only the imports), wait; their exit codes."""
    from lightning_sharded._launch import free_port, rank_env

    port = free_port()

    def rank(r: int) -> None:
        os.environ.update(rank_env(r, 2, port, REPO))
        torch.set_num_threads(1)
        phase_of_rank(out, phase)
        if dist.is_initialized():
            dist.destroy_process_group()

    pids = [fork(functools.partial(rank, r)) for r in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        for i, pid in enumerate(pids):
            if i not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            for i, pid in enumerate(pids):
                if i not in codes:
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    return [codes[i] for i in range(len(pids))]


def main() -> None:
    out = Path(sys.argv[1])
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    for phase in ("unbroken", "resume"):
        codes = fork_ranks(out, phase)
        if codes != [0, 0]:
            raise SystemExit(f"the {phase} ranks exited with {codes}")


if __name__ == "__main__":
    main()
