"""The ranks' figures of ``benchmarks.run`` into the report's sections, each with its ratios.

Every section (``throughput``, ``async``, ``memory``, ``verify``, ``training``, ``profile``) holds
``rows`` (the tables' rows, by display name: ``benchmarks.names``) and ``ratios`` (every ratio of the
section against its baseline, by ``"row: ratio"``); the slowest rank counts, medians over the repeats.
``disk`` holds the probes' figures (:func:`disk_figures`): the bars every "of disk" ratio is against,
and the probes kept to explain them; a save or load above its bar is listed under the throughput
section's ``"above the bars"``, to be investigated, not reported.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks import names
from benchmarks.disk import (
    NEW_MEMORY_READ,
    PLAIN_WRITE,
    PROBES,
    READ,
    WHOLE_FILE_READ,
    WHOLE_FILE_WRITE,
    WRITE,
    Probe,
)

#: A save's and a resume's ratio against the probe run right after each (:func:`paired`), the median
#: over the repeats.
PAIRED_WRITE = "save / its own disk write"
PAIRED_READ = "load / its own disk read"

#: The sections whose every ratio must be a finite positive number (:func:`finite_positive`).
SECTIONS = ("disk", "throughput", "async", "memory", "hooks", "verify", "training", "tools", "profile")


def median_of_max(per_rank: list[dict[str, Any]], case: str, key: str) -> float:
    """Median over repeats of the slowest rank's seconds."""
    series = [r[case][key] for r in per_rank]
    return float(statistics.median(max(values) for values in zip(*series, strict=True)))


def paired(per_rank: list[dict[str, Any]], case: str, key: str, probe: Probe, nbytes: float) -> list[float]:
    """Each repeat's GB/s of ``key`` (``nbytes`` in the slowest rank's seconds) against that of the
    ``probe`` of the probes run after it (:func:`~benchmarks.faithful.probe_writes` or
    :func:`~benchmarks.faithful.probe_reads`; its slowest rank's seconds, every rank's bytes), in repeat
    order.

    The run's bar is the median of every probe of the run; the disk's speed drifts within a run (the
    write probes of one full run went from 1.42 to 2.26 GB/s), so a case's median of two repeats against
    it moves with the disk. Each repeat against its own probe does not."""
    seconds = [max(v) for v in zip(*(r[case][key] for r in per_rank), strict=True)]
    probe_s = [max(v) for v in zip(*(r[case][probe.key] for r in per_rank), strict=True)]
    probe_b = [sum(v) for v in zip(*(r[case][probe.bytes_key] for r in per_rank), strict=True)]
    return [(nbytes / s) / (b / p) for s, p, b in zip(seconds, probe_s, probe_b, strict=True)]


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


def _probe_series(per_rank: list[dict[str, Any]], probe: Probe) -> dict[str, list[Any]]:
    """Every occurrence of ``probe`` in the run, in case order: its case, seconds (slowest rank), bytes
    (all ranks'), each rank's bytes."""
    series: dict[str, list[Any]] = {"case": [], "seconds": [], "bytes": [], "rank bytes": []}
    for case, figures in per_rank[0].items():
        if not isinstance(figures, dict) or probe.key not in figures:
            continue
        seconds = zip(*(r[case][probe.key] for r in per_rank), strict=True)
        nbytes = zip(*(r[case][probe.bytes_key] for r in per_rank), strict=True)
        for s, b in zip(seconds, nbytes, strict=True):
            series["case"].append(case)
            series["seconds"].append(max(s))
            series["bytes"].append(sum(b))
            series["rank bytes"].append(list(b))
    return series


def _median_of_max(per_rank: list[dict[str, Any]], key: str) -> float:
    """The median over every occurrence of ``key`` in the run (any case) of the ranks' largest value."""
    values = [
        max(v)
        for case, figures in per_rank[0].items()
        if isinstance(figures, dict) and key in figures
        for v in zip(*(r[case][key] for r in per_rank), strict=True)
    ]
    return float(statistics.median(values)) if values else math.nan


def disk_figures(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The disk's GB/s by each probe of :data:`benchmarks.disk.PROBES` (all ranks at once; the slowest
    rank's seconds, every rank's bytes), the median over every probe of the run and each probe's
    (``"write probes GB/s"``...); for the write probes, the median ``fsync`` seconds (slowest rank) and
    dirty page cache at the largest file's ``fsync``; what each rank read in each case's resumes; and
    ratios between the probes (what write-behind, the faithful files and the resume's memory change)."""
    figures: dict[str, Any] = {"probes": {}, "read bytes per rank": {}, "written / checkpoint bytes": {}}
    for probe in PROBES:
        series = _probe_series(per_rank, probe)
        rates = [b / s / 1e9 for b, s in zip(series["bytes"], series["seconds"], strict=True)]
        # No probe without a Lightning save case (a run of --cases that has none): no disk ratios.
        figures[probe.name] = statistics.median(rates) if rates else math.nan
        figures[probe.name.replace("GB/s", "probes GB/s")] = rates
        figures["probes"][probe.name] = {"bar": probe.bar, "what": probe.what, "count": len(rates)}
        stem = probe.key.removesuffix(" s")
        fsync = _median_of_max(per_rank, stem + " fsync s")
        if not math.isnan(fsync):  # the faithful write probes record their fsyncs
            figures["probes"][probe.name]["fsync s"] = fsync
            figures["probes"][probe.name]["dirty at fsync GB"] = (
                _median_of_max(per_rank, stem + " dirty bytes") / 1e9
            )
        if probe is READ:
            for case, rank_bytes in zip(series["case"], series["rank bytes"], strict=True):
                figures["read bytes per rank"].setdefault(case, rank_bytes)
        if probe is WRITE:
            for case, nbytes in zip(series["case"], series["bytes"], strict=True):
                figures["written / checkpoint bytes"][case] = nbytes / per_rank[0][case]["bytes"]
    figures["ratios"] = {
        "plain write / disk write": figures[PLAIN_WRITE.name] / figures[WRITE.name],
        "whole-file write / disk write": figures[WHOLE_FILE_WRITE.name] / figures[WRITE.name],
        "whole-file read / disk read": figures[WHOLE_FILE_READ.name] / figures[READ.name],
        "new-memory read / disk read": figures[NEW_MEMORY_READ.name] / figures[READ.name],
    }
    return figures


def probe_count(disk: dict[str, Any]) -> int:
    """How many probes the disk's bars are the median of."""
    return int(disk["probes"][WRITE.name]["count"])


def above_the_bars(rows: dict[str, dict[str, float]]) -> list[str]:
    """``"row: ratio"`` of every save or load faster than its bar (ratio above 1.0): a figure to
    investigate (the bar is wrong, or something was measured that is not the save or load), not a
    result."""
    return [
        f"{name}: {probe.ratio} {r[probe.ratio]:.2f}"
        for name, r in rows.items()
        for probe in PROBES
        if probe.bar and probe.ratio in r and r[probe.ratio] > 1.0
    ]


def collect(per_rank: list[dict[str, Any]], raw: dict[str, Any]) -> dict[str, Any]:
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
        }
        for probe in PROBES:  # every save against every write probe, every load against every read one
            rate = rows[name]["save GB/s" if probe.kind == "write" else "load GB/s"]
            rows[name][probe.ratio] = rate / raw[probe.name]

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
    pairs: dict[str, dict[str, list[float]]] = {}
    for case in ("stock-mp", "stock-fsdp", "ours-mp", "ours-fsdp"):
        if case in ok:
            nbytes = per_rank[0][case]["bytes"]
            save_s, load_s = (median_of_max(per_rank, case, key) for key in ("save s", "load s"))
            row(case, nbytes, save_s, load_s)
            if WRITE.key in per_rank[0][case] and READ.key in per_rank[0][case]:
                pairs[case] = {
                    PAIRED_WRITE: paired(per_rank, case, "save s", WRITE, nbytes),
                    PAIRED_READ: paired(per_rank, case, "load s", READ, nbytes),
                }
                rows[case] |= {ratio: statistics.median(values) for ratio, values in pairs[case].items()}
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
        row = {"sync save s": sync, "stall s": stall, "stall / sync save": stall / sync}
        if "async total s" in per_rank[0][case]:  # the ModelCheckpoint cases time the stall only
            row["async total s"] = median_of_max(per_rank, case, "async total s")
        return row

    async_rows: dict[str, dict[str, float]] = {}
    if "torch" in ok:
        async_rows[names.label("dcp-async")] = async_row("torch", "dcp save s")
    for prefix, size in (
        ("async-", ""),
        ("async-small-", ", 50 MB"),
        ("async-mc-", ", 50 MB, ModelCheckpoint"),
    ):
        for strategy in ("ours-mp", "ours-fsdp"):
            case = prefix + strategy
            if case in ok:
                first = max(r[case]["first async stall s"][0] for r in per_rank)
                async_rows[names.async_label(strategy) + size] = async_row(case, "sync s") | {
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
        "throughput": {
            "rows": rows,
            "ratios": throughput_ratios,
            "above the bars": above_the_bars(rows),
            "pairs": pairs,
        },
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
