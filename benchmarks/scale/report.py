"""The tables and plot of ``benchmarks.scale``: what grows with N, from the counts of each rank's run.

:func:`rows` is the one list of the table's rows (label, value at each N); :func:`markdown` writes them
with their fitted growth, :func:`plot` draws some of them. A new figure is one ``add`` there.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The files every rank needs (and the directories): a rank's operations on them must not grow with N.
SHARED = (".metadata", "meta.pt", "manifest", "index layout", "directory")
#: The per-rank index files (``index/rank-<k>.json``): a rank's own and the others'.
INDEXES = ("own index", "other indexes")


def total(
    figures: dict[str, Any], section: str, *, who: str = "ours", classes: tuple[str, ...] = SHARED
) -> int:
    """Operations of ``who`` on files of ``classes`` in one rank's run (``section``: files or s3)."""
    return sum(
        n
        for kinds in figures.get(section, {}).get(who, {}).values()
        for cls, n in kinds.items()
        if cls in classes
    )


def collectives(figures: dict[str, Any], who: str = "ours") -> tuple[int, int]:
    entries = figures.get("collectives", {}).get(who, {}).values()
    return sum(n for n, _ in entries), sum(b for _, b in entries)


def growth(sizes: list[int], values: list[float]) -> str:
    """The fitted growth of ``values`` against N: the log-log slope, named."""
    points = [(math.log(n), math.log(v)) for n, v in zip(sizes, values, strict=True) if v > 0]
    if len(points) < 2 or all(v == values[0] for v in values):
        return "constant"
    xs, ys = zip(*points, strict=True)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0
    name = (
        "constant"
        if slope < 0.15
        else "sublinear"
        if slope < 0.8
        else "linear"
        if slope < 1.25
        else "superlinear"
    )
    return f"{name} (N^{slope:.2f})"


def rank_figures(at_n: dict[str, Any], impl: str, phase: str, last: bool) -> dict[str, Any]:
    """One rank's figures of ``impl``'s ``phase`` at one N: rank 0's, or rank N-1's if ``last``."""
    ranks: dict[str, dict[str, Any]] = at_n[impl][phase]
    return ranks[max(ranks, key=int) if last else "0"]


#: The per-rank rows: (label, value from ``of(impl)``, that rank's figures of the implementation).
Of = Callable[[str], dict[str, Any]]
PER_RANK: list[tuple[str, Callable[[Of, str], float]]] = [
    ("ours, shared-file ops", lambda of, section: total(of("ours"), section)),
    ("DCP, shared-file ops", lambda of, section: total(of("ours"), section, who="dcp")),
    (
        "stock, shared-file ops",
        lambda of, section: total(of("stock"), section, who="dcp") + total(of("stock"), section, who="other"),
    ),
    (
        "ours, all ops",
        lambda of, section: total(
            of("ours"), section, classes=(*SHARED, "own shard", "other shards", *INDEXES)
        ),
    ),
    ("ours, collectives", lambda of, section: collectives(of("ours"))[0]),
    ("ours, collective bytes", lambda of, section: collectives(of("ours"))[1]),
    ("DCP, collective bytes", lambda of, section: collectives(of("ours"), "dcp")[1]),
    ("ours, Python peak bytes", lambda of, section: of("ours")["peak_python_bytes"]),
    ("ours, CPU s", lambda of, section: of("ours")["cpu_s"]),
    ("stock, CPU s", lambda of, section: of("stock")["cpu_s"]),
]


#: The load of a checkpoint without the per-rank index (``ours-whole``), beside ours.
PER_RANK_WHOLE: list[tuple[str, Callable[[Of, str], float]]] = [
    (
        "ours without the per-rank index, collective bytes",
        lambda of, section: collectives(of("ours-whole"))[1],
    ),
    (
        "ours without the per-rank index, Python peak bytes",
        lambda of, section: of("ours-whole")["peak_python_bytes"],
    ),
    ("ours without the per-rank index, CPU s", lambda of, section: of("ours-whole")["cpu_s"]),
]


def rows(report: dict[str, Any], backend: str) -> list[tuple[str, list[float]]]:
    """The table's rows for one backend: (label, value at each N); a row not measured is left out."""
    per_n = report[backend]
    sizes = sorted(int(n) for n in per_n)
    section = "s3" if backend == "s3" else "files"
    out: list[tuple[str, list[float]]] = []

    def add(label: str, value: Callable[[dict[str, Any]], float]) -> None:
        with contextlib.suppress(KeyError):
            out.append((label, [float(value(per_n[str(n)])) for n in sizes]))

    def per_rank(
        value: Callable[[Of, str], float], phase: str, last: bool
    ) -> Callable[[dict[str, Any]], float]:
        def at(at_n: dict[str, Any]) -> float:
            return value(lambda impl: rank_figures(at_n, impl, phase, last), section)

        return at

    for phase in ("save", "load"):
        for rank_label, last in (("rank 0", False), ("rank N-1", True)):
            for name, value in PER_RANK:
                add(f"{phase} {rank_label}: {name}", per_rank(value, phase, last))
    # The index a loading rank gets: ours, its part (the layout, broadcast by rank 0, and its own
    # file); without the per-rank index (a checkpoint of an earlier version), DCP's whole `.metadata`
    # broadcast; stock, `.metadata` read from storage by each of its two dcp.load calls.
    add(
        "load rank N-1: ours, index bytes (layout + its own index file)",
        lambda at_n: float(at_n["ours"]["layout_bytes"] + at_n["ours"]["rank_index_bytes"]),
    )
    add(
        "load rank N-1: ours without the per-rank index, index bytes (.metadata)",
        lambda at_n: float(at_n["ours"]["metadata_bytes"]),
    )
    add(
        "load rank N-1: stock, index bytes (.metadata, read twice)",
        lambda at_n: float(2 * at_n["stock"]["metadata_bytes"]),
    )
    for name, value in PER_RANK_WHOLE:
        add(f"load rank N-1: {name}", per_rank(value, "load", True))
    add("manifest bytes", lambda at_n: float(at_n["ours"]["manifest_bytes"]))
    add(".metadata bytes", lambda at_n: float(at_n["ours"]["metadata_bytes"]))
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = []
    for backend in ("local", "s3"):
        if backend not in report:
            continue
        sizes = sorted(int(n) for n in report[backend])
        unit = "requests" if backend == "s3" else "operations"
        lines += [
            f"### {backend}: {unit} per rank",
            "",
            "| per rank | " + " | ".join(f"N={n}" for n in sizes) + " | growth |",
            "|---|" + "---:|" * len(sizes) + "---|",
        ]
        for label, values in rows(report, backend):
            if label.endswith("bytes") and not any(values):
                continue  # not measured there
            shown = [
                f"{v:.3f}" if isinstance(v, float) and not v.is_integer() else f"{int(v)}" for v in values
            ]
            lines.append(f"| {label} | " + " | ".join(shown) + f" | {growth(sizes, values)} |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    sizes = sorted(int(n) for n in report["local"])
    table = dict(rows(report, "local"))
    # (panel title, the series drawn, the least value drawn: a log scale cannot show 0)
    panels: list[tuple[str, tuple[str, ...], float]] = [
        (
            "file-system operations per rank (0 drawn at 0.5)",
            (
                "load rank N-1: ours, shared-file ops",
                "load rank 0: ours, shared-file ops",
                "save rank N-1: ours, shared-file ops",
                "save rank 0: ours, shared-file ops",
                "load rank N-1: stock, shared-file ops",
                "load rank 0: ours, all ops",
                "load rank N-1: ours, all ops",
            ),
            0.5,
        ),
        (
            "CPU seconds of one rank's save / load",
            (
                "save rank 0: ours, CPU s",
                "load rank 0: ours, CPU s",
                "save rank N-1: ours, CPU s",
                "load rank N-1: ours, CPU s",
                "save rank 0: stock, CPU s",
            ),
            -math.inf,
        ),
        (
            "bytes",
            (
                "save rank 0: ours, collective bytes",
                "load rank N-1: ours, collective bytes",
                "load rank N-1: DCP, collective bytes",
                "manifest bytes",
                ".metadata bytes",
            ),
            1,
        ),
    ]
    for ax, (title, labels, least) in zip(axes, panels, strict=True):
        for label in labels:
            if label in table:
                ax.plot(sizes, [max(v, least) for v in table[label]], marker="o", label=label)
        ax.set_title(title)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size N")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
