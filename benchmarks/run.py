"""The benchmark suite: checkpoints of our strategies against stock Lightning, torch and the disk.

Run: ``python -m benchmarks.run [--size-gb 2] [--repeats 2] [--quick]``. It prints a table and writes
``benchmarks/results/results.json``, ``results.png`` and ``results.md`` (and, for a full run, the
tables of ``docs/benchmarks.md``). Every figure is a ratio against a baseline measured in the same run:

- **throughput**: save and load of a sharded checkpoint (a model of ``Linear`` layers plus Adam, 2 ranks,
  CPU, gloo, ranks started by this module) through real Lightning Trainers (``trainer.save_checkpoint``
  and the restore of ``fit(ckpt_path=...)``), for stock ``ModelParallelStrategy``, stock
  ``FSDPStrategy``, ours, plain ``torch.save``/``torch.load`` and plain ``dcp.save``/``dcp.load``, as
  checkpoint bytes per second against the disk's faithful limit (``benchmarks.faithful``): every rank
  writing, after each timed save, the files that save wrote, at their sizes, as a save must at best
  (fsync per file and directory, rename publish), and reading, after each timed resume, the bytes that
  resume read, cold, as a resume must at best; the median of those probes. The page cache of a
  checkpoint is dropped before each load (``benchmarks.save_load``);
- **async**: how long a save blocks training with ``async_save`` against the synchronous save
  (``benchmarks.async_stall``); **training**: steps per second while an async save is in flight
  (``benchmarks.training``);
- **memory**: peak resident memory per rank while resuming from one full checkpoint file, above the
  process's memory before the model was built, against the size of the rank's shard (model plus Adam);
- **verify**: loads with checksums against a plain load; **tools**: the CLI on the checkpoint
  (``benchmarks.tools``);
- **hooks**: the sharded-state hooks' overhead (``benchmarks.hooks_overhead``);
- **profile**: where a resume's seconds go, on each rank, phase by phase (``benchmarks.phases``), the
  phases' sum checked against the wall time.

Times are the slowest rank's, medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, ROOT, hooks_overhead
from benchmarks.builders import WORLD, geometry
from benchmarks.chart import plot
from benchmarks.profile import section as profile_section
from benchmarks.ranks import run_rank_cases
from benchmarks.report import collect, disk_figures
from benchmarks.tables import markdown, table, update_docs
from benchmarks.tools import tools_section

DOCS = ROOT / "docs" / "benchmarks.md"
#: Timed async saves and verify rounds of a full run (at least): each is a second or less, and with the
#: default 2 one slow repeat moved the figure by a third (issue 15; docs/benchmarks.md's history).
ASYNC_REPEATS = 5
VERIFY_CYCLES = 4


def our_strategies() -> dict[str, bool]:
    """Which of our strategies exist on this branch, and whether they have ``async_save``."""
    try:
        import lightning_sharded
    except ImportError:
        return {}
    found = {}
    for case, name in (("ours-mp", "ShardedModelParallelStrategy"), ("ours-fsdp", "ShardedFSDPStrategy")):
        cls = getattr(lightning_sharded, name, None)
        if cls is not None:
            found[case] = hasattr(cls, "wait_for_checkpoint")
    return found


def choose_cases(quick: bool, only: list[str] | None) -> list[str]:
    """The rank cases of a run, in the order they run (``only``: a subset of them)."""
    ours = our_strategies()
    cases = ["stock-mp", "stock-fsdp", *ours, "torch", "memory-stock-mp"]
    if "ours-mp" in ours:
        cases.append("memory-ours-mp")
    cases += [f"async-{case}" for case, has_async in ours.items() if has_async]
    if not quick:  # the fixed costs of a save, on the model size users start with, as they save
        cases += [f"async-{kind}-{case}" for kind in ("small", "mc") for case, has in ours.items() if has]
    if "ours-mp" in ours:
        cases.append("verify-ours-mp")
    # The resume's profile (benchmarks.phases): where a resume's seconds go, on each rank.
    cases += [f"phases-{case}" for case in ours]
    # The training-while-saving cases are the slowest: the smoke test runs one of them.
    cases += [
        f"throughput-{case}"
        for case, has_async in ours.items()
        if has_async and not (quick and case != "ours-mp")
    ]
    if ours.get("ours-mp") and not quick:
        cases.append("throughput-light-ours-mp")
    return [case for case in cases if case in only] if only else cases


def _load_average() -> dict[str, float]:
    """The machine's load (``uptime``) at the end of the run: how shared it was."""
    one, five, fifteen = os.getloadavg()
    return {"1 min": one, "5 min": five, "15 min": fifteen}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (model + Adam)")
    parser.add_argument("--repeats", type=int, default=None, help="timed saves and loads per case")
    parser.add_argument("--quick", action="store_true", help="a small size and few repeats: a smoke test")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where results.json/.png go")
    parser.add_argument("--timeout", type=float, default=2400.0, help="for all the ranks' cases together")
    parser.add_argument("--cases", nargs="+", help="run only these cases (default: all that exist)")
    parser.add_argument("--no-hooks", action="store_true", help="skip the hook-overhead section")
    parser.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="rewrite the tables of this markdown file between its results markers"
        " (default: docs/benchmarks.md for a full run into benchmarks/results)",
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="rows per step of the training-throughput cases"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gb = min(args.size_gb, 0.02)
    if args.docs is None and not args.quick and not args.cases and args.out == RESULTS:
        args.docs = DOCS
    repeats = args.repeats or 2
    if args.batch is None:
        # 512 rows: a step bound by its matmuls (the issue asks for a compute-bound step); at 8 rows
        # (the light case) it is all FSDP communication over gloo and memory traffic.
        args.batch = 4 if args.quick else 512
    width, layers = geometry(args.size_gb)
    cases = choose_cases(args.quick, args.cases)

    start = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="lsbench-", dir=args.dir))
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        nbytes = 12 * width * width * layers
        per_rank = run_rank_cases(
            cases,
            scratch,
            width,
            layers,
            "--repeats",
            str(repeats),
            "--full",
            "--raw-bytes",
            str(nbytes),
            "--batch",
            str(args.batch),
            "--steady",
            "2",
            "--cycles",
            str(1 if args.quick else repeats),
            "--async-repeats",
            str(repeats if args.quick else max(repeats, ASYNC_REPEATS)),
            "--verify-cycles",
            str(1 if args.quick else max(repeats, VERIFY_CYCLES)),
            world=WORLD,
            timeout=args.timeout,
        )
        kept = scratch / "kept.ckpt"
        tools = (
            tools_section(kept, scratch, 1 if args.quick else repeats, quick=args.quick)
            if kept.is_dir()
            else {"rows": {}, "ratios": {}, "bytes": 0, "series": {}}
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    raw = disk_figures(per_rank)
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "memory GiB": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "config": {
            "checkpoint GB": nbytes / 1e9,
            "width": width,
            "layers": layers,
            "ranks": WORLD,
            "repeats": repeats,
            "cases": cases,
        },
        "disk": raw,
    }
    report.update(collect(per_rank, raw))
    report["profile"] = profile_section(per_rank)
    report["tools"] = tools
    report["load"] = _load_average()
    report["hooks"] = (
        {"rows": {}, "ratios": {}}
        if args.no_hooks
        else hooks_overhead.section(200 if args.quick else 2000, 5 if args.quick else 21)
    )
    import lightning
    import torch

    report["machine"].update(torch=torch.__version__, lightning=lightning.__version__)
    report["seconds"] = time.perf_counter() - start
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "results.png")
    (args.out / "results.md").write_text(markdown(report) + "\n")
    if args.docs is not None:
        update_docs(args.docs, markdown(report))
    print(table(report))
    print(f"\n{report['seconds']:.0f} s; wrote {args.out / 'results.json'} and {args.out / 'results.png'}")
    return report


if __name__ == "__main__":
    main()
