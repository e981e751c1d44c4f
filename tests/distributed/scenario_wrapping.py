"""One rank of the wrapping matrix: fits that save, resumes that capture what they restored, and the
agreement cases of the load hooks. Run by ``tests/distributed/launch.py:run_ranks``.

    scenario_wrapping.py batch JOBS_FILE

``JOBS_FILE`` is a ``torch.save``'d list of ``{"kind": "fit" | "resume" | "agree" | "llama-...", "out": FILE,
...}`` dicts run in order in this process group; each writes its result (or ``{"failed": traceback}``)
to its ``out`` from rank 0. Values are gathered full, by name: parameters and optimizer state through
torch's own helpers (clean FQNs), sharded attributes straight from the modules that hold them.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_sharded.tensors import to_full  # noqa: E402
from tests._compare import quiet_trainer  # noqa: E402
from tests.distributed.wrap_models import WrapModel, full_state_values, strategy_for  # noqa: E402

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))


def write(out: str, value: Any) -> None:
    if RANK == 0:
        torch.save(value, out)


def full_values(trainer: L.Trainer, model: Any) -> dict[str, Any]:
    values = full_state_values(
        trainer, lambda key: key.endswith((".table", ".cache")) or key in ("table", "cache")
    )
    for place, holder in model.holders().items():
        for name in ("table", "cache"):
            values[f"attr.{place}.{name}"] = to_full(getattr(holder, name)).clone()
    return values


def trainer_for(wrapping: str, steps: int, callbacks: list[Any]) -> L.Trainer:
    return quiet_trainer(
        callbacks, devices=WORLD, strategy=strategy_for(wrapping, WORLD), max_steps=steps, limit_val_batches=0
    )


class Capture(L.Callback):
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.values = full_values(trainer, pl_module)


def fit(job: dict[str, Any]) -> None:
    model = WrapModel(job["wrapping"])
    trainer = trainer_for(job["wrapping"], 2, [])
    trainer.fit(model)
    trainer.save_checkpoint(job["ckpt"])
    write(job["out"], full_values(trainer, model))


def resume(job: dict[str, Any]) -> None:
    capture = Capture()
    model = WrapModel(job["wrapping"])
    trainer = trainer_for(job["wrapping"], 3, [capture])
    trainer.fit(model, ckpt_path=job["ckpt"])
    write(job["out"], capture.values)


def main(jobs_file: str) -> None:
    from tests.distributed import scenario_agree, scenario_llama

    kinds = {"fit": fit, "resume": resume, **scenario_agree.JOBS, **scenario_llama.JOBS}
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
