"""The chart of ``benchmarks.run`` (``results.png``): one panel per question, each against its target."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks import names
from benchmarks.disk import NEW_MEMORY_READ, READ, WRITE

#: A panel: (question, {bar label: value}, target or None, which way is better: "higher" / "lower").
Panel = tuple[str, dict[str, float], float | None, str]


def panels(report: dict[str, Any]) -> list[Panel]:
    """(question, {bar label: value}, target, which way is better) for each panel of the chart."""
    rows = report["throughput"]["rows"]
    out: list[Panel] = []
    speedups = {
        names.short(ours) + " vs " + names.short(stock): rows[ours]["resume speedup vs stock"]
        for ours, stock in names.STOCK.items()
        if ours in rows and "resume speedup vs stock" in rows[ours]
    }
    out.append(("Resume: how many times faster than stock?", speedups, 2.0, "higher"))
    disk = report["disk"]
    out.append(
        (
            "Resume: fraction of the disk's cold read of the same bytes",
            {names.short(n): r[READ.ratio] for n, r in rows.items()}
            # The same reads into memory laid out as a resume's, nothing around them.
            | {"bare read into the resume's memory": disk[NEW_MEMORY_READ.name] / disk[READ.name]},
            0.85,
            "higher",
        )
    )
    out.append(
        (
            "Save: fraction of the disk's write of the same files",
            {names.short(n): r[WRITE.ratio] for n, r in rows.items()},
            None,
            "higher",
        )
    )
    saves = {
        names.short(ours) + " vs " + names.short(stock): rows[ours]["save speedup vs stock"]
        for ours, stock in names.STOCK.items()
        if ours in rows and "save speedup vs stock" in rows[ours]
    }
    out.append(("Save: how many times faster than stock?", saves, 1.0, "higher"))
    out.append(
        (
            "Async save: training stall / sync save",
            {names.shorten(n): r["stall / sync save"] for n, r in report["async"]["rows"].items()},
            0.10,
            "lower",
        )
    )
    out.append(
        (
            "Training steps/s while an async save runs / without",
            {names.shorten(n): r["while saving / without"] for n, r in report["training"]["rows"].items()},
            0.9,
            "higher",
        )
    )
    out.append(
        (
            "load with checksums / plain load",
            {
                f"{names.shorten(n)} {mode}": r[key]
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
            "consolidate throughput / the disk's copy of the same bytes",
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
            {
                names.shorten(n): r["peak / (shard + largest tensor)"]
                for n, r in report["memory"]["rows"].items()
            },
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
        # A run of a few cases (--cases) has no figure for some bars: they are left out, not drawn as NaN.
        labels = [k for k in bars if math.isfinite(bars[k])]
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
    load, config = report.get("load", {}), report["config"]
    fig.suptitle(
        f"{config['checkpoint GB']:.1f} GB checkpoint (model + Adam), {config['ranks']} ranks, CPU;"
        f" ratios against baselines of the same run; load average {load.get('1 min', 0):.1f}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
