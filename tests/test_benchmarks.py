"""Smoke test of the benchmark suite: ``benchmarks/run.py --quick`` runs end to end (2 real ranks).

No timing assertions: only that every section is there and every ratio is a finite positive number.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("throughput", "async", "memory", "hooks", "verify", "training", "tools")


@pytest.mark.slow
def test_quick_benchmark_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "run.py"),
            "--quick",
            "--out",
            str(out),
            "--dir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "results.json").read_text())
    assert (out / "results.png").stat().st_size > 0
    assert not report["errors"], report["errors"]
    for section in SECTIONS:
        ratios = report[section]["ratios"]
        assert ratios, f"section {section!r} has no ratios"
        bad = {k: v for k, v in ratios.items() if not (math.isfinite(v) and v > 0)}
        assert not bad, f"{section}: {bad}"
    rows = report["throughput"]["rows"]
    for case in ("torch", "dcp", "stock-mp", "stock-fsdp"):
        assert case in rows, f"no throughput figures for {case}"
    assert report["disk"]["write GB/s"] > 0 and report["disk"]["read GB/s"] > 0
    assert "ratio" in proc.stdout or "/ raw" in proc.stdout
