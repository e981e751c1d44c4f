"""The report of ``benchmarks.run`` as text: the console table, the markdown tables, ``docs/benchmarks.md``.

:func:`markdown` is what ``results.md`` holds and what a full run puts into ``docs/benchmarks.md``
between :data:`BEGIN` and :data:`END` (:func:`update_docs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import names
from benchmarks.disk import NEW_MEMORY_READ, PROBES, READ, WRITE
from benchmarks.profile import GROUPS, THREADS
from benchmarks.report import PAIRED_READ, PAIRED_WRITE, probe_count

#: The tables of ``docs/benchmarks.md`` sit between these lines; a full run rewrites them.
BEGIN, END = "<!-- results: written by benchmarks/run.py -->", "<!-- end of results -->"


def _bar(value: float) -> str:
    """A ratio against a bar of the disk: above 1.0 it is not a result but something to investigate."""
    return f"{value:.2f}" + (" (above the bar)" if value > 1.0 else "")


def table(report: dict[str, Any]) -> str:
    """The console's summary of a report."""
    raw, config = report["disk"], report["config"]
    lines = [
        f"checkpoint: {config['checkpoint GB']:.2f} GB (model + Adam), {config['ranks']} ranks, CPU, gloo;"
        f" disk (the checkpoint's own files, as a save or resume must at best): write {raw[WRITE.name]:.2f}"
        f" GB/s, cold read {raw[READ.name]:.2f} GB/s, into the resume's memory"
        f" {raw[NEW_MEMORY_READ.name]:.2f} GB/s",
        "",
        f"{'probe':<30}{'GB/s':>7}{'fsync s':>9}{'dirty GB':>10}",
    ]
    for probe in PROBES:
        details = raw["probes"][probe.name]
        fsync, dirty = details.get("fsync s"), details.get("dirty at fsync GB")
        lines.append(
            f"{probe.short + (' (bar)' if probe.bar else ''):<30}{raw[probe.name]:>7.2f}"
            + (f"{fsync:>9.2f}{dirty:>10.2f}" if fsync is not None and dirty is not None else "")
        )
    lines += [
        "",
        f"{'save / load':<38}{'save GB/s':>10}{'/ disk':>8}{'load GB/s':>11}{'/ disk':>8}{'/ new mem':>11}"
        f"{'resume x stock':>16}",
    ]
    for name, r in report["throughput"]["rows"].items():
        speed = r.get("resume speedup vs stock")
        lines.append(
            f"{names.label(name):<38}{r['save GB/s']:>10.2f}{r[WRITE.ratio]:>8.2f}"
            f"{r['load GB/s']:>11.2f}{r[READ.ratio]:>8.2f}{r[NEW_MEMORY_READ.ratio]:>11.2f}"
            f"{(f'{speed:.2f}' if speed else '-'):>16}"
        )
    for above in report["throughput"].get("above the bars", []):
        lines.append(f"ABOVE THE DISK'S BAR (investigate, not a result): {above}")
    lines += ["", f"{'async save':<76}{'sync s':>8}{'stall s':>9}{'stall / sync':>14}"]
    for name, r in report["async"]["rows"].items():
        lines.append(f"{name:<76}{r['sync save s']:>8.3f}{r['stall s']:>9.4f}{r['stall / sync save']:>14.3f}")
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
    for label, profiles in report["profile"]["rows"].items():
        groups = ", ".join(
            f"{group} {max(p['groups'][group] for p in profiles):.2f}"
            for group in GROUPS
            if any(p["groups"][group] > 0.005 for p in profiles)
        )
        lines.append(f"resume profile, {label} (s, slowest rank): {groups}")
    for problem in report["profile"]["problems"]:
        lines.append(f"PROFILE DOES NOT ADD UP: {problem}")
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

    rows = report["throughput"]["rows"]
    ours = [case for case in names.STOCK if case in rows]
    out = [
        f"The disk, doing what a save and a resume of this checkpoint must do, at best, on its own files"
        f" (both ranks at once, median of {probe_count(raw)} probes; checkpoint"
        f" {report['config']['checkpoint GB']:.2f} GB): write **{raw[WRITE.name]:.2f} GB/s**, cold read"
        f" **{raw[READ.name]:.2f} GB/s**, cold read into memory laid out as the resume's"
        f" **{raw[NEW_MEMORY_READ.name]:.2f} GB/s**. Each probe, and what our saves and resumes make of it"
        " (the bars are the first of each kind; the others explain them):",
        "",
        *_md_table(
            [
                "probe",
                "GB/s",
                "fsync s (slowest rank)",
                "dirty page cache at the fsync GB",
                *(f"{names.short(case)} / it" for case in ours),
                "what it does",
            ],
            [
                [
                    f"**{probe.short}** (the bar)" if probe.bar else probe.short,
                    f"{raw[probe.name]:.2f}",
                    f"{d['fsync s']:.2f}" if "fsync s" in (d := raw["probes"][probe.name]) else "-",
                    f"{d['dirty at fsync GB']:.2f}" if "dirty at fsync GB" in d else "-",
                    *(f"{rows[case][probe.ratio]:.2f}" for case in ours),
                    probe.what,
                ]
                for probe in PROBES
            ],
        ),
        "",
        "What each rank read on a resume (recorded from the real resumes; what the read probes read): "
        + "; ".join(
            f"{names.label(case) if case in names.NAMES else case} "
            + " / ".join(f"{b / 1e9:.3f}" for b in rank_bytes)
            + " GB"
            for case, rank_bytes in raw["read bytes per rank"].items()
        )
        + ".",
        "",
        *_md_table(
            [
                "save / load",
                "save GB/s",
                "save / disk write",
                "save / its own write",
                "load GB/s",
                "load / disk read",
                "load / its own read",
                "load / read into the resume's memory",
                "resume vs stock",
            ],
            [
                [
                    names.label(name),
                    f"{r['save GB/s']:.2f}",
                    _bar(r[WRITE.ratio]),
                    f"{r[PAIRED_WRITE]:.2f}" if PAIRED_WRITE in r else "-",
                    f"{r['load GB/s']:.2f}",
                    _bar(r[READ.ratio]),
                    f"{r[PAIRED_READ]:.2f}" if PAIRED_READ in r else "-",
                    f"{r[NEW_MEMORY_READ.ratio]:.2f}",
                    ratio_x(r.get("resume speedup vs stock")),
                ]
                for name, r in rows.items()
            ],
        ),
    ]
    above = report["throughput"].get("above the bars", [])
    if above:
        out += [
            "",
            "Above the disk's bar, so not a result but a figure to investigate (docs/benchmarks.md, \"The"
            ' faithful limit"): ' + "; ".join(above) + ".",
        ]
    out += [
        "",
        *_md_table(
            ["async save", "sync save s", "stall s", "stall / sync save", "first stall s"],
            [
                [
                    name,
                    f"{r['sync save s']:.3f}",
                    f"{r['stall s']:.4f}",
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
            ' `--no-verify` does not checksum it; "disk copy", its bar, is the source read cold and'
            " written into one file of the output's size, as a copy must at best; `export safetensors` is"
            " `consolidate --format safetensors` of the model's weights, uncast, against the same copy into"
            f" a file of the weights' size ({tools.get('export bytes', 0) / 1e9:.2f} GB); the last row is"
            " the bar before issue 34, a plain write that `consolidate` beat):",
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
            *_md_table(
                ["tools ratio", "value"],
                [
                    [name, _bar(v) if "disk copy" in name else f"{v:.2f}"]
                    for name, v in tools["ratios"].items()
                ],
            ),
        ]
    out += _profile_table(report["profile"])
    load = report.get("load", {})
    if load:
        out += [
            "",
            f"Load average at the end of the run (`uptime`): {load['1 min']:.1f} / {load['5 min']:.1f}"
            f" / {load['15 min']:.1f}.",
        ]
    return "\n".join(out)


def _profile_table(profile: dict[str, Any]) -> list[str]:
    """The resume profile of every ``phases-*`` case: each group's own seconds on each rank, their sum
    against the wall time, then the read threads' seconds (which overlap the wait for them)."""
    cases = profile["rows"]
    if not cases:
        return []
    columns = [(label, rank) for label, profiles in cases.items() for rank in range(len(profiles))]

    def cells(value: Any) -> list[str]:
        return [f"{value(cases[label][rank]):.3f}" for label, rank in columns]

    shown = [g for g in GROUPS if any(cases[label][rank]["groups"][g] > 0 for label, rank in columns)]
    threaded = sorted({t for label, rank in columns for t in cases[label][rank]["threads"]})
    out = [
        "",
        "Where a resume's seconds go (`benchmarks.phases`: one cold resume per case, after the timed ones;"
        " each phase's own seconds on the rank's main thread, less those of the timed phases it calls, so"
        " the phases add up to the restore's wall time; the read threads' seconds overlap the main"
        " thread's wait for them and are not in the sum):",
        "",
        *_md_table(
            ["resume, seconds", *(f"{names.shorten(label)}, rank {rank}" for label, rank in columns)],
            [
                *([group, *cells(lambda p, g=group: p["groups"][g])] for group in shown),
                ["**sum of the phases**", *cells(lambda p: p["sum s"])],
                ["**wall time of the restore**", *cells(lambda p: p["wall s"])],
                *([f"{THREADS}: {t}", *cells(lambda p, t=t: p["threads"].get(t, 0.0))] for t in threaded),
            ],
        ),
    ]
    if profile["problems"]:
        out += ["", "The profile does not add up: " + "; ".join(profile["problems"]) + "."]
    return out


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
