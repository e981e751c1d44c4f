"""The report of ``benchmarks.run`` as text: the console table, the markdown tables, ``docs/benchmarks.md``.

:func:`markdown` is what ``results.md`` holds and what a full run puts into ``docs/benchmarks.md``
between :data:`BEGIN` and :data:`END` (:func:`update_docs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import names
from benchmarks.report import probe_count

#: The tables of ``docs/benchmarks.md`` sit between these lines; a full run rewrites them.
BEGIN, END = "<!-- results: written by benchmarks/run.py -->", "<!-- end of results -->"


def table(report: dict[str, Any]) -> str:
    """The console's summary of a report."""
    raw, config = report["disk"], report["config"]
    lines = [
        f"checkpoint: {config['checkpoint GB']:.2f} GB (model + Adam), {config['ranks']} ranks, CPU, gloo;"
        f" disk raw write+fsync {raw['write GB/s']:.2f} GB/s, cold read {raw['read GB/s']:.2f} GB/s,"
        f" into new memory {raw['new-memory read GB/s']:.2f} GB/s",
        "",
        f"{'save / load':<38}{'save GB/s':>10}{'/ raw':>7}{'load GB/s':>11}{'/ raw':>7}{'/ new mem':>11}"
        f"{'resume x stock':>16}",
    ]
    for name, r in report["throughput"]["rows"].items():
        speed = r.get("resume speedup vs stock")
        lines.append(
            f"{names.label(name):<38}{r['save GB/s']:>10.2f}{r['save / raw write']:>7.2f}"
            f"{r['load GB/s']:>11.2f}{r['load / raw read']:>7.2f}{r['load / new-memory read']:>11.2f}"
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
        f"Disk, probed the same way (both ranks at once, median of {probe_count(raw)} probes):"
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
                    names.label(name),
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
