"""Shared fixtures: one run of the fault driver gives the crash cases and a clean 2-rank checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

DRIVER = Path(__file__).parent / "distributed" / "fault_driver.py"


@pytest.fixture(scope="session")
def fault_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``fault_driver.py OUT all``: ``OUT/template/ckpt`` (version 1, 2 ranks) and every crash case."""
    out = tmp_path_factory.mktemp("faults")
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(out), "all"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture
def sharded_ckpt(fault_run: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    """A private copy of a complete 2-rank sharded checkpoint (version 1 of ``fault_driver.expected``)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(fault_run[0] / "template" / "ckpt", dst)
    return dst
