"""One rank of the TorchRec scenarios: fits that save, resumes that capture what they restored. Run by
``tests/distributed/launch.py:run_batch`` in the TorchRec environment.

    scenario_torchrec.py batch JOBS_FILE

``JOBS_FILE`` is a ``torch.save``'d list of dicts run in order in this process group; each writes its
result (or ``{"failed": traceback}``) to its ``out`` from rank 0:

- ``{"kind": "fit", "steps", "ckpt" (or None), ...model and strategy keys}``: train ``steps`` steps from
  scratch, save to ``ckpt`` if given; the result is every value gathered in full (tables, fused optimizer
  state, dense weights) and ``global_step``;
- ``{"kind": "resume", "steps", "ckpt", ...}``: ``fit(ckpt_path=ckpt)`` up to ``steps``; the result is
  ``{"restored": values at the start of training, "final": values at the end}``;
- ``{"kind": "wrap", ...}``: train 2 steps from scratch; the result says whether each table changed.

Model keys: ``plan`` (see ``torchrec_models.sharding_for``), ``kernel``, ``fused_optimizer``,
``optimizer``. Strategy keys: ``strategy`` (``"mp"``: ``ShardedModelParallelStrategy`` with the dense
part wrapped by hand; ``"mp-policy"``: with ``fully_shard_policy={nn.Linear}``; ``"fsdp"``:
``ShardedFSDPStrategy(auto_wrap_policy={nn.Linear})``; ``"ddp"``: Lightning's ``DDPStrategy``),
``state_dict_type`` (``"sharded"`` / ``"full"``), ``async_save``.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy  # noqa: E402
from tests._compare import quiet_trainer  # noqa: E402
from tests.distributed.torchrec_models import (  # noqa: E402
    TABLES,
    RecModel,
    gathered_dense,
    gathered_fused_state,
    gathered_tables,
    table_init,
)

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))


def write(out: str, value: Any) -> None:
    if RANK == 0:
        torch.save(value, out)


def values_of(model: RecModel, trainer: L.Trainer) -> dict[str, Any]:
    """Everything a resume must bring back, gathered in full (collective)."""
    values: dict[str, Any] = {f"table.{t}": v for t, v in gathered_tables(model).items()}
    if model.kernel == "fused":
        values.update({f"fused.{k}": v for k, v in gathered_fused_state(model).items()})
    values.update({f"dense.{k}": v for k, v in gathered_dense(model).items()})
    values["global_step"] = trainer.global_step
    return values


def model_for(job: dict[str, Any]) -> RecModel:
    return RecModel(
        plan=job.get("plan"),
        kernel=job.get("kernel", "fused"),
        fused_optimizer=job.get("fused_optimizer", "exact_adagrad"),
        optimizer=job.get("optimizer", "adam"),
        wrap_dense=job.get("strategy", "mp") in ("mp",),
        data_size=job.get("data_size", 16),
    )


def strategy_for(job: dict[str, Any]) -> Any:
    kind = job.get("strategy", "mp")
    sdt = job.get("state_dict_type", "sharded")
    common = {"state_dict_type": sdt, "async_save": job.get("async_save", False)}
    if kind == "mp":
        return ShardedModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1, **common)
    if kind == "mp-policy":
        return ShardedModelParallelStrategy(fully_shard_policy={nn.Linear}, **common)
    if kind == "fsdp":
        return ShardedFSDPStrategy(auto_wrap_policy={nn.Linear}, **common)
    if kind == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    raise ValueError(kind)


class Capture(L.Callback):
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.values = values_of(pl_module, trainer)


def trainer_for(job: dict[str, Any], steps: int, callbacks: list[Any]) -> L.Trainer:
    return quiet_trainer(
        callbacks, devices=WORLD, strategy=strategy_for(job), max_steps=steps, limit_val_batches=0
    )


def fit(job: dict[str, Any]) -> None:
    model = model_for(job)
    trainer = trainer_for(job, job["steps"], [])
    trainer.fit(model)
    if job.get("ckpt"):
        trainer.save_checkpoint(job["ckpt"])
        wait = getattr(trainer.strategy, "wait_for_checkpoint", None)
        if wait is not None:
            wait()
    write(job["out"], values_of(model, trainer))


def resume(job: dict[str, Any]) -> None:
    capture = Capture()
    model = model_for(job)
    trainer = trainer_for(job, job["steps"], [capture])
    trainer.fit(model, ckpt_path=job["ckpt"])
    write(job["out"], {"restored": capture.values, "final": values_of(model, trainer)})


def wrap(job: dict[str, Any]) -> None:
    model = model_for(job)
    trainer = trainer_for(job, 2, [])
    trainer.fit(model)
    tables = gathered_tables(model)
    write(job["out"], {t: not torch.equal(tables[t], table_init(t)) for t in TABLES})


def main(jobs_file: str) -> None:
    kinds = {"fit": fit, "resume": resume, "wrap": wrap}
    for job in torch.load(jobs_file, weights_only=False):
        try:
            kinds[job["kind"]](job)
        except BaseException:
            write(job["out"], {"failed": traceback.format_exc()})
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    assert sys.argv[1] == "batch"
    main(sys.argv[2])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
