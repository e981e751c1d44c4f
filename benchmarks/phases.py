"""Where a checkpoint's seconds go: per-phase timers around one save and one resume of each strategy.

Run: ``python benchmarks/phases.py [--size-gb 2] [--cases stock-fsdp ours-fsdp stock-mp ours-mp]``.
It starts 2 ranks (as ``benchmarks/run.py`` does, same model and Trainers), and for each case fits one
step, times one ``trainer.save_checkpoint`` and one resume (``fit(ckpt_path=...)``, page cache dropped),
with timers wrapped around the functions each phase runs (inclusive seconds, the slowest rank's): the
state dicts Lightning builds before saving, DCP's planning, writes and reads, the optimizer templates,
copies into the model, Lightning's own restore. ``--cprofile DIR`` also writes rank 0's profile of each
save and load (``pstats``). The breakdown in ``docs/benchmarks.md`` comes from this script.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: (dotted owner, attribute, label): the functions timed, wherever they are looked up.
PHASES: list[tuple[str, str, str]] = [
    # Lightning
    (
        "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector",
        "dump_checkpoint",
        "save: Lightning dump_checkpoint (state dicts + loops)",
    ),
    ("STRATEGY", "lightning_module_state_dict", "save: model state dict"),
    ("STRATEGY", "optimizer_state", "save: optimizer state dict"),
    ("STRATEGY", "save_checkpoint", "save: strategy.save_checkpoint (write + commit)"),
    ("STRATEGY", "load_checkpoint", "load: strategy.load_checkpoint"),
    (
        "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector",
        "_restore_modules_and_callbacks",
        "load: Lightning _restore_modules_and_callbacks (incl. load_checkpoint)",
    ),
    (
        "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector",
        "restore_training_state",
        "load: Lightning restore_training_state",
    ),
    # DCP, both directions
    (
        "torch.distributed.checkpoint.default_planner.DefaultSavePlanner",
        "create_local_plan",
        "dcp: save local plan",
    ),
    (
        "torch.distributed.checkpoint.default_planner.DefaultSavePlanner",
        "create_global_plan",
        "dcp: save global plan",
    ),
    ("torch.distributed.checkpoint.filesystem.FileSystemWriter", "write_data", "dcp: write_data"),
    ("torch.distributed.checkpoint.filesystem.FileSystemWriter", "finish", "dcp: write .metadata"),
    (
        "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner",
        "set_up_planner",
        "dcp: load set_up_planner",
    ),
    (
        "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner",
        "create_local_plan",
        "dcp: load local plan",
    ),
    (
        "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner",
        "create_global_plan",
        "dcp: load global plan",
    ),
    ("torch.distributed.checkpoint.filesystem.FileSystemReader", "read_metadata", "dcp: read .metadata"),
    ("torch.distributed.checkpoint.filesystem.FileSystemReader", "read_data", "dcp: read_data"),
    ("torch.distributed.checkpoint.state_dict_loader", "load", "dcp: load (whole call)"),
    ("torch.distributed.checkpoint.state_dict_saver", "save", "dcp: save (whole call)"),
    # torch's FSDP1 helpers
    ("torch.distributed.fsdp.FullyShardedDataParallel", "optim_state_dict", "fsdp1: FSDP.optim_state_dict"),
    (
        "torch.distributed.fsdp.FullyShardedDataParallel",
        "optim_state_dict_to_load",
        "fsdp1: FSDP.optim_state_dict_to_load",
    ),
    ("torch.distributed.checkpoint.state_dict", "_init_optim_state", "torch: _init_optim_state (fake step)"),
    ("torch.optim.Optimizer", "load_state_dict", "torch: Optimizer.load_state_dict"),
    (
        "torch.distributed.checkpoint.optimizer",
        "load_sharded_optimizer_state_dict",
        "stock: load_sharded_optimizer_state_dict",
    ),
    # ours
    ("lightning_sharded.checkpoint.load", "detect", "ours: detect"),
    ("lightning_sharded.checkpoint.load", "check_found", "ours: check_found (sizes/manifest)"),
    ("lightning_sharded.checkpoint.verify", "_checksum_problems", "ours: verify checksums (a read)"),
    (
        "lightning_sharded.checkpoint.load.checksums.ReadVerification",
        "check",
        "ours: verify checksums (after the reads)",
    ),
    ("lightning_sharded.checkpoint.load.sharded", "read_sharded_layout", "ours: read layout (.metadata)"),
    ("lightning_sharded.checkpoint.load.sharded", "model_state_dict", "ours: load target model state dict"),
    (
        "lightning_sharded.checkpoint.load.sharded",
        "optimizer_state_dict",
        "ours: load optimizer template (torch)",
    ),
    ("lightning_sharded.checkpoint.load.sharded", "_dcp_load", "ours: dcp load calls"),
    ("lightning_sharded.checkpoint.load.sharded", "set_model_state", "ours: set_model_state"),
    ("lightning_sharded.checkpoint.load.sharded", "set_optimizer_state", "ours: set_optimizer_state"),
    ("lightning_sharded.checkpoint.load.sharded", "load_meta", "ours: meta.pt"),
    (
        "lightning_sharded.checkpoint.backends.dcp_reader.DirectReader",
        "read_data",
        "ours: DirectReader.read_data",
    ),
    (
        "lightning_sharded.checkpoint.backends.dcp_writer.ChecksummingWriter",
        "write_data",
        "ours: writer write_data",
    ),
    ("lightning_sharded.checkpoint.save", "commit_directory", "ours: commit_directory (incl. write)"),
]


class Timers:
    """Inclusive seconds and call counts per label, for the functions of :data:`PHASES`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        raw = original.__func__ if isinstance(original, classmethod | staticmethod) else original

        @functools.wraps(raw)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return raw(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        replacement: Any = timed
        if isinstance(original, classmethod):
            replacement = classmethod(timed)
        elif isinstance(original, staticmethod):
            replacement = staticmethod(timed)
        setattr(owner, attr, replacement)
        self._undo.append(lambda: setattr(owner, attr, original))

    def install(self, strategy_cls: type) -> None:
        for dotted, attr, label in PHASES:
            owner: Any
            if dotted == "STRATEGY":
                owner = strategy_cls
                if attr not in owner.__dict__:  # time the inherited method on this class
                    setattr(owner, attr, getattr(owner, attr))
            else:
                owner = _resolve(dotted)
                if owner is None or not hasattr(owner, attr):
                    continue
                if isinstance(owner, type) and attr not in owner.__dict__:
                    owner = next(base for base in owner.__mro__ if attr in base.__dict__)
            self.wrap(owner, attr, label)

    def reset(self) -> None:
        self.seconds, self.calls = {}, {}

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj
    return None


@contextmanager
def profiled(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        profile.dump_stats(str(path))


class _SaveOnce:
    """A Lightning callback (made a subclass at run time) timing one ``save_checkpoint`` at the end of fit."""

    def __new__(cls, *args: Any) -> Any:
        from benchmarks import ranks

        class SaveOnce(ranks.L.Callback):
            def __init__(
                self, ckpt: Path, timers: Timers, record: dict[str, Any], profile: Path | None
            ) -> None:
                self.ckpt, self.timers, self.record, self.profile = ckpt, timers, record, profile

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                ranks.settle()
                self.timers.reset()
                with profiled(self.profile):
                    self.record["save s"] = ranks.timed(lambda: trainer.save_checkpoint(self.ckpt))
                self.record["save phases"] = dict(self.timers.seconds)
                self.record["save calls"] = dict(self.timers.calls)

        return SaveOnce(*args)


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks import ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    results: dict[str, Any] = {}
    for case in args.cases:
        torch.manual_seed(0)
        ckpt = args.dir / f"{case}.ckpt"
        # "ours-mp+verify": ours-mp, resumed with verify=True
        base, _, option = case.partition("+")
        options = {option: True} if option else {}
        strategy = ranks.make_strategy(base, world)
        timers = Timers()
        timers.install(type(strategy))
        record: dict[str, Any] = {}
        prof = args.cprofile if rank == 0 else None

        save_profile = prof / f"{case}.save.pstats" if prof else None
        save = _SaveOnce(ckpt, timers, record, save_profile)
        model = ranks.BenchModel(args.width, args.layers, shard_layers=base.endswith("mp"))
        trainer = ranks.trainer_for(strategy, [save])
        trainer.fit(model)
        del trainer, model
        ranks.evict(ckpt)
        model = ranks.BenchModel(args.width, args.layers, shard_layers=base.endswith("mp"))
        trainer = ranks.trainer_for(ranks.make_strategy(base, world, **options))
        timers.reset()
        restore: dict[str, float] = {}
        with ranks.timing_restore(trainer, restore), profiled(prof / f"{case}.load.pstats" if prof else None):
            trainer.fit(model, ckpt_path=ckpt)
        record["load s"] = restore["restore s"]
        record["load phases"] = dict(timers.seconds)
        record["load calls"] = dict(timers.calls)
        timers.uninstall()
        del trainer, model
        ranks.remove(ckpt)
        results[case] = record
        (args.out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def report(per_rank: list[dict[str, Any]]) -> str:
    lines = []
    for case in per_rank[0]:
        for kind in ("save", "load"):
            total = max(r[case][f"{kind} s"] for r in per_rank)
            lines.append(f"\n{case} {kind}: {total:.2f} s (slowest rank)")
            labels = sorted(
                {label for r in per_rank for label in r[case][f"{kind} phases"]},
                key=lambda label: -max(r[case][f"{kind} phases"].get(label, 0.0) for r in per_rank),
            )
            for label in labels:
                seconds = max(r[case][f"{kind} phases"].get(label, 0.0) for r in per_rank)
                calls = per_rank[0][case][f"{kind} calls"].get(label, 0)
                lines.append(f"  {label:<66}{seconds:>7.2f} s{calls:>4}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--cases", nargs="+", default=["stock-fsdp", "ours-fsdp", "stock-mp", "ours-mp"])
    parser.add_argument("--cprofile", type=Path, default=None, help="write rank 0's pstats here")
    parser.add_argument("--json", type=Path, default=None, help="write the ranks' figures here")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    from benchmarks.run import WORLD, geometry
    from tests.distributed.launch import run_ranks

    width, layers = geometry(args.size_gb)
    scratch = Path(tempfile.mkdtemp(prefix="lsphases-"))
    (scratch / "out").mkdir()
    if args.cprofile:
        args.cprofile.mkdir(parents=True, exist_ok=True)
    extra = ["--cprofile", str(args.cprofile.resolve())] if args.cprofile else []
    try:
        run_ranks(
            Path(__file__).resolve(),
            WORLD,
            "--rank",
            "--cases",
            *args.cases,
            "--dir",
            str(scratch),
            "--out",
            str(scratch / "out"),
            "--width",
            str(width),
            "--layers",
            str(layers),
            *extra,
            timeout=1800,
            env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        )
        per_rank = [json.loads((scratch / "out" / f"rank{r}.json").read_text()) for r in range(WORLD)]
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(per_rank, indent=1))
    print(f"uptime: {os.getloadavg()}")
    print(report(per_rank))


if __name__ == "__main__":
    main()
