"""examples/strategies_resume.py runs as users run it (Lightning starts the second process itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import REPO, rank_env

_RANK_VARIABLES = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_PORT",
}


@pytest.mark.slow
def test_fsdp1_checkpoint_resumes_under_fsdp2_example(tmp_path: Path) -> None:
    env = {k: v for k, v in rank_env(0, 1, 0).items() if k not in _RANK_VARIABLES}
    out = subprocess.run(
        [sys.executable, str(REPO / "examples/strategies_resume.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "OK: FSDP1 checkpoint fsdp1.ckpt resumed under FSDP2, table (10, 4) exact" in out.stdout
    assert (tmp_path / "fsdp1.ckpt" / ".metadata").is_file()
