"""One rank of a TorchRec fit/resume whose tables are trained by the Lightning optimizer (dense kernel).

Run by ``tests/distributed/launch.py:run_batch`` (``batch JOBS_FILE``: each job a list of arguments):

    fit    --ckpt PATH --out FILE --plan SPEC --optimizer adam|adagrad|keyed [--steps N] [--unwrapped]
    resume --ckpt PATH --out FILE --plan SPEC --optimizer ... [--steps N]

``SPEC`` is ``t0=row,t1=table:0,t2=table:1`` (see ``torchrec_models.sharding_for``). ``keyed`` is Adam
through TorchRec's ``KeyedOptimizerWrapper``. The dense MLP is ``fully_shard``-ed (FSDP2). ``fit`` trains,
saves and writes the gathered values (:func:`values`); ``resume`` writes them right after the restore
(``restored``) and at the end (``final``). ``--unwrapped`` saves as the library did before the tables'
optimizer state was laid out like the tables. A job that raises writes ``{"error", "message"}``.
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

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy  # noqa: E402
from tests.distributed.torchrec_models import (  # noqa: E402
    ROWS,
    TABLES,
    RecModel,
    gathered_dense,
    gathered_tables,
)

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))


class StateModel(RecModel):
    """``RecModel`` (dense kernel, MLP under FSDP2, or under FSDP1 by the strategy); its optimizer may be
    ``KeyedOptimizerWrapper``."""

    def __init__(self, plan: dict[str, str], optimizer: str, wrap_dense: bool = True) -> None:
        self.keyed = optimizer in ("keyed", "combined")
        self.combined = optimizer == "combined"
        super().__init__(
            plan=plan, optimizer="adam" if self.keyed else optimizer, wrap_dense=wrap_dense, data_size=16
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if not self.keyed:
            return super().configure_optimizers()
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

        if self.combined:  # TorchRec's usual pairing: one optimizer for the tables, one for the dense part
            named = dict(self.named_parameters())
            sparse = {n: p for n, p in named.items() if n.startswith("sparse.")}
            dense = {n: p for n, p in named.items() if not n.startswith("sparse.")}
            return CombinedOptimizer(
                [
                    ("sparse", KeyedOptimizerWrapper(sparse, lambda ps: torch.optim.Adam(ps, lr=self.lr))),
                    ("dense", KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adam(ps, lr=self.lr))),
                ]
            )
        return KeyedOptimizerWrapper(
            dict(self.named_parameters()), lambda params: torch.optim.Adam(params, lr=self.lr)
        )


def _table_state(model: StateModel, optimizer: torch.optim.Optimizer, table: str) -> dict[str, torch.Tensor]:
    """Table ``table``'s optimizer state in full (collective): each rank's state placed where the
    table's local shards are in its parameter."""
    param = model.sparse.embedding_bags[table].weight
    layout = model.sparse.state_dict()[f"embedding_bags.{table}.weight"]
    state = optimizer.state.get(param, {})
    out: dict[str, torch.Tensor] = {}
    entries = ("sum",) if model.optimizer_name == "adagrad" else ("exp_avg", "exp_avg_sq")
    for entry in entries:
        full = torch.zeros(ROWS, layout.size(1))
        value = state.get(entry)
        if value is not None:
            for shard in layout.local_shards():
                rel = shard.tensor.storage_offset() - param.storage_offset()
                view = value.as_strided(
                    shard.tensor.shape, shard.tensor.stride(), value.storage_offset() + rel
                )
                rows, cols = shard.metadata.shard_offsets
                n, m = shard.metadata.shard_sizes
                full[rows : rows + n, cols : cols + m] = view
        dist.all_reduce(full)
        out[entry] = full
    step = torch.tensor([float(state["step"]) if "step" in state else -1.0])
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    out["step"] = step
    return out


def values(model: StateModel, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Tables, dense weights and every optimizer state tensor, in full (collective)."""
    from torch.distributed.tensor import DTensor

    out = {f"table.{t}": v for t, v in gathered_tables(model).items()}
    out.update({f"dense.{n}": v for n, v in gathered_dense(model).items()})
    for table in TABLES:
        for entry, value in _table_state(model, optimizer, table).items():
            out[f"opt.{table}.{entry}"] = value
    for name, param in sorted(model.dense.named_parameters()):
        for entry, value in sorted(optimizer.state.get(param, {}).items()):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"opt.dense.{name}.{entry}"] = torch.as_tensor(full).detach().clone()
    return out


class Capture(L.Callback):
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.values = values(pl_module, trainer.optimizers[0])


def run_job(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["fit", "resume"])
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--unwrapped", action="store_true")
    parser.add_argument("--strategy", choices=["model-parallel", "fsdp"], default="model-parallel")
    parser.add_argument("--state-dict-type", choices=["sharded", "full"], default="sharded")
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args(argv)
    plan = dict(item.split("=") for item in args.plan.split(","))
    fsdp = args.strategy == "fsdp"
    model = StateModel(plan, args.optimizer, wrap_dense=not fsdp)
    common: dict[str, Any] = {"state_dict_type": args.state_dict_type, "async_save": args.async_save}
    capture = Capture()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=ShardedFSDPStrategy(**common)
        if fsdp
        else ShardedModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1, **common),
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[capture],
    )
    if args.phase == "fit":
        from lightning_sharded.checkpoint import state_dicts

        original = state_dicts.optimizer_pieces
        if args.unwrapped:  # for this job only
            state_dicts.optimizer_pieces = lambda *a, **k: ({}, [])  # type: ignore[assignment]
        try:
            trainer.fit(model)
            trainer.save_checkpoint(args.ckpt)
        finally:
            state_dicts.optimizer_pieces = original  # type: ignore[assignment]
        return values(model, trainer.optimizers[0])
    trainer.fit(model, ckpt_path=args.ckpt)
    return {"restored": capture.values, "final": values(model, trainer.optimizers[0])}


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
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
