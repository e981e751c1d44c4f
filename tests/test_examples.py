"""The examples run as users run them (Lightning starts the extra processes itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import REPO, launcher_env


@pytest.mark.slow
def test_mixin_under_ddp_two_processes(tmp_path: Path) -> None:
    env = launcher_env()
    out = subprocess.run(
        [sys.executable, str(REPO / "examples/mixin_ddp.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "OK: table (10, 4) sharded over 2 ranks restored exactly" in out.stdout
