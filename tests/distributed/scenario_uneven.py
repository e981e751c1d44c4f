"""One rank of a fit, save and resume of ``UnevenModel`` (local parameter shapes differ per rank).

Run by ``tests/distributed/launch.py:run_batch`` (``batch JOBS_FILE``: each job a list of arguments):

    fit    --strategy mp|fsdp --ckpt PATH --out FILE [--steps N] [--state-dict-type T] [--ragged]
           [--unwrapped]
    resume --strategy mp|fsdp --ckpt PATH --out FILE [--steps N] [--ragged]

``fit`` trains ``--steps`` steps, saves to PATH and writes the gathered values (``uneven_models.gathered``).
``resume`` fits from PATH for one more step than the save and writes the values right after the restore
(``restored``) and at the end (``final``). ``--unwrapped`` saves as the library did before the optimizer
state of per-rank pieces was laid out like their tables (each piece's state a plain per-rank tensor) and
before a tensor whose shape differs per rank was refused at the save. A
job that raises writes ``{"error": type, "message": ...}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
import faulthandler  # noqa: E402

if os.environ.get("UNEVEN_DUMP"):
    faulthandler.dump_traceback_later(int(os.environ["UNEVEN_DUMP"]), exit=True)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy  # noqa: E402
from tests._compare import quiet_trainer  # noqa: E402
from tests.distributed.uneven_models import UnevenModel, gathered  # noqa: E402

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))


class Capture(L.Callback):
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.values = gathered(pl_module, trainer.optimizers[0])


def make_trainer(args: argparse.Namespace, model: UnevenModel, steps: int, callbacks: list[Any]) -> L.Trainer:
    if args.strategy == "mp":
        strategy: Any = ShardedModelParallelStrategy(
            data_parallel_size=WORLD, tensor_parallel_size=1, state_dict_type=args.state_dict_type
        )
    else:
        model.configure_model()  # the pieces exist before FSDP wraps the model: FSDP1 leaves them alone
        strategy = ShardedFSDPStrategy(
            auto_wrap_policy={nn.Linear}, state_dict_type=args.state_dict_type, ignored_modules=[model.pieces]
        )
    return quiet_trainer(callbacks, devices=WORLD, strategy=strategy, max_steps=steps)


def run_job(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["fit", "resume"])
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--state-dict-type", default="sharded")
    parser.add_argument("--ragged", action="store_true")
    parser.add_argument("--unwrapped", action="store_true")
    args = parser.parse_args(argv)
    model = UnevenModel(ragged=args.ragged)
    if args.phase == "fit":
        from lightning_sharded.checkpoint import save, state_dicts

        originals = state_dicts.optimizer_pieces, save.check_same_shapes
        if args.unwrapped:  # for this job only: the next job of the batch saves as the library does
            state_dicts.optimizer_pieces = lambda *a, **k: ({}, [])  # type: ignore[assignment]
            save.check_same_shapes = lambda plans: None  # type: ignore[assignment]
        try:
            trainer = make_trainer(args, model, args.steps, [])
            trainer.fit(model)
            trainer.save_checkpoint(args.ckpt)
        finally:
            state_dicts.optimizer_pieces, save.check_same_shapes = originals
        return gathered(model, trainer.optimizers[0])
    capture = Capture()
    trainer = make_trainer(args, model, args.steps, [capture])
    trainer.fit(model, ckpt_path=args.ckpt)
    final = gathered(model, trainer.optimizers[0])
    return {"restored": capture.values, "final": final, "global_step": trainer.global_step}


def main(argv: list[str]) -> None:
    for job in torch.load(argv[1], weights_only=False):
        out = Path(job[job.index("--out") + 1])
        try:
            result = run_job(job)
        except BaseException as ex:
            result = {"error": type(ex).__name__, "message": str(ex), "traceback": traceback.format_exc()}
            print(f"rank {RANK}: {result['traceback']}", file=sys.stderr, flush=True)
        if RANK == 0:
            torch.save(result, out)
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
