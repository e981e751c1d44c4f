"""Every figure of docs/benchmarks.md comes from a results file of ``benchmarks/results``.

The generated parts must be what their generator makes of the results files: the tables between the
results markers (``benchmarks.tables.markdown`` of ``results.json``), the scale tables
(``benchmarks.scale.report.markdown`` of ``scale.json``), the partial-load tables
(``benchmarks.partial_load.tables`` of ``partial_load.json``) and the pieces of ``benchmarks.prose`` (the
targets table, the hooks table, each rank's read bytes, the run's length). Every other number of the
page's prose and tables is then looked up in the results files: it passes where some value of them,
in some unit (bytes to KB/MB/GB/MiB/KiB, seconds to ms, a fraction as a percentage), rounds to it at
the decimals the page shows. Not figures, and not looked up: code (fenced blocks and inline code),
link targets, issue numbers, dates, versions and targets (``>= 0.85``, ``<= 0.10``).

The lookup is a net, not a proof: a figure of few digits may meet some value of the files by chance,
which is why every figure of the page that matters is generated (the parts above, compared exactly).
``python -m tests.test_benchmark_figures`` prints every number the lookup does not find, with its line;
on the page before issue 44 it found 54, ``rank 0 1,006,747,964 bytes`` among them.
"""

from __future__ import annotations

import json
import re
import sys
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal, InvalidOperation
from functools import cache
from typing import Any

from benchmarks import partial_load, prose, tables
from benchmarks.scale import report as scale_report
from tests.distributed.launch import REPO

PAGE = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "benchmarks" / "results"
#: Units a figure of the page may be in, against the unit of the results files' values.
FACTORS = (1, 1e3, 1e-3, 1e-6, 1e-9, 2.0**-10, 2.0**-20, 100)
#: What is not a figure: code, link targets, issue numbers, dates, versions, targets.
NOT_FIGURES = (
    re.compile(r"```.*?```", re.S),
    re.compile(r"`[^`\n]+`"),
    re.compile(r"\]\([^)]*\)"),
    re.compile(r"\bissues? \d+(, item \d+)?"),
    re.compile(r"\bcommit [0-9a-f]{7,}"),
    re.compile(r"\b\d{4}-\d{2}-\d{2}\b"),
    re.compile(r"\b(torch|Lightning) \d+\.\d+(\.\d+)?"),
    re.compile(r"[<>]= ?\d[\d.,]*x?"),
)
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?![\w.]*\d)")


def report() -> dict[str, Any]:
    return json.loads((RESULTS / "results.json").read_text())  # type: ignore[no-any-return]


def scale() -> dict[str, Any]:
    return json.loads((RESULTS / "scale.json").read_text())  # type: ignore[no-any-return]


def generated() -> dict[str, str]:
    """Every generated part of the page, by name: what its generator makes of the results files."""
    parts = {"results tables": tables.markdown(report()).strip()}
    for i, table in enumerate(t for t in scale_report.markdown(scale()).split("\n\n") if t.startswith("|")):
        parts[f"scale table {i}"] = table.strip()
    pl = json.loads((RESULTS / "partial_load.json").read_text())
    for i, part in enumerate(
        partial_load.tables(pl["reads"], pl["sizes"], pl["read_ahead_kb"]).split("\n\n")
    ):
        parts[f"partial-load part {i}"] = part.strip()
    parts.update({f"prose: {name}": text for name, text in prose.pieces().items()})
    return parts


def _values() -> list[float]:
    values: list[float] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(key)
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            values.append(float(node))
        elif isinstance(node, str):
            values.extend(float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", node))

    for path in sorted(RESULTS.rglob("*")):  # results/8gb/ too (the 8 GB case)
        if path.suffix == ".json":
            walk(json.loads(path.read_text()))
        elif path.suffix in (".md", ".txt"):
            walk(path.read_text())
    return values


@cache
def known(decimals: int) -> frozenset[Decimal]:
    """Every value of the results files, in every unit of :data:`FACTORS`, rounded to ``decimals``."""
    step = Decimal(1).scaleb(-decimals)
    found = set()
    for value in _values():
        for factor in FACTORS:
            for rounding in (ROUND_HALF_UP, ROUND_HALF_EVEN):  # as printed by hand, and by Python
                try:
                    found.add(Decimal(repr(value * factor)).quantize(step, rounding=rounding))
                except InvalidOperation:  # too large for the context at this many decimals
                    continue
    return frozenset(found)


def unfound(page: str) -> list[tuple[int, str]]:
    """``(line, number)`` of each number of ``page`` outside its generated parts that no results file has."""
    for part in generated().values():
        page = page.replace(part, "\n" * part.count("\n"))
    if tables.BEGIN in page:
        begin, end = page.index(tables.BEGIN), page.index(tables.END)
        page = page[:begin] + "\n" * page[begin:end].count("\n") + page[end:]
    for pattern in NOT_FIGURES:
        page = pattern.sub(lambda m: "\n" * m.group(0).count("\n"), page)
    missing = []
    for match in NUMBER.finditer(page):
        whole, fraction = match.group(1).replace(",", ""), match.group(2) or ""
        figure = Decimal(f"{whole}.{fraction}" if fraction else whole)
        if figure not in known(len(fraction)):
            missing.append((page.count("\n", 0, match.start()) + 1, match.group(0)))
    return missing


def test_every_generated_part_of_the_page_is_what_its_generator_makes_of_the_results() -> None:
    page = PAGE.read_text()
    block = page.split(tables.BEGIN, 1)[1].split(tables.END, 1)[0].strip()
    assert block == generated()["results tables"], (
        "docs/benchmarks.md's results tables differ from benchmarks/results/results.json: a full"
        " `python -m benchmarks.run` writes both"
    )
    stale = [name for name, text in generated().items() if name != "results tables" and text not in page]
    assert not stale, (
        f"docs/benchmarks.md does not show {stale} as the results files give them: paste what"
        " `python -m benchmarks.prose` (or the benchmark's own --render/--out) prints"
    )


def test_every_other_figure_of_the_page_is_in_a_results_file() -> None:
    missing = unfound(PAGE.read_text())
    assert not missing, (
        "docs/benchmarks.md has figures that no file of benchmarks/results holds (line, figure):"
        f" {missing}. Take them from a results file, or commit the run's results with them"
    )


def test_the_lookup_finds_a_figure_of_the_results_and_misses_one_typed_by_hand() -> None:
    # a figure of the committed run (it changes with every run), and one a byte off it
    read = json.loads((RESULTS / "results.json").read_text())["disk"]["read bytes per rank"]["ours-mp"][0]
    assert unfound(f"rank 0 {read:,} bytes; 3.4 KB") == []
    assert unfound(f"rank 0 {read + 1:,} bytes") == [(1, f"{read + 1:,}")]


def main() -> int:
    """Print the numbers of the page that the lookup does not find."""
    for line, figure in unfound(PAGE.read_text()):
        print(f"docs/benchmarks.md:{line}: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
