"""``lightning-sharded demo``: train sharded on CPU, save, resume in 1 and in N processes, compare.

A small LightningModule with FSDP-sharded linear layers and a ``DTensor`` embedding table (a sharded
attribute, not a parameter); each run gathers the full weights, table and Adam state with torch's own
helpers, and the demo exits non-zero if any restored value differs from the saved one
(``docs/strategies.md``). It starts its rank processes itself, with the environment ``torchrun`` would
give them, so it works from a console script without Lightning relaunching ``sys.argv``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sharded._launch import free_port, rank_env, run_ranks

__all__ = ["compare", "main"]

STEPS = 4
VOCAB, DIM, HIDDEN = 16, 8, 32
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
_STRATEGY_NAMES = {"fsdp": "ShardedFSDPStrategy", "model-parallel": "ShardedModelParallelStrategy"}
#: The output folder, in the current directory, unless ``--output`` says otherwise.
DEFAULT_OUTPUT = "lightning-sharded-demo"
#: A file the demo leaves in its output folder: a folder with it is the demo's own, and is reused.
MARKER = ".lightning-sharded-demo"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-sharded demo",
        description="Train a sharded model on CPU, save a checkpoint, resume it in 1 and in N processes,"
        " and check that weights, the DTensor table and the optimizer state come back exactly.",
    )
    parser.add_argument("--processes", type=int, default=2, help="processes to train with (default: 2)")
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(DEFAULT_OUTPUT),
        help=f"folder for the checkpoint and the compared values (default: ./{DEFAULT_OUTPUT}); a folder the"
        " demo did not create must be empty",
    )
    parser.add_argument(
        "--state-dict-type",
        choices=["sharded", "full"],
        default="sharded",
        help="sharded: a directory of shards written by every process (default); full: one file",
    )
    parser.add_argument(
        "--strategy",
        choices=sorted(_STRATEGY_NAMES),
        default="fsdp",
        help="fsdp: ShardedFSDPStrategy (FSDP1, default); model-parallel: ShardedModelParallelStrategy"
        " (FSDP2, DTensor parameters)",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds each phase may take (default: 600)"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into an --output folder the demo did not create (its checkpoint/, saved.pt and"
        " restored-N.pt are replaced; nothing else is touched)",
    )
    parser.add_argument("--rank-job", choices=["train", "resume"], help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit code (0: every restored value equals the saved one)."""
    args = _parser().parse_args(argv)
    if args.rank_job is not None:
        _rank_job(args)
        # The rank's results are written and its process group destroyed. Under load, a C++
        # destructor of torch 2.13 sometimes aborts at interpreter exit ("terminate called without
        # an active exception", SIGABRT) after all the work succeeded; a rank process skips that
        # teardown, the parent reads the results.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.processes < 1:
        print("--processes must be at least 1", file=sys.stderr)
        return 2
    output: Path = args.output.resolve()
    foreign = output.is_dir() and any(output.iterdir()) and not (output / MARKER).exists()
    if (output.exists() and not output.is_dir()) or (foreign and not args.force):
        what = "a file" if not output.is_dir() else "a folder the demo did not create, and not empty"
        print(
            f"lightning-sharded demo: {str(output)!r} is {what}: the demo writes only into its own folder."
            " Choose another with --output" + (", or pass --force to write into it." if foreign else "."),
            file=sys.stderr,
        )
        return 2
    output.mkdir(parents=True, exist_ok=True)
    (output / MARKER).write_text(
        "written by `lightning-sharded demo`; the demo replaces what is in this folder\n"
    )
    checkpoint = output / ("checkpoint" if args.state_dict_type == "sharded" else "checkpoint.ckpt")
    print(
        f"lightning-sharded demo: {_STRATEGY_NAMES[args.strategy]}, {args.state_dict_type} checkpoint, CPU"
        f" (gloo), output in {output}"
    )
    start = time.perf_counter()
    if not _launch(args, "train", args.processes, output):
        return 1
    print(
        f"  trained {STEPS} steps in {args.processes} process(es) and saved {_describe(checkpoint)}"
        f" ({time.perf_counter() - start:.1f} s)"
    )
    import torch

    saved = torch.load(output / "saved.pt", weights_only=False)
    failed = False
    for world in sorted({1, args.processes}):
        start = time.perf_counter()
        if not _launch(args, "resume", world, output):
            return 1
        restored = torch.load(output / f"restored-{world}.pt", weights_only=False)
        report = compare(saved, restored)
        failed |= not report.ok
        print(f"  resumed in {world} process(es) ({time.perf_counter() - start:.1f} s): {report}")
    if failed:
        print("FAILED: some restored values differ from the saved ones (see above).", file=sys.stderr)
        return 1
    print("OK: the restored weights, table and optimizer state equal the saved ones.")
    return 0


@dataclass
class Report:
    """How the values gathered after a resume compare with those gathered after the save."""

    weights: tuple[int, int]
    table: bool
    optimizer: tuple[int, int]
    step: tuple[int, int]
    differ: list[str]

    @property
    def ok(self) -> bool:
        return not self.differ and self.table and self.step[0] == self.step[1]

    def __str__(self) -> str:
        text = (
            f"weights {self.weights[0]}/{self.weights[1]} equal,"
            f" table {'equal' if self.table else 'DIFFERS'},"
            f" optimizer state {self.optimizer[0]}/{self.optimizer[1]} equal,"
            f" global step {self.step[1]} (saved {self.step[0]})"
        )
        return text if self.ok else f"{text}; MISMATCH: {', '.join(self.differ) or 'global step'}"


def compare(saved: dict[str, Any], restored: dict[str, Any]) -> Report:
    """Compare the full values of two runs exactly; every key of ``saved`` must be in ``restored``."""
    import torch

    def equal(key: str) -> bool:
        return key in restored and torch.equal(torch.as_tensor(saved[key]), torch.as_tensor(restored[key]))

    weights = sorted(k for k in saved if k.startswith("weight."))
    optimizer = sorted(k for k in saved if k.startswith("optimizer."))
    differ = [k for k in [*weights, "table", *optimizer] if not equal(k)]
    return Report(
        weights=(sum(map(equal, weights)), len(weights)),
        table=equal("table"),
        optimizer=(sum(map(equal, optimizer)), len(optimizer)),
        step=(int(saved["global_step"]), int(restored.get("global_step", -1))),
        differ=differ,
    )


def _describe(path: Path) -> str:
    """The checkpoint's files and bytes, counted as ``inspect`` and ``verify`` count them."""
    from lightning_sharded.checkpoint.detect import checkpoint_files, detect
    from lightning_sharded.checkpoint.progress import format_files

    files = format_files(checkpoint_files(detect(path)))
    return f"{path.name}/ ({files})" if path.is_dir() else f"{path.name} ({files})"


def _launch(args: argparse.Namespace, job: str, world: int, output: Path, retry: bool = True) -> bool:
    """Start ``world`` rank processes of ``job`` and wait; on failure print their output, return False.

    A free port can be taken by another program between choosing and binding it; then the job runs
    once more on another port.
    """
    port = free_port()
    command = [sys.executable, "-m", "lightning_sharded.demo", "--rank-job", job, "--output", str(output)]
    command += ["--state-dict-type", args.state_dict_type, "--strategy", args.strategy]
    envs = [rank_env(rank, world, port, _PACKAGE_ROOT) for rank in range(world)]
    outcome = run_ranks(command, envs, timeout=args.timeout)
    if outcome.ok:
        return True
    if (
        retry
        and not outcome.timed_out
        and any("address already in use" in out.lower() for out in outcome.outputs)
    ):
        return _launch(args, job, world, output, retry=False)
    reason = (
        f"timed out after {args.timeout:.0f} s"
        if outcome.timed_out
        else f"rank {outcome.first_failed} failed (the others were stopped)"
    )
    print(f"FAILED: the {job} phase in {world} process(es) {reason}.", file=sys.stderr)
    for rank, out in enumerate(outcome.outputs):
        print(f"----- rank {rank} (exit {outcome.returncodes[rank]}) -----\n{out[-4000:]}", file=sys.stderr)
    return False


# ------------------------------------------------------------------------------------ inside a rank


def _rank_job(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import lightning as L
    import torch.distributed as dist
    from torch import nn

    from lightning_sharded.strategies import ShardedFSDPStrategy, ShardedModelParallelStrategy

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    # Every generator seeded (torch, random, numpy): the checkpoint, per-rank RNG states included, is the
    # same from run to run, and so are the sizes the documented sessions of the tools show.
    L.seed_everything(0, verbose=False)
    output: Path = args.output
    checkpoint = output / ("checkpoint" if args.state_dict_type == "sharded" else "checkpoint.ckpt")
    model = _demo_model()
    strategy: Any
    if args.strategy == "fsdp":
        strategy = ShardedFSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type=args.state_dict_type)
    else:
        strategy = ShardedModelParallelStrategy(
            fully_shard_policy={nn.Linear}, state_dict_type=args.state_dict_type
        )
    values: dict[str, Any] = {}

    class Capture(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            values.update(_full_values(trainer, pl_module))

    resume = args.rank_job == "resume"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=STEPS + 1 if resume else STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Capture()] if resume else [],
    )
    if resume:
        trainer.fit(model, ckpt_path=checkpoint)
        result = output / f"restored-{world}.pt"
    else:
        trainer.fit(model)
        trainer.save_checkpoint(checkpoint, weights_only=False)  # the whole training state
        values = _full_values(trainer, model)
        result = output / "saved.pt"
    if rank == 0:
        import torch

        torch.save(values, result)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _demo_model() -> Any:
    """A LightningModule with two linear layers (sharded by the strategy) and a DTensor table."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class DemoModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.encoder = nn.Linear(DIM, HIDDEN)
            self.head = nn.Linear(HIDDEN, DIM)
            self.table: Any = None  # a DTensor, sharded by rows: a sharded attribute, not a parameter

        def configure_model(self) -> None:
            if self.table is not None:
                return
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            full = torch.arange(VOCAB * DIM, dtype=torch.float32).reshape(VOCAB, DIM) / (VOCAB * DIM)
            self.table = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            rows = self.table.full_tensor()[ids]  # look up rows of the sharded table
            loss: torch.Tensor = (self.head(torch.relu(self.encoder(rows))) - rows).pow(2).mean()
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            with torch.no_grad():  # the table changes too, so only a real restore brings it back
                self.table.to_local().mul_(0.9).add_(0.01 * (batch_idx + 1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader[Any]:
            ids = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(1))
            return DataLoader(TensorDataset(ids), batch_size=8)

    return DemoModel()


def _full_values(trainer: Any, model: Any) -> dict[str, Any]:
    """Full weights, table and optimizer state, gathered with torch's own helpers (collective).

    Everything is cloned: in one process the gathered tensors can be the live ones, which training
    would change afterwards.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    root = trainer.strategy.model
    values: dict[str, Any] = {"global_step": trainer.global_step, "table": model.table.full_tensor().clone()}
    model_state: dict[str, Any] = get_model_state_dict(root, options=options)
    for key, value in model_state.items():
        if key != "table":
            values[f"weight.{key}"] = value.clone()
    for opt in trainer.optimizers:
        state: dict[str, Any] = get_optimizer_state_dict(root, opt, options=options)  # type: ignore[assignment]
        for name, entries in state["state"].items():
            for entry, value in entries.items():
                values[f"optimizer.{name}.{entry}"] = value.clone()
    return values


if __name__ == "__main__":
    sys.exit(main())
