"""Where a checkpoint's seconds go: per-phase timers around one save and one resume of each strategy.

Run: ``python -m benchmarks.phases [--size-gb 2] [--cases stock-fsdp ours-fsdp stock-mp ours-mp]``.
It starts 2 ranks (as ``benchmarks.run`` does, same model and Trainers), and for each case fits one
step, times one ``trainer.save_checkpoint`` and one resume (``fit(ckpt_path=...)``, page cache dropped),
with timers wrapped around the functions each phase runs (``benchmarks.profile.PHASES``; inclusive
seconds, the slowest rank's): the state dicts Lightning builds before saving, DCP's planning, writes
and reads, the optimizer templates, copies into the model, Lightning's own restore. Then the resume's
profile, on each rank: every phase's own seconds (less its timed callees'), grouped (reading bytes,
CRC-32, copies into the sharded tensors, the optimizer set, Lightning's own restore, our metadata and
per-rank steps...), which add up to the restore's wall time (checked: ``benchmarks.profile``), and
beside them what the reader's threads did. A case ``S+OPTION`` resumes with the options
:data:`OPTIONS` names (``ours-mp+verify``: ``verify=True``; ``ours-mp+during``: ``verify="during"``).
``--cprofile DIR`` also writes rank 0's profile of each save and load (``pstats``). The breakdown in
``docs/benchmarks.md`` comes from this module; its rank cases are ``phases-<case>``, and
``benchmarks.run`` runs those of our strategies for its profile section.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist

from benchmarks.builders import (
    STRATEGIES,
    WORLD,
    BenchModel,
    geometry,
    make_strategy,
    shards_layers,
    trainer_for,
)
from benchmarks.profile import PHASES, ROOTS, case_label, profile_lines, resume_profile
from benchmarks.ranks import Case, run_rank_cases
from benchmarks.save_load import restore_timer
from benchmarks.timing import PhaseTimers
from benchmarks.world import evict, remove, settle, timed, world_size


@contextlib.contextmanager
def profiled(path: Path | None) -> Iterator[None]:
    """A ``cProfile`` of the block written to ``path`` (nothing when ``None``)."""
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


class _SaveOnce(L.Callback):
    """Times one ``save_checkpoint`` at the end of fit, with the phases' timers."""

    def __init__(self, ckpt: Path, timers: PhaseTimers, record: dict[str, Any], profile: Path | None) -> None:
        self.ckpt, self.timers, self.record, self.profile = ckpt, timers, record, profile

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        settle()
        self.timers.reset()
        with profiled(self.profile):
            self.record["save s"] = timed(lambda: trainer.save_checkpoint(self.ckpt))
        self.record["save phases"] = dict(self.timers.seconds)
        self.record["save calls"] = dict(self.timers.calls)


def phases_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``phases-<strategy>[+<option>]``: one timed save and one timed cold resume, by phase."""
    case = name.removeprefix("phases-")
    ckpt = args.dir / f"{case}.ckpt"
    base, _, option = case.partition("+")
    options = OPTIONS[option] if option else {}
    strategy = make_strategy(base, world_size())
    timers = PhaseTimers(roots=ROOTS)
    record: dict[str, Any] = {}
    prof = args.cprofile if dist.get_rank() == 0 else None
    phases = [(type(strategy) if p.owner == "STRATEGY" else p.owner, p.attr, p.label) for p in PHASES]
    with timers.installed(phases):
        save = _SaveOnce(ckpt, timers, record, prof / f"{case}.save.pstats" if prof else None)
        model = BenchModel(args.width, args.layers, shard_layers=shards_layers(base))
        trainer = trainer_for(strategy, [save])
        trainer.fit(model)
        del trainer, model
        evict(ckpt)
        model = BenchModel(args.width, args.layers, shard_layers=shards_layers(base))
        trainer = trainer_for(make_strategy(base, world_size(), **options))
        timers.reset()
        restore: dict[str, float] = {}
        with restore_timer(trainer, restore), profiled(prof / f"{case}.load.pstats" if prof else None):
            trainer.fit(model, ckpt_path=ckpt)
        record["load s"] = restore["restore s"]
        record["load phases"] = dict(timers.seconds)
        record["load calls"] = dict(timers.calls)
        record["load own"] = dict(timers.own)
        record["load threads"] = dict(timers.threads)
    del trainer, model
    remove(ckpt)
    return record


#: The strategy options a case ``S+OPTION`` resumes with (our strategies only).
OPTIONS: dict[str, dict[str, Any]] = {"verify": {"verify": True}, "during": {"verify": "during"}}

CASES: dict[str, Case] = {
    **{f"phases-{s}": phases_case for s in STRATEGIES},
    **{f"phases-{s}+{o}": phases_case for s in STRATEGIES if s.startswith("ours-") for o in OPTIONS},
}


def report(per_rank: list[dict[str, Any]]) -> str:
    """Each case's save and load: the slowest rank's total, then each phase's seconds and calls."""
    lines = []
    for case in per_rank[0]:
        errors = [r[case]["error"] for r in per_rank if "error" in r[case]]
        if errors:
            lines.append(f"\n{case}: FAILED: {errors[0]}")
            continue
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
        lines += profile_lines(case_label(f"phases-{case}"), resume_profile([r[case] for r in per_rank]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.phases", description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--cases", nargs="+", default=["stock-fsdp", "ours-fsdp", "stock-mp", "ours-mp"])
    parser.add_argument("--cprofile", type=Path, default=None, help="write rank 0's pstats here")
    parser.add_argument("--json", type=Path, default=None, help="write the ranks' figures here")
    args = parser.parse_args(argv)
    width, layers = geometry(args.size_gb)
    scratch = Path(tempfile.mkdtemp(prefix="lsphases-"))
    extra = []
    if args.cprofile:
        args.cprofile.mkdir(parents=True, exist_ok=True)
        extra = ["--cprofile", str(args.cprofile.resolve())]
    try:
        cases = [f"phases-{case}" for case in args.cases]
        ranks = run_rank_cases(cases, scratch, width, layers, *extra, world=WORLD, timeout=1800)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    per_rank = [{case.removeprefix("phases-"): figures for case, figures in r.items()} for r in ranks]
    if args.json:
        args.json.write_text(json.dumps(per_rank, indent=1))
    print(f"uptime: {os.getloadavg()}")
    print(report(per_rank))


if __name__ == "__main__":
    main()
