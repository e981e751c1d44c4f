"""The figures docs/benchmarks.md quotes outside its generated tables, made from the results files.

    python -m benchmarks.prose            # print every piece, to paste into docs/benchmarks.md after a run

Each piece is text as the page shows it (a table, or a phrase), made from ``benchmarks/results``:
``results.json`` (``benchmarks.run``), ``scale.json`` (``benchmarks.scale``).
``tests/test_benchmark_figures.py`` holds that the page contains every piece verbatim, and that any
other figure of the page's prose is found in a results file, so a figure typed by hand, or left from an
earlier run, fails there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.tools import EXPORT, EXPORT_NO_VERIFY, EXPORT_THROUGH_TORCH

RESULTS = Path(__file__).resolve().parent / "results"


def load(name: str) -> dict[str, Any]:
    """A results file of ``benchmarks/results`` (``results.json``, ``scale.json``, ``partial_load.json``)."""
    return json.loads((RESULTS / name).read_text())  # type: ignore[no-any-return]


def _pair(a: float, b: float, digits: int) -> str:
    return f"{a:.{digits}f} / {b:.{digits}f}"


def targets_table(report: dict[str, Any], scale: dict[str, Any]) -> str:
    """Issue 34's targets, each with this run's figure."""
    tp = report["throughput"]["ratios"]
    rows = report["async"]["rows"]
    mp, fsdp = "ShardedModelParallelStrategy async_save=True", "ShardedFSDPStrategy async_save=True"

    def stall(suffix: str) -> tuple[float, float, float, float, float, float]:
        a, b = rows[mp + suffix], rows[fsdp + suffix]
        return (
            a["stall / sync save"],
            b["stall / sync save"],
            a["stall s"] * 1e3,
            b["stall s"] * 1e3,
            a["sync save s"],
            b["sync save s"],
        )

    big, small, through = stall(""), stall(", 50 MB"), stall(", 50 MB, ModelCheckpoint")
    n = max(scale["sizes"])
    ours_at_n = scale["local"][str(n)]["ours"]
    index_bytes = ours_at_n["layout_bytes"] + ours_at_n["rank_index_bytes"]  # the layout and its own file
    index_cpu = ours_at_n["load"][str(n - 1)]["cpu_s"]
    training = report["training"]["ratios"]
    tools = report["tools"]
    consolidate = tools["rows"]["consolidate"]["seconds"]

    def met(value: float, bar: float, below: bool = False) -> str:
        return "yes" if (value <= bar if below else value >= bar) else "no"

    lines = [
        "| target | this run | met |",
        "|---|---|---|",
        f"| FSDP2 resume / faithful cold read, >= 0.85 | **{tp['ours-mp: load / disk read']:.2f}**"
        f" ({tp['ours-mp: load / new-memory read']:.2f} of the read into new memory)"
        f" | {met(tp['ours-mp: load / disk read'], 0.85)} |",
        f"| FSDP1 resume / faithful cold read, >= 0.8 | **{tp['ours-fsdp: load / disk read']:.2f}**"
        f" ({tp['ours-fsdp: load / new-memory read']:.2f}) | {met(tp['ours-fsdp: load / disk read'], 0.8)} |",
        f"| async stall / sync save, 2 GB, <= 0.05 (FSDP2 / FSDP1) | **{_pair(big[0], big[1], 3)}**"
        f" ({_pair(big[2], big[3], 1)} ms against {_pair(big[4], big[5], 2)} s)"
        f" | {met(max(big[:2]), 0.05, below=True)} |",
        f"| async stall / sync save, 50 MB, <= 0.10 (FSDP2 / FSDP1) | **{_pair(small[0], small[1], 3)}**"
        f" ({_pair(small[2], small[3], 1)} ms against {_pair(small[4], small[5], 3)} s)"
        f" | {met(max(small[:2]), 0.10, below=True)} |",
        "| the same through `ModelCheckpoint(every_n_train_steps=1, save_top_k=1)`, 50 MB"
        f" | {_pair(through[0], through[1], 3)} ({_pair(through[2], through[3], 1)} ms against"
        f" {_pair(through[4], through[5], 2)} s) | (no target) |",
        f"| a loading rank's index at {n:,} ranks: bytes, CPU s | **{index_bytes:,} B, {index_cpu:.3f} s**"
        " | yes: [constant in N](#the-per-rank-index-issue-34-item-4) |",
        "| saves / faithful write (FSDP2 / FSDP1) | "
        + _pair(tp["ours-mp: save / disk write"], tp["ours-fsdp: save / disk write"], 2)
        + " | (a bar, not a target) |",
        "| training while saving, 512 rows (MP / FSDP) | "
        + _pair(
            training[
                "ShardedModelParallelStrategy, 512 rows per step (matmul-bound): while saving / without"
            ],
            training["ShardedFSDPStrategy, 512 rows per step (matmul-bound): while saving / without"],
            2,
        )
        + " | |",
        f"| `dcp.async_save` stall / its sync save (stock torch)"
        f" | {rows['dcp.async_save (stock torch)']['stall / sync save']:.3f} | |",
        f"| `consolidate` GB/s / the faithful disk copy, >= 0.8 |"
        f" **{tools['ratios']['consolidate GB/s / disk copy']:.2f}** ({consolidate:.2f} s; through torch"
        f" {tools['ratios']['consolidate through torch GB/s / disk copy']:.2f})"
        f" | {met(tools['ratios']['consolidate GB/s / disk copy'], 0.8)} |",
        f"| `consolidate --format safetensors` GB/s / the faithful disk copy, >= 0.8 |"
        f" **{tools['ratios'][f'{EXPORT} GB/s / disk copy']:.2f}** ({tools['rows'][EXPORT]['seconds']:.2f} s;"
        f" `--no-verify` {tools['ratios'][f'{EXPORT_NO_VERIFY} GB/s / disk copy']:.2f}; through torch"
        f" {tools['ratios'][f'{EXPORT_THROUGH_TORCH} GB/s / disk copy']:.2f})"
        f" | {met(tools['ratios'][f'{EXPORT} GB/s / disk copy'], 0.8)} |",
    ]
    return "\n".join(lines)


NAIVE = "state_dict ratio, torch's naive hook"


def hooks_table(report: dict[str, Any]) -> str:
    """The hooks' overhead, from ``benchmarks.run``'s run of ``benchmarks.hooks_overhead``."""
    lines = [
        "| case | `state_dict()` hooked / plain | ratio of the medians | `load_state_dict()` hooked / plain"
        " | torch's ShardedTensor hook (naive walk) |",
        "|---|---|---|---|---|",
    ]
    for case, row in report["hooks"]["rows"].items():
        lines.append(
            f"| {case} | **{row['state_dict ratio']:.2f}** | {row['state_dict ratio of the medians']:.2f}"
            f" | {row['load ratio']:.2f} | {row[NAIVE]:.2f} |"
        )
    return "\n".join(lines)


def _peak(value: float) -> str:
    return f"{value / 1e3:.0f} KB" if value < 1e6 else f"{value / 1e6:.1f} MB"


def index_table(scale: dict[str, Any]) -> str:
    """Rank N-1's load, local directory: ours against ours without the per-rank index and stock."""
    from benchmarks.scale.report import collectives, growth, rank_figures

    sizes = sorted(int(n) for n in scale["local"])

    def last(impl: str, at: int) -> dict[str, Any]:
        return rank_figures(scale["local"][str(at)], impl, "load", last=True)

    def row(label: str, values: list[float], shown: Any) -> str:
        cells = " | ".join(shown(v) for v in values)
        return f"| {label} | {cells} | {growth(sizes, values)} |"

    def each(value: Any) -> list[float]:
        return [float(value(n)) for n in sizes]

    ours = scale["local"]

    def sent_and_received(impl: str) -> list[float]:  # ours and DCP's
        return [float(collectives(last(impl, n))[1] + collectives(last(impl, n), "dcp")[1]) for n in sizes]

    lines = [
        "| rank N-1's load | " + " | ".join(f"N={n}" for n in sizes) + " | growth |",
        "|---|" + "---:|" * len(sizes) + "---|",
        row(
            "index bytes, ours (layout + its own index file)",
            each(lambda n: ours[str(n)]["ours"]["layout_bytes"] + ours[str(n)]["ours"]["rank_index_bytes"]),
            lambda v: f"{v:,.0f}",
        ),
        row(
            "index bytes, ours without the per-rank index (`.metadata`, broadcast)",
            each(lambda n: ours[str(n)]["ours"]["metadata_bytes"]),
            lambda v: f"{v:,.0f}",
        ),
        row(
            "index bytes, stock (`.metadata`, read by each of its 2 loads)",
            each(lambda n: 2 * ours[str(n)]["stock"]["metadata_bytes"]),
            lambda v: f"{v:,.0f}",
        ),
        *(
            row(f"CPU s, {label}", each(lambda n, i=impl: last(i, n)["cpu_s"]), lambda v: f"{v:.3f}")
            for label, impl in (
                ("ours", "ours"),
                ("ours without the per-rank index", "ours-whole"),
                ("stock", "stock"),
            )
        ),
        *(
            row(f"Python peak, {label}", each(lambda n, i=impl: last(i, n)["peak_python_bytes"]), _peak)
            for label, impl in (
                ("ours", "ours"),
                ("ours without the per-rank index", "ours-whole"),
                ("stock", "stock"),
            )
        ),
        row(
            "collective bytes (sent and received; ours and DCP's), ours",
            sent_and_received("ours"),
            lambda v: f"{v:,.0f}",
        ),
        row(
            "collective bytes, ours without the per-rank index",
            sent_and_received("ours-whole"),
            lambda v: f"{v:,.0f}",
        ),
    ]
    return "\n".join(lines)


def read_bytes(report: dict[str, Any]) -> str:
    """What each rank of our FSDP2 resume read, as the page's prose gives it."""
    rank0, rank1 = report["disk"]["read bytes per rank"]["ours-mp"]
    return f"{(rank0 + rank1) / 2e9:.4f} GB per rank (rank 0 {rank0:,} bytes, rank 1 {rank1:,})"


def run_line(report: dict[str, Any]) -> str:
    """The published run's length and load, as the targets' section opens with them."""
    load = report["load"]
    return f"{report['seconds']:.0f} s; load average at its end {load['1 min']:.1f} / {load['5 min']:.1f}"


def pieces() -> dict[str, str]:
    """Every piece of text the page must hold, by name."""
    report, scale = load("results.json"), load("scale.json")
    return {
        "targets table": targets_table(report, scale),
        "hooks table": hooks_table(report),
        "per-rank index table": index_table(scale),
        "read bytes": read_bytes(report),
        "run line": run_line(report),
    }


def main() -> int:
    """Print every piece."""
    for name, text in pieces().items():
        print(f"--- {name}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
