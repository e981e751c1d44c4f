"""The ranks' figures of ``benchmarks.run`` into the report's sections, each with its ratios.

Every section (``throughput``, ``async``, ``memory``, ``verify``, ``training``; ``disk`` for the probes)
holds ``rows`` (the tables' rows, by display name: ``benchmarks.names``) and ``ratios`` (every ratio
of the section against its baseline, by ``"row: ratio"``); the slowest rank counts, medians over the
repeats.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks import names
from benchmarks.disk import PROBES, WRITE

#: The sections whose every ratio must be a finite positive number (:func:`finite_positive`).
SECTIONS = ("throughput", "async", "memory", "hooks", "verify", "training", "tools")


def median_of_max(per_rank: list[dict[str, Any]], case: str, key: str) -> float:
    """Median over repeats of the slowest rank's seconds."""
    series = [r[case][key] for r in per_rank]
    return float(statistics.median(max(values) for values in zip(*series, strict=True)))


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
    """The disk's GB/s of each probe of :data:`benchmarks.disk.PROBES` (all ranks at once, each its
    share of ``nbytes``; slowest rank per probe), median over every probe of the run, and the list of
    each probe's (``"write probes GB/s"``...)."""
    figures: dict[str, Any] = {}
    for probe in PROBES:
        probes = [
            max(values)
            for case in per_rank[0]
            if isinstance(per_rank[0][case], dict) and probe.key in per_rank[0][case]
            for values in zip(*(r[case][probe.key] for r in per_rank), strict=True)
        ]
        # No probe without a Lightning save case (a run of --cases that has none): no disk ratios.
        figures[probe.name] = nbytes / statistics.median(probes) / 1e9 if probes else math.nan
        figures[probe.name.replace("GB/s", "probes GB/s")] = [nbytes / s / 1e9 for s in probes]
    return figures


def probe_count(disk: dict[str, Any]) -> int:
    """How many probes the disk figures are the median of."""
    return len(disk[WRITE.name.replace("GB/s", "probes GB/s")])


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
    for ours, stock in names.STOCK.items():
        if ours in rows and stock in rows:
            rows[ours]["resume speedup vs stock"] = rows[stock]["load s"] / rows[ours]["load s"]
            rows[ours]["save speedup vs stock"] = rows[stock]["save s"] / rows[ours]["save s"]
    throughput_ratios = {
        f"{name}: {key}": value
        for name, figures in rows.items()
        for key, value in figures.items()
        if " / " in key or "speedup" in key
    }

    def async_row(case: str, sync_key: str) -> dict[str, float]:
        sync = median_of_max(per_rank, case, sync_key)
        stall = median_of_max(per_rank, case, "async stall s")
        total = median_of_max(per_rank, case, "async total s")
        return {
            "sync save s": sync,
            "stall s": stall,
            "async total s": total,
            "stall / sync save": stall / sync,
        }

    async_rows: dict[str, dict[str, float]] = {}
    if "torch" in ok:
        async_rows[names.label("dcp-async")] = async_row("torch", "dcp save s")
    for case in ("async-ours-mp", "async-ours-fsdp"):
        if case in ok:
            first = max(r[case]["first async stall s"][0] for r in per_rank)
            async_rows[names.async_label(case.removeprefix("async-"))] = async_row(case, "sync s") | {
                "first save stall s (allocates the buffers)": first
            }

    memory_rows: dict[str, dict[str, float]] = {}
    for case in ("memory-stock-mp", "memory-ours-mp"):
        if case in ok:
            worst = max(per_rank, key=lambda r: r[case]["peak rss bytes"] - r[case]["baseline rss bytes"])[
                case
            ]
            peak = worst["peak rss bytes"] - worst["baseline rss bytes"]
            memory_rows[names.label(case.removeprefix("memory-"))] = {
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
        verify_rows[names.label("ours-mp")] = {
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
            training_rows[names.training_label(strategy, batch, kind)] = figures
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


def finite_positive(report: dict[str, Any]) -> list[str]:
    """Names of ratios that are not finite positive numbers (empty when the report is sound)."""
    return [
        f"{section}: {name}"
        for section in SECTIONS
        for name, value in report[section]["ratios"].items()
        if not (isinstance(value, float | int) and math.isfinite(value) and value > 0)
    ]
