"""One rank of the partial-load scenarios: warm starts, parts left out of a resume, trainable-only
checkpoints of a LoRA model, and full checkpoints of a compiled model.

Run by ``tests/strategies/test_partial.py`` through ``harness.run_batch`` (every job of a world size in
one launch)::

    scenario_partial.py batch JOBS_FILE

Each job is a dict: ``kind`` (``fit``, ``resume``, ``warm`` or ``error``), ``out`` (the result file,
written by rank 0), ``strategy`` (``fsdp`` or ``mp``), ``sdt`` (``sharded`` or ``full``), ``ckpt``, and
the strategy's options (``options``) and the model's (``model``). ``fit`` trains 3 steps, saves to
``ckpt`` and writes the gathered values; ``resume`` and ``warm`` write them at ``on_train_start``, right
after the restore (or the warm start); ``error`` writes the exception a fit raises.

The model: a frozen base (two ``Linear``, loaded from a Hugging Face directory at ``on_fit_start``), a
LoRA adapter (two low-rank ``Linear``) and a head that train, a ``DTensor`` table updated by hand, Adam
with a ``StepLR`` (the learning rate halves each step), and a stateful callback (``Counter``).
"""

from __future__ import annotations

import shutil
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
from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy, load_pretrained  # noqa: E402
from tests._compare import quiet_trainer  # noqa: E402

DIM, RANK_R, ROWS = 8, 2, 6


class LoraModel(L.LightningModule):
    """A frozen base, a LoRA adapter and a head; a DTensor ``table`` (a plain buffer without a group)."""

    def __init__(self, base_dir: str = "", seed: int = 0, compile: bool = False, strict: bool = True) -> None:
        super().__init__()
        self.base_dir = base_dir  # loaded at on_fit_start when given (the run that starts from it)
        self.compile = compile
        self.strict_loading = strict
        torch.manual_seed(seed)
        self.base = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(DIM, RANK_R, bias=False)
        self.lora_b = nn.Linear(RANK_R, DIM, bias=False)
        self.head = nn.Linear(DIM, 4)
        self.table: Any = None

    def configure_model(self) -> None:
        if self._trainer is None or not dist.is_initialized():  # one plain process (the tests')
            if self.table is None:
                del self.table
                self.register_buffer("table", torch.zeros(ROWS, 2))
            return
        if self.table is None:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            self.table = distribute_tensor(torch.zeros(ROWS, 2), mesh, [Shard(0)], src_data_rank=None)
        if self.compile and not hasattr(self.head, "_orig_mod"):
            self.head = torch.compile(self.head, backend="eager")

    def on_fit_start(self) -> None:
        if self.base_dir:
            load_pretrained(self, self.base_dir, prefix="base.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x) + self.lora_b(self.lora_a(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            self.table.to_local().add_(1.0)
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(32, DIM, generator=torch.Generator().manual_seed(1))), 4)


class Counter(L.Callback):
    """A callback with state: the number of training batches it saw."""

    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


def values(trainer: L.Trainer, model: LoraModel, counter: Counter) -> dict[str, Any]:
    """Everything a resume restores, gathered (collective): model, table, Adam, LR, step, callback."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    root = trainer.strategy.model
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    out: dict[str, Any] = {
        f"model.{k}": v.clone()
        for k, v in get_model_state_dict(root, options=options).items()
        if k != "table"
    }
    out["model.table"] = model.table.full_tensor().clone()
    optimizer = trainer.optimizers[0]
    out["opt_states"] = len(optimizer.state)  # before torch's helper below creates any (for its template)
    for name, entries in get_optimizer_state_dict(root, optimizer, options=options).get("state", {}).items():
        for entry, value in entries.items():
            out[f"opt.{name}.{entry}"] = torch.as_tensor(value).clone()
    out["lr"] = optimizer.param_groups[0]["lr"]
    out["global_step"] = trainer.global_step
    out["counter"] = counter.count
    return out


class Capture(L.Callback):
    def __init__(self, job: dict[str, Any], counter: Counter) -> None:
        self.job = job
        self.counter = counter

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        write(self.job, values(trainer, pl_module, self.counter))


def write(job: dict[str, Any], result: Any) -> None:
    if dist.get_rank() == 0:
        torch.save(result, job["out"])


def make_trainer(job: dict[str, Any], steps: int, callbacks: list[L.Callback]) -> L.Trainer:
    options = {"state_dict_type": job["sdt"], **job.get("options", {})}
    if job["strategy"] == "fsdp":
        # A compiled submodule must not hold FSDP1 units of its own (dynamo would trace FSDP1's hooks):
        # the compiled head's parameters then live in the root unit, unsharded during forward.
        wrap = {nn.Sequential} if job.get("model", {}).get("compile") else {nn.Linear}
        strategy: Any = ShardedFSDPStrategy(auto_wrap_policy=wrap, **options)
    else:
        strategy = ShardedModelParallelStrategy(fully_shard_policy={nn.Linear}, **options)
    return quiet_trainer(callbacks, devices=dist.get_world_size(), strategy=strategy, max_steps=steps)


def run_job(job: dict[str, Any]) -> None:
    model = LoraModel(**job.get("model", {}))
    counter = Counter()
    if job["kind"] == "fit":
        trainer = make_trainer(job, 3, [counter])
        trainer.fit(model)
        trainer.save_checkpoint(job["ckpt"])
        write(job, values(trainer, model, counter))
        return
    if job["kind"] == "remove":
        if dist.get_rank() == 0:
            shutil.rmtree(job["path"])
        write(job, {"removed": job["path"]})
        return
    if job["kind"] == "error":
        trainer = make_trainer(job, 4, [counter])
        try:
            trainer.fit(model, ckpt_path=job.get("ckpt"))
            if job.get("save"):
                trainer.save_checkpoint(Path(job["out"]).with_suffix(".ckpt"))
        except BaseException as err:  # record exactly what escaped
            write(job, {"type": type(err).__name__, "message": str(err)})
            return
        write(job, {"type": None})
        return
    trainer = make_trainer(job, 4, [counter, Capture(job, counter)])
    trainer.fit(model, ckpt_path=job["ckpt"] if job["kind"] == "resume" else None)


def main(argv: list[str]) -> None:
    for job in torch.load(argv[1], weights_only=False):
        try:
            run_job(job)
        except BaseException:
            write(job, {"failed": traceback.format_exc()})
        dist.barrier()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(sys.argv[1:])
    dist.barrier()
    dist.destroy_process_group()
