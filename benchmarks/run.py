"""The benchmark suite: checkpoints of our strategies against stock Lightning, torch and the disk.

Run: ``python benchmarks/run.py [--size-gb 2] [--repeats 2] [--quick]``. It prints a table and writes
``benchmarks/results/results.json`` and ``benchmarks/results/results.png``. Every figure is a ratio
against a baseline measured in the same run:

- **throughput**: save and load of a sharded checkpoint (a model of ``Linear`` layers plus Adam, 2 ranks,
  CPU, gloo, ranks started by this script) through real Lightning Trainers (``trainer.save_checkpoint``
  and the restore of ``fit(ckpt_path=...)``), for stock ``ModelParallelStrategy``, stock
  ``FSDPStrategy``, ours, plain ``torch.save``/``torch.load`` and plain ``dcp.save``/``dcp.load``, as
  checkpoint bytes per second against the disk's raw sequential write+fsync and cold read, measured by
  this script the same way (every rank writes and reads its share at once) before each timed save,
  the median of those probes. The page cache of a checkpoint is dropped
  before each load;
- **async**: how long a save blocks training with ``async_save`` against the synchronous save;
- **memory**: peak resident memory per rank while resuming from one full checkpoint file, above the
  process's memory before the model was built, against the size of the rank's shard (model plus Adam);
- **hooks**: the sharded-state hooks' overhead (``benchmarks/hooks_overhead.py``).

Times are the slowest rank's, medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.distributed.launch import run_ranks  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DOCS = REPO / "docs" / "benchmarks.md"
#: Timed async saves and verify rounds of a full run (at least): each is a second or less, and with the
#: default 2 one slow repeat moved the figure by a third (FSDP1's stall: 0.094-0.127 in full runs, 0.068
#: and 0.071 in runs of the case alone with 4).
ASYNC_REPEATS = 5
VERIFY_CYCLES = 4
#: The tables of ``docs/benchmarks.md`` sit between these lines; a full run rewrites them.
BEGIN, END = "<!-- results: written by benchmarks/run.py -->", "<!-- end of results -->"
WORLD = 2
STOCK = {"ours-mp": "stock-mp", "ours-fsdp": "stock-fsdp"}
LABELS = {
    "torch": "torch.save / torch.load (per rank)",
    "dcp": "dcp.save / dcp.load",
    "stock-mp": "stock ModelParallelStrategy",
    "stock-fsdp": "stock FSDPStrategy",
    "ours-mp": "ShardedModelParallelStrategy",
    "ours-fsdp": "ShardedFSDPStrategy",
}


def geometry(size_gb: float) -> tuple[int, int]:
    """(width, layers) of a model whose checkpoint (weights plus two Adam moments) is ``size_gb``."""
    width = 4096 if size_gb >= 0.5 else 512
    layers = max(2, round(size_gb * 1e9 / (12 * width * width)))
    return width, layers


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


def median_of_max(per_rank: list[dict[str, Any]], case: str, key: str) -> float:
    """Median over repeats of the slowest rank's seconds."""
    series = [r[case][key] for r in per_rank]
    return statistics.median(max(values) for values in zip(*series, strict=True))


def training_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One throughput case's figures from each rank's record: the slowest rank's median steps/s without
    and while saving, the longest median save window, the median over every rank's pairs of windows of
    steps/s while saving / without (the ratio), and those ``pairs``."""
    pairs = [
        saving / steady
        for r in records
        for saving, steady in zip(r["saving steps/s"], r["steady steps/s"], strict=True)
    ]
    return {
        "steps/s without a save": min(statistics.median(r["steady steps/s"]) for r in records),
        "steps/s while saving": min(statistics.median(r["saving steps/s"]) for r in records),
        "save in flight s": max(statistics.median(r["save window s"]) for r in records),
        "while saving / without": statistics.median(pairs),
        "pairs": pairs,
    }


def raw_bandwidth(per_rank: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """The disk's raw write+fsync and cold read GB/s from the ranks' probes (all ranks at once, each its
    share of ``nbytes``; slowest rank per probe), median over every probe of the run."""
    figures: dict[str, Any] = {}
    for key, name in (
        ("raw write s", "write GB/s"),
        ("raw read s", "read GB/s"),
        ("raw new-memory read s", "new-memory read GB/s"),
    ):
        probes = [
            max(values)
            for case in per_rank[0]
            if isinstance(per_rank[0][case], dict) and key in per_rank[0][case]
            for values in zip(*(r[case][key] for r in per_rank), strict=True)
        ]
        # No probe without a Lightning save case (a run of --cases that has none): no disk ratios.
        figures[name] = nbytes / statistics.median(probes) / 1e9 if probes else math.nan
        figures[name.replace("GB/s", "probes GB/s")] = [nbytes / s / 1e9 for s in probes]
    return figures


def collect(per_rank: list[dict[str, Any]], raw: dict[str, float]) -> dict[str, Any]:
    """Turn the ranks' JSON into the report's sections; every ratio in each section's ``ratios``."""
    errors = {
        case: values["error"]
        for case, values in per_rank[0].items()
        if isinstance(values, dict) and "error" in values
    }
    ok = {case for case in per_rank[0] if case not in errors}
    rows: dict[str, dict[str, float]] = {}

    def row(name: str, nbytes: float, save_s: float, load_s: float) -> None:
        rows[name] = {
            "bytes": nbytes,
            "save s": save_s,
            "load s": load_s,
            "save GB/s": nbytes / save_s / 1e9,
            "load GB/s": nbytes / load_s / 1e9,
            "save / raw write": nbytes / save_s / 1e9 / raw["write GB/s"],
            "load / raw read": nbytes / load_s / 1e9 / raw["read GB/s"],
            "load / new-memory read": nbytes / load_s / 1e9 / raw["new-memory read GB/s"],
        }

    if "torch" in ok:
        t = per_rank[0]["torch"]
        row(
            "torch",
            t["bytes"],
            median_of_max(per_rank, "torch", "save s"),
            median_of_max(per_rank, "torch", "load s"),
        )
        row(
            "dcp",
            t["dcp bytes"],
            median_of_max(per_rank, "torch", "dcp save s"),
            median_of_max(per_rank, "torch", "dcp load s"),
        )
    for case in ("stock-mp", "stock-fsdp", "ours-mp", "ours-fsdp"):
        if case in ok:
            row(
                case,
                per_rank[0][case]["bytes"],
                median_of_max(per_rank, case, "save s"),
                median_of_max(per_rank, case, "load s"),
            )
    for ours, stock in STOCK.items():
        if ours in rows and stock in rows:
            rows[ours]["resume speedup vs stock"] = rows[stock]["load s"] / rows[ours]["load s"]
            rows[ours]["save speedup vs stock"] = rows[stock]["save s"] / rows[ours]["save s"]
    throughput_ratios = {
        f"{name}: {key}": value
        for name, figures in rows.items()
        for key, value in figures.items()
        if " / " in key or "speedup" in key
    }

    async_rows: dict[str, dict[str, float]] = {}
    if "torch" in ok:
        sync = median_of_max(per_rank, "torch", "dcp save s")
        stall = median_of_max(per_rank, "torch", "async stall s")
        total = median_of_max(per_rank, "torch", "async total s")
        async_rows["dcp.async_save (stock torch)"] = {
            "sync save s": sync,
            "stall s": stall,
            "async total s": total,
            "stall / sync save": stall / sync,
        }
    for case in ("async-ours-mp", "async-ours-fsdp"):
        if case in ok:
            sync = median_of_max(per_rank, case, "sync s")
            stall = median_of_max(per_rank, case, "async stall s")
            total = median_of_max(per_rank, case, "async total s")
            first = max(r[case]["first async stall s"][0] for r in per_rank)
            async_rows[LABELS[case.removeprefix("async-")] + " async_save=True"] = {
                "sync save s": sync,
                "stall s": stall,
                "async total s": total,
                "stall / sync save": stall / sync,
                "first save stall s (allocates the buffers)": first,
            }

    memory_rows: dict[str, dict[str, float]] = {}
    for case in ("memory-stock-mp", "memory-ours-mp"):
        if case in ok:
            worst = max(per_rank, key=lambda r: r[case]["peak rss bytes"] - r[case]["baseline rss bytes"])[
                case
            ]
            peak = worst["peak rss bytes"] - worst["baseline rss bytes"]
            memory_rows[LABELS[case.removeprefix("memory-")]] = {
                "peak above baseline bytes": peak,
                "shard bytes": worst["shard bytes"],
                "largest tensor bytes": worst["largest tensor bytes"],
                "peak / shard": peak / worst["shard bytes"],
                "peak / (shard + largest tensor)": peak
                / (worst["shard bytes"] + worst["largest tensor bytes"]),
                "restore s": worst["restore s"],
            }
    verify_rows: dict[str, dict[str, float]] = {}
    if "verify-ours-mp" in ok:
        plain = median_of_max(per_rank, "verify-ours-mp", "plain load s")
        checked = median_of_max(per_rank, "verify-ours-mp", "verify load s")
        during = median_of_max(per_rank, "verify-ours-mp", "verify during load s")
        verify_rows[LABELS["ours-mp"]] = {
            "plain load s": plain,
            "verify load s": checked,
            "verify / plain load": checked / plain,
            "during load s": during,
            "during / plain load": during / plain,
        }
    training_rows: dict[str, dict[str, float]] = {}
    for case in ("throughput-ours-mp", "throughput-ours-fsdp", "throughput-light-ours-mp"):
        if case in ok:
            strategy = case.removeprefix("throughput-").removeprefix("light-")
            batch = per_rank[0][case].get("batch")
            kind = "communication-bound" if case.startswith("throughput-light-") else "matmul-bound"
            figures = training_figures([r[case] for r in per_rank])
            del figures["pairs"]
            training_rows[f"{LABELS[strategy]}, {batch} rows per step ({kind})"] = figures
    return {
        "verify": {
            "rows": verify_rows,
            "ratios": {
                **{f"{n}: verify / plain load": r["verify / plain load"] for n, r in verify_rows.items()},
                **{
                    f"{n}: verify='during' / plain load": r["during / plain load"]
                    for n, r in verify_rows.items()
                },
            },
        },
        "training": {
            "rows": training_rows,
            "ratios": {
                f"{n}: while saving / without": r["while saving / without"] for n, r in training_rows.items()
            },
        },
        "throughput": {"rows": rows, "ratios": throughput_ratios},
        "async": {
            "rows": async_rows,
            "ratios": {
                f"{name}: stall / sync save": r["stall / sync save"] for name, r in async_rows.items()
            },
        },
        "memory": {
            "rows": memory_rows,
            "ratios": {
                f"{name}: {k}": v for name, r in memory_rows.items() for k, v in r.items() if " / " in k
            },
        },
        "errors": errors,
    }


_MEASURE = """
import resource, subprocess, sys, time
def anon(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
start = time.perf_counter()
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
peak_anon = 0
while child.poll() is None:
    peak_anon = max(peak_anon, anon(child.pid))
    time.sleep(0.005)
elapsed = time.perf_counter() - start
child.stderr.read()
print(elapsed, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, child.returncode, peak_anon)
"""


def measure(command: list[str]) -> tuple[float, int, int]:
    """(seconds, peak RSS bytes, peak anonymous memory bytes) of ``command`` run in a fresh process
    (whose start is counted).

    RSS counts the pages of files the process maps (``consolidate`` maps its output, which the page
    cache holds); anonymous memory (``RssAnon``, sampled every 5 ms) is what the process allocates.
    """
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *command], capture_output=True, text=True, check=True
    ).stdout.split()
    if out[2] != "0":
        raise RuntimeError(f"{command} failed with exit code {out[2]}")
    return float(out[0]), int(out[1]) * 1024, int(out[3]) * 1024


def tools_section(ckpt: Path, scratch: Path, repeats: int, quick: bool = False) -> dict[str, Any]:
    """The offline tools on the kept 2-rank checkpoint, each against the disk doing the same bytes.

    ``inspect`` and ``verify`` (CLI, a fresh process each, cold cache) against ``cat`` of its files to
    ``/dev/null``; ``consolidate`` (one read of the source, checksummed as it is read; ``--no-verify``
    without the checksums) against a raw cold read of the source plus a write+fsync of as many bytes.
    Medians. ``quick``
    runs ``inspect`` and ``consolidate --no-verify`` only (a smoke test: each CLI start imports torch).
    """
    from benchmarks.disk import evict_tree, read_all, write_fsync

    files = sorted(str(p) for p in ckpt.rglob("*") if p.is_file())
    nbytes = sum(Path(f).stat().st_size for f in files)
    cli = [sys.executable, "-c", "import sys; from lightning_sharded.cli import main; sys.exit(main())"]
    dst = scratch / "consolidated.ckpt"
    raw_file = scratch / "raw-consolidate.bin"
    series: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}
    anon: dict[str, int] = {}

    def run(name: str, command: list[str]) -> None:
        os.sync()
        evict_tree(ckpt)
        seconds, peak, peak_anon = measure(command)
        series.setdefault(name, []).append(seconds)
        peaks[name] = max(peaks.get(name, 0), peak)
        anon[name] = max(anon.get(name, 0), peak_anon)
        if dst.exists():
            dst.unlink()

    for _ in range(repeats):
        run("cat", ["sh", "-c", "cat " + " ".join(f"'{f}'" for f in files) + " > /dev/null"])
        run("inspect", [*cli, "inspect", str(ckpt)])
        if not quick:
            run("verify", [*cli, "verify", str(ckpt)])
        run(
            "consolidate --no-verify",
            [*cli, "consolidate", "--no-verify", "--no-progress", str(ckpt), str(dst)],
        )
        if not quick:
            run("consolidate", [*cli, "consolidate", "--no-progress", str(ckpt), str(dst)])
        os.sync()
        evict_tree(ckpt)
        start = time.perf_counter()
        for f in files:
            read_all(Path(f))
        write_fsync(raw_file, nbytes)
        series.setdefault("raw read + write", []).append(time.perf_counter() - start)
        raw_file.unlink()
    med = {name: statistics.median(values) for name, values in series.items()}
    rows = {
        name: {
            "seconds": med[name],
            "GB/s": nbytes / med[name] / 1e9,
            "peak rss bytes": peaks.get(name, 0),
            "peak anon bytes": anon.get(name, 0),
        }
        for name in med
    }
    ratios = {
        "inspect / cat": med["inspect"] / med["cat"],
        "consolidate --no-verify GB/s / raw read+write": med["raw read + write"]
        / med["consolidate --no-verify"],
        "consolidate peak anonymous memory / checkpoint": anon["consolidate --no-verify"] / nbytes,
    }
    if not quick:
        ratios["verify / cat"] = med["verify"] / med["cat"]
        ratios["consolidate GB/s / raw read+write"] = med["raw read + write"] / med["consolidate"]
    return {"rows": rows, "ratios": ratios, "bytes": nbytes, "series": series}


def hooks_section(modules: int, repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from benchmarks import hooks_overhead
    from tests.distributed.launch import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = hooks_overhead.run(modules, repeats)
    finally:
        torch.set_num_threads(threads)
    ratios = {f"{case}: {k}": v for case, r in rows.items() for k, v in r.items() if "ratio" in k}
    return {"rows": rows, "ratios": ratios}


def table(report: dict[str, Any]) -> str:
    raw = report["disk"]
    lines = [
        f"checkpoint: {report['config']['checkpoint GB']:.2f} GB (model + Adam), {WORLD} ranks, CPU, gloo;"
        f" disk raw write+fsync {raw['write GB/s']:.2f} GB/s, cold read {raw['read GB/s']:.2f} GB/s,"
        f" into new memory {raw['new-memory read GB/s']:.2f} GB/s",
        "",
        f"{'save / load':<38}{'save GB/s':>10}{'/ raw':>7}{'load GB/s':>11}{'/ raw':>7}{'/ new mem':>11}"
        f"{'resume x stock':>16}",
    ]
    for name, r in report["throughput"]["rows"].items():
        speed = r.get("resume speedup vs stock")
        lines.append(
            f"{LABELS[name]:<38}{r['save GB/s']:>10.2f}{r['save / raw write']:>7.2f}{r['load GB/s']:>11.2f}"
            f"{r['load / raw read']:>7.2f}{r['load / new-memory read']:>11.2f}"
            f"{(f'{speed:.2f}' if speed else '-'):>16}"
        )
    lines += ["", f"{'async save':<50}{'sync s':>8}{'stall s':>9}{'stall / sync':>14}"]
    for name, r in report["async"]["rows"].items():
        lines.append(f"{name:<50}{r['sync save s']:>8.2f}{r['stall s']:>9.3f}{r['stall / sync save']:>14.3f}")
    lines += [
        "",
        f"{'full-file load, peak RSS per rank':<38}{'peak GB':>8}{'shard GB':>10}{'/ shard':>9}"
        f"{'/ (shard+largest)':>19}",
    ]
    for name, r in report["memory"]["rows"].items():
        lines.append(
            f"{name:<38}{r['peak above baseline bytes'] / 1e9:>8.2f}{r['shard bytes'] / 1e9:>10.2f}"
            f"{r['peak / shard']:>9.2f}{r['peak / (shard + largest tensor)']:>19.2f}"
        )
    lines += [
        "",
        f"{'training while an async save is in flight':<44}{'steps/s':>9}{'saving':>8}{'ratio':>7}"
        f"{'window s':>10}",
    ]
    for name, r in report["training"]["rows"].items():
        lines.append(
            f"{name:<44}{r['steps/s without a save']:>9.2f}{r['steps/s while saving']:>8.2f}"
            f"{r['while saving / without']:>7.2f}{r['save in flight s']:>10.1f}"
        )
    for name, r in report["verify"]["rows"].items():
        lines.append(f"verify=True load / plain load, {name}: {r['verify / plain load']:.2f}")
        lines.append(f"verify='during' load / plain load, {name}: {r['during / plain load']:.2f}")
    for name, value in report["tools"]["ratios"].items():
        lines.append(f"tools: {name}: {value:.2f}")
    lines += ["", "hooks overhead (hooked / plain)"]
    for name, value in report["hooks"]["ratios"].items():
        lines.append(f"  {name:<70}{value:>7.3f}")
    if report["errors"]:
        lines += ["", "FAILED cases: " + ", ".join(f"{c}: {e}" for c, e in report["errors"].items())]
    return "\n".join(lines)


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines: the header, its rule, one line per row."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def markdown(report: dict[str, Any]) -> str:
    """The tables of ``docs/benchmarks.md``, from a report."""
    raw = report["disk"]

    def ratio_x(value: float | None) -> str:
        return f"{value:.2f}x" if value else "-"

    out = [
        f"Disk, probed the same way (both ranks at once, median of {len(raw['write probes GB/s'])} probes):"
        f" write+fsync **{raw['write GB/s']:.2f} GB/s**, cold read **{raw['read GB/s']:.2f} GB/s**,"
        f" cold read into new memory laid out as a resume's **{raw['new-memory read GB/s']:.2f} GB/s**;"
        f" checkpoint {report['config']['checkpoint GB']:.2f} GB.",
        "",
        *_md_table(
            [
                "save / load",
                "save GB/s",
                "save / raw write",
                "load GB/s",
                "load / raw read",
                "load / read into new memory",
                "resume vs stock",
            ],
            [
                [
                    LABELS[name],
                    f"{r['save GB/s']:.2f}",
                    f"{r['save / raw write']:.2f}",
                    f"{r['load GB/s']:.2f}",
                    f"{r['load / raw read']:.2f}",
                    f"{r['load / new-memory read']:.2f}",
                    ratio_x(r.get("resume speedup vs stock")),
                ]
                for name, r in report["throughput"]["rows"].items()
            ],
        ),
        "",
        *_md_table(
            ["async save", "sync save s", "stall s", "stall / sync save", "first stall s"],
            [
                [
                    name,
                    f"{r['sync save s']:.2f}",
                    f"{r['stall s']:.3f}",
                    f"{r['stall / sync save']:.3f}",
                    f"{first:.2f}" if (first := r.get("first save stall s (allocates the buffers)")) else "-",
                ]
                for name, r in report["async"]["rows"].items()
            ],
        ),
        "",
        *_md_table(
            [
                "full-file load into the sharded model",
                "peak above baseline GB",
                "shard GB",
                "peak / shard",
                "peak / (shard + largest tensor)",
            ],
            [
                [
                    name,
                    f"{r['peak above baseline bytes'] / 1e9:.2f}",
                    f"{r['shard bytes'] / 1e9:.2f}",
                    f"{r['peak / shard']:.2f}",
                    f"{r['peak / (shard + largest tensor)']:.2f}",
                ]
                for name, r in report["memory"]["rows"].items()
            ],
        ),
        "",
        *_md_table(
            [
                "training while an async save is in flight",
                "steps/s without a save",
                "steps/s while saving",
                "while saving / without",
                "save in flight s",
            ],
            [
                [
                    name,
                    f"{r['steps/s without a save']:.2f}",
                    f"{r['steps/s while saving']:.2f}",
                    f"{r['while saving / without']:.2f}",
                    f"{r['save in flight s']:.1f}",
                ]
                for name, r in report["training"]["rows"].items()
            ],
        ),
        "",
        *_md_table(
            [
                "load with checksums",
                "plain load s",
                "verify=True load s",
                "verify / plain",
                'verify="during" load s',
                "during / plain",
            ],
            [
                [
                    name,
                    f"{r['plain load s']:.2f}",
                    f"{r['verify load s']:.2f}",
                    f"{r['verify / plain load']:.2f}",
                    f"{r['during load s']:.2f}",
                    f"{r['during / plain load']:.2f}",
                ]
                for name, r in report["verify"]["rows"].items()
            ],
        ),
    ]
    tools = report["tools"]
    if tools["rows"]:
        out += [
            "",
            f"Offline tools on the {tools['bytes'] / 1e9:.2f} GB 2-rank checkpoint (CLI, a fresh process"
            " each, cold cache; `consolidate` reads the source once and checksums it as it reads,"
            " `--no-verify` does not checksum it):",
            "",
            *_md_table(
                ["command", "s", "GB/s of the checkpoint", "peak RSS GB", "peak anonymous GB"],
                [
                    [
                        name,
                        f"{r['seconds']:.2f}",
                        f"{r['GB/s']:.2f}",
                        f"{r['peak rss bytes'] / 1e9:.2f}",
                        f"{r.get('peak anon bytes', 0) / 1e9:.2f}",
                    ]
                    for name, r in tools["rows"].items()
                ],
            ),
            "",
            *_md_table(["tools ratio", "value"], [[name, f"{v:.2f}"] for name, v in tools["ratios"].items()]),
        ]
    load = report.get("load", {})
    if load:
        out += [
            "",
            f"Load average at the end of the run (`uptime`): {load['1 min']:.1f} / {load['5 min']:.1f}"
            f" / {load['15 min']:.1f}.",
        ]
    return "\n".join(out)


SHORT = {
    "torch": "torch.save/load",
    "dcp": "dcp.save/load",
    "stock-mp": "stock ModelParallel",
    "stock-fsdp": "stock FSDP",
    "ours-mp": "ShardedModelParallel",
    "ours-fsdp": "ShardedFSDP",
}


def _short(name: str) -> str:
    for long, short in (
        ("ShardedModelParallelStrategy", "ShardedModelParallel"),
        ("ShardedFSDPStrategy", "ShardedFSDP"),
        ("stock ModelParallelStrategy", "stock ModelParallel"),
        (" async_save=True", ""),
        ("dcp.async_save (stock torch)", "torch dcp.async_save"),
        (" rows per step", " rows"),
    ):
        name = name.replace(long, short)
    return name


def panels(report: dict[str, Any]) -> list[tuple[str, dict[str, float], float | None, str]]:
    """(question, {bar label: value}, target, which way is better) for each panel of the chart."""
    rows = report["throughput"]["rows"]
    out: list[tuple[str, dict[str, float], float | None, str]] = []
    speedups = {
        SHORT[ours] + " vs " + SHORT[stock]: rows[ours]["resume speedup vs stock"]
        for ours, stock in STOCK.items()
        if ours in rows and "resume speedup vs stock" in rows[ours]
    }
    out.append(("Resume: how many times faster than stock?", speedups, 2.0, "higher"))
    disk = report["disk"]
    out.append(
        (
            "Resume: fraction of the disk's cold read",
            {SHORT[n]: r["load / raw read"] for n, r in rows.items()}
            # The floor: the same cold read into new memory laid out as a resume's, nothing around it.
            | {"bare read into new memory": disk["new-memory read GB/s"] / disk["read GB/s"]},
            0.8,
            "higher",
        )
    )
    saves = {
        SHORT[ours] + " vs " + SHORT[stock]: rows[ours]["save speedup vs stock"]
        for ours, stock in STOCK.items()
        if ours in rows and "save speedup vs stock" in rows[ours]
    }
    out.append(("Save: how many times faster than stock?", saves, 1.0, "higher"))
    out.append(
        (
            "Async save: training stall / sync save",
            {_short(n): r["stall / sync save"] for n, r in report["async"]["rows"].items()},
            0.10,
            "lower",
        )
    )
    out.append(
        (
            "Training steps/s while an async save runs / without",
            {_short(n): r["while saving / without"] for n, r in report["training"]["rows"].items()},
            0.9,
            "higher",
        )
    )
    out.append(
        (
            "load with checksums / plain load",
            {
                f"{_short(n)} {mode}": r[key]
                for n, r in report["verify"]["rows"].items()
                for mode, key in (("verify=True", "verify / plain load"), ('"during"', "during / plain load"))
            },
            1.25,
            "lower",
        )
    )
    tools = report["tools"]["ratios"]
    out.append(
        (
            "consolidate throughput / raw read+write",
            {k.split(" GB/s")[0]: v for k, v in tools.items() if k.startswith("consolidate") and "GB/s" in k},
            0.7,
            "higher",
        )
    )
    out.append(
        (
            "inspect, verify: time / cat > /dev/null",
            {k.split(" /")[0]: v for k, v in tools.items() if k.endswith("/ cat")},
            None,
            "lower",
        )
    )
    out.append(
        (
            "Full-file load: peak RSS / (shard + largest tensor)",
            {_short(n): r["peak / (shard + largest tensor)"] for n, r in report["memory"]["rows"].items()},
            1.2,
            "lower",
        )
    )
    out.append(
        (
            "Hooks: state_dict() hooked / plain",
            {  # ours only: the section's other state_dict ratios are torch's hook and another statistic
                k.split(":")[0]: v
                for k, v in report["hooks"]["ratios"].items()
                if k.endswith(": state_dict ratio")
            },
            1.10,
            "lower",
        )
    )
    return [panel for panel in out if panel[1]]


def plot(report: dict[str, Any], path: Path) -> None:
    """One horizontal-bar panel per question, its target drawn as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = panels(report)
    cols = 2
    nrows = max(1, math.ceil(len(chosen) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(15, 3.0 * nrows), squeeze=False)
    for ax in axes.flat[len(chosen) :]:
        ax.axis("off")
    for ax, (question, bars, target, better) in zip(axes.flat, chosen, strict=False):
        labels = list(bars)
        values = [bars[k] for k in labels]
        colors = [
            "tab:gray"
            if target is None
            else ("tab:green" if (v >= target if better == "higher" else v <= target) else "tab:red")
            for v in values
        ]
        ax.barh(range(len(labels)), values, color=colors, height=0.6)
        ax.set_yticks(range(len(labels)), labels, fontsize=9)
        ax.invert_yaxis()
        top = max([*values, target or 0.0]) * 1.25 or 1.0
        ax.set_xlim(0, top)
        for i, v in enumerate(values):
            ax.text(  # on white: a value next to the target line stays readable
                v + top * 0.01,
                i,
                f"{v:.2f}",
                va="center",
                fontsize=8,
                bbox={"fc": "white", "ec": "none", "pad": 1},
            )
        title = question
        if target is not None:  # in the title: a label drawn in the panel collides with bars or titles
            ax.axvline(target, color="black", ls="--", lw=1)
            title += f"\n(dashed: target {target:g}, {better} is better)"
        ax.set_title(title, fontsize=10, loc="left")
        ax.tick_params(axis="x", labelsize=8)
    load = report.get("load", {})
    fig.suptitle(
        f"{report['config']['checkpoint GB']:.1f} GB checkpoint (model + Adam), {WORLD} ranks, CPU;"
        f" ratios against baselines of the same run; load average {load.get('1 min', 0):.1f}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def update_docs(path: Path, tables: str) -> None:
    """Put ``tables`` between the results markers of ``path`` (appended with them if it has none)."""
    text = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n\n{tables}\n\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def _load_average() -> dict[str, float]:
    """The machine's load (``uptime``) at the end of the run: how shared it was."""
    one, five, fifteen = os.getloadavg()
    return {"1 min": one, "5 min": five, "15 min": fifteen}


def finite_positive(report: dict[str, Any]) -> list[str]:
    """Names of ratios that are not finite positive numbers (empty when the report is sound)."""
    return [
        f"{section}: {name}"
        for section in ("throughput", "async", "memory", "hooks", "verify", "training", "tools")
        for name, value in report[section]["ratios"].items()
        if not (isinstance(value, float | int) and math.isfinite(value) and value > 0)
    ]


def run_rank_cases(
    cases: list[str], scratch: Path, width: int, layers: int, *options: str, timeout: float
) -> list[dict[str, Any]]:
    """Run ``cases`` of ``benchmarks/ranks.py`` on :data:`WORLD` ranks, their files in ``scratch``, the
    model ``layers`` x ``Linear(width, width)``; ``options`` go to ``ranks.py``. Each rank's figures."""
    ranks_out = scratch / "ranks"
    ranks_out.mkdir()
    run_ranks(
        Path(__file__).with_name("ranks.py"),
        WORLD,
        *cases,
        "--dir",
        str(scratch),
        "--out",
        str(ranks_out),
        "--width",
        str(width),
        "--layers",
        str(layers),
        *options,
        timeout=timeout,
    )
    return [json.loads((ranks_out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        # 512 rows: the step is about half matmuls (the issue asks for a compute-bound step); at 8
        # rows (the light case) it is all FSDP communication over gloo and memory traffic.
        args.batch = 4 if args.quick else 512
    width, layers = geometry(args.size_gb)
    ours = our_strategies()
    cases = ["stock-mp", "stock-fsdp", *ours, "torch", "memory-stock-mp"]
    if "ours-mp" in ours:
        cases.append("memory-ours-mp")
    cases += [f"async-{case}" for case, has_async in ours.items() if has_async]
    if "ours-mp" in ours:
        cases.append("verify-ours-mp")
    # The training-while-saving cases are the slowest: the smoke test runs one of them.
    cases += [
        f"throughput-{case}"
        for case, has_async in ours.items()
        if has_async and not (args.quick and case != "ours-mp")
    ]
    if ours.get("ours-mp") and not args.quick:
        cases.append("throughput-light-ours-mp")
    if args.cases:
        cases = [case for case in cases if case in args.cases]

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
    raw = raw_bandwidth(per_rank, nbytes)
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
    report["tools"] = tools
    report["load"] = _load_average()
    report["hooks"] = (
        {"rows": {}, "ratios": {}}
        if args.no_hooks
        else hooks_section(200 if args.quick else 2000, 5 if args.quick else 21)
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
