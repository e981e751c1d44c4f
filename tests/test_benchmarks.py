"""Smoke test of the benchmark suite: ``benchmarks/run.py --quick`` runs end to end (2 real ranks).

No timing assertions: only that every section is there and every ratio is a finite positive number.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
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


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_the_writer_experiment_writes_the_staged_bytes(tmp_path: Path, kind: str) -> None:
    """benchmarks/writers.py's thread and process write exactly the staged bytes (the work a save does),
    and a second save writes the buffers as staged again."""
    import torch

    sys.path.insert(0, str(REPO))
    from benchmarks.writers import Staged, make_writer

    tensors = [torch.arange(3 << 20, dtype=torch.float32), torch.ones(5, 7, dtype=torch.bfloat16)]
    staged, writer = Staged(), make_writer(kind)
    try:
        for version in (1, 2):
            new = staged.stage([t * version for t in tensors])
            assert new == (version == 1)  # the buffers are reused
            path = tmp_path / f"v{version}.bin"
            writer.start(staged, str(path), new)
            while writer.writing:
                time.sleep(0.01)
            expected = b"".join(bytes((t * version).reshape(-1).view(torch.uint8).numpy()) for t in tensors)
            assert path.read_bytes() == expected
    finally:
        writer.close()
