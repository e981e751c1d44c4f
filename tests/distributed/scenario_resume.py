"""One rank of a fit-and-save or a resume, with the full values written for the test to compare.

Run by ``tests/distributed/launch.py:run_ranks`` (RANK, WORLD_SIZE... set, so Lightning does not relaunch).

    scenario_resume.py fit    --strategy S --ckpt PATH --out FILE [--steps N] [--state-dict-type T] ...
    scenario_resume.py resume --strategy S --ckpt PATH --out FILE [--non-strict] ...
    scenario_resume.py validate|test|predict --strategy S --ckpt PATH --out FILE
    scenario_resume.py error  --strategy S --ckpt PATH --out FILE [--model two-optimizers] ...

``fit`` trains, saves to PATH and writes the full values after the save. ``resume`` fits from PATH and
writes the full values as they are right after the restore (at ``on_train_start``), with the restored
global step. ``error`` expects the resume to raise and writes the exception's type and message.
Strategies: ``fsdp``, ``mp`` (this library's), ``stock-fsdp``, ``stock-mp`` (Lightning's, FSDP1 with
only the CPU device-id workaround), ``single`` (a plain single-device Trainer, world size 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*sync_dist.*")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy  # noqa: E402
from lightning_sharded.hooks import register_sharded_state_hooks  # noqa: E402
from tests import _compare as compare  # noqa: E402
from tests import walks  # noqa: E402
from tests.distributed.models import ShardedModel, TwoOptimizerModel  # noqa: E402
from tests.fault_injection import install  # noqa: E402

install()  # a test may set LIGHTNING_SHARDED_FAULT
walks.install()  # the strategy tests' session records which modules reach the backend

# Read once: Lightning's environment deletes WORLD_SIZE from os.environ when a Trainer tears down.
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))


class StockCpuFSDP(FSDPStrategy):
    """Stock FSDPStrategy, saving and loading unchanged; only the model wrapping gets a CPU device id."""

    _fsdp_device_id = ShardedFSDPStrategy._fsdp_device_id
    _setup_model = ShardedFSDPStrategy._setup_model
    _wrap_options = ShardedFSDPStrategy._wrap_options


def make_strategy(args: argparse.Namespace, world: int) -> Any:
    wrap = {nn.Linear}
    ours = {"state_dict_type": args.state_dict_type, "async_save": args.async_save, "verify": args.verify}
    if args.strategy == "fsdp":
        return ShardedFSDPStrategy(auto_wrap_policy=wrap, **ours)
    if args.strategy == "mp":
        if args.policy:
            return ShardedModelParallelStrategy(fully_shard_policy=wrap, **ours)
        return ShardedModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, **ours)
    if args.strategy == "stock-fsdp":
        return StockCpuFSDP(auto_wrap_policy=wrap, state_dict_type=args.state_dict_type)
    if args.strategy == "stock-mp":
        return ModelParallelStrategy(
            data_parallel_size=world,
            tensor_parallel_size=1,
            save_distributed_checkpoint=args.state_dict_type == "sharded",
        )
    if args.strategy == "single":
        return "auto"
    raise SystemExit(f"unknown strategy {args.strategy}")


def make_model(args: argparse.Namespace) -> ShardedModel:
    kwargs = {
        "sharded_tensor": args.sharded_tensor,
        "table": not args.no_table,
        "shard_layers": args.strategy in ("mp", "stock-mp") and not args.policy,
        "hidden": args.hidden,
        "extra": args.extra,
    }
    model = TwoOptimizerModel(**kwargs) if args.model == "two-optimizers" else ShardedModel(**kwargs)
    if args.strategy.startswith("stock"):
        register_sharded_state_hooks(model)  # what ShardedStateMixin does; stock strategies don't
    if args.non_strict:
        model.strict_loading = False
    return model


def full_values(trainer: L.Trainer, model: ShardedModel) -> dict[str, Any]:
    """Gather weights, sharded attributes and optimizer state with torch's own helpers (collective)."""
    values: dict[str, Any] = {"global_step": trainer.global_step}
    if not dist.is_initialized():
        for key, value in model.state_dict().items():
            values[f"model.{key}"] = value.detach().clone()
        for index, opt in enumerate(trainer.optimizers):
            names = [n for n, _ in model.named_parameters()]
            for pid, state in opt.state_dict()["state"].items():
                for entry, value in state.items():
                    values[f"opt{index}.{names[pid]}.{entry}"] = torch.as_tensor(value).clone()
        return values
    from torch.distributed.tensor import DTensor

    from lightning_sharded.tensors import to_full

    values["info.layers_are_dtensors"] = isinstance(model.layer1.weight, DTensor)
    skip = lambda key: not key.startswith("layer")  # noqa: E731
    values.update(compare.full_values(trainer.strategy.model, trainer.optimizers, skip, lr=True))
    if model.table is not None:
        table = model.table.full_tensor() if hasattr(model.table, "full_tensor") else model.table
        values["model.table"] = table.clone()
    if model.cache is not None:
        values["model.cache"] = to_full(model.cache).clone()
    return values


class Capture(L.Callback):
    """Gathers the values right after the restore (before any step); writes them to ``out`` if given."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        self.values: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.values = full_values(trainer, pl_module)
        if self.out is not None:
            write(self.out, self.values)


class SaveAfterFirstStep(L.Callback):
    """Saves to the checkpoint path once early, so the final save replaces an existing checkpoint."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            trainer.save_checkpoint(self.path)


def write(out: Path, values: dict[str, Any]) -> None:
    if RANK == 0:
        torch.save(values, out)


def run_case(case: dict[str, Any], args: argparse.Namespace, common: dict[str, Any]) -> dict[str, Any]:
    """One expected-error (or non-strict) case of the ``errors`` phase; returns what happened."""
    case_args = argparse.Namespace(**{**vars(args), **case.get("args", {})})
    model = make_model(case_args)
    common = {**common, "strategy": make_strategy(case_args, WORLD)}
    capture = Capture(None)
    trainer = L.Trainer(max_steps=args.steps + 1, limit_val_batches=0, callbacks=[capture], **common)
    try:
        trainer.fit(model, ckpt_path=case["ckpt"])
    except BaseException as ex:  # record exactly what escaped, BaseException included
        return {
            "type": type(ex).__name__,
            "mro": [c.__name__ for c in type(ex).__mro__],
            "message": str(ex),
            "traceback": traceback.format_exc(),
        }
    return {"type": None, "values": capture.values}


def location(text: str) -> Any:
    """A checkpoint path argument: an fsspec URL stays a string (``Path`` would mangle ``s3://``)."""
    return text if "://" in text else Path(text)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["fit", "resume", "evaluate", "errors"])
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--ckpt", type=location)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--state-dict-type", default="sharded")
    parser.add_argument("--sharded-tensor", action="store_true")
    parser.add_argument("--no-table", action="store_true")
    parser.add_argument("--policy", action="store_true")
    parser.add_argument("--non-strict", action="store_true")
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--extra", action="store_true", help="a buffer no checkpoint has")
    parser.add_argument("--model", default="plain")
    parser.add_argument(
        "--top-k", type=location, help="fit with ModelCheckpoint(save_top_k=2) into this folder"
    )
    parser.add_argument("--cases", type=Path, help="errors phase: a torch.save'd list of case dicts")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--overwrite", action="store_true", help="also save to --ckpt after the first step")
    parser.add_argument(
        "--async-save", action="store_true", help="this library's strategies: async_save=True"
    )
    parser.add_argument(
        "--verify", default=False, choices=["before", "during"], help="this library's strategies: verify="
    )
    return parser


def run_job(argv: list[str]) -> None:
    """One fit, resume, evaluate or errors job, as its own Trainer(s) in this process group."""
    args = make_parser().parse_args(argv)
    world = WORLD

    common: dict[str, Any] = {
        "accelerator": args.accelerator,
        "devices": world,
        "strategy": make_strategy(args, world),
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
    }
    if args.phase == "fit":
        model = make_model(args)
        callbacks = []
        if args.top_k is not None:
            from lightning.pytorch.callbacks import ModelCheckpoint

            common["enable_checkpointing"] = True
            callbacks.append(
                ModelCheckpoint(
                    dirpath=args.top_k, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max"
                )
            )
        if args.overwrite:
            callbacks.append(SaveAfterFirstStep(args.ckpt))
        trainer = L.Trainer(max_steps=args.steps, limit_val_batches=0, callbacks=callbacks, **common)
        trainer.fit(model)
        trainer.save_checkpoint(args.ckpt)
        if args.async_save:
            trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
        write(args.out, full_values(trainer, model))
    elif args.phase == "resume":
        model = make_model(args)
        trainer = L.Trainer(
            max_steps=args.steps + 1, limit_val_batches=0, callbacks=[Capture(args.out)], **common
        )
        trainer.fit(model, ckpt_path=args.ckpt)
    elif args.phase == "evaluate":
        results: dict[str, Any] = {}
        for fn in ("validate", "test", "predict"):
            model = make_model(args)
            common["strategy"] = make_strategy(args, world)
            trainer = L.Trainer(limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2, **common)
            output = getattr(trainer, fn)(model, ckpt_path=args.ckpt)
            results[fn] = {"values": full_values(trainer, model), "output": output}
        write(args.out, results)
    else:  # errors
        cases = torch.load(args.cases, weights_only=False)
        write(args.out, {case["name"]: run_case(case, args, common) for case in cases})


def main(argv: list[str]) -> None:
    """``batch JOBS_FILE`` runs every job of a torch.save'd list of argv lists; else one job.

    In a batch, a job that raises writes ``{"failed": traceback}`` to its ``--out`` and the next job runs.
    """
    if argv[:1] != ["batch"]:
        run_job(argv)
        return
    for job in torch.load(argv[1], weights_only=False):
        try:
            run_job(job)
        except BaseException:
            out = Path(job[job.index("--out") + 1])
            write(out, {"failed": traceback.format_exc()})
            if dist.is_initialized():
                dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
