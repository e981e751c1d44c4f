"""Multi-node: two torchrun agents with a c10d rendezvous on loopback save a sharded checkpoint; one
node with two processes resumes it (a different number of nodes), values compared exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._compare import assert_restored
from tests.distributed.launch import run_torchrun

SCRIPT = Path(__file__).parent / "distributed" / "scenario_multinode.py"
STRATEGIES = ("mp", "fsdp")


@pytest.mark.slow
def test_two_nodes_save_one_node_resumes(tmp_path: Path) -> None:
    saved, restored = tmp_path / "saved", tmp_path / "restored"
    saved.mkdir()
    restored.mkdir()
    common = ("--strategy", ",".join(STRATEGIES), "--ckpt", str(tmp_path))
    run_torchrun(SCRIPT, 2, 1, "fit", *common, "--out", str(saved))
    run_torchrun(SCRIPT, 1, 2, "resume", *common, "--out", str(restored))
    for strategy in STRATEGIES:
        assert (tmp_path / f"{strategy}.ckpt").is_dir()
        before = torch.load(saved / f"{strategy}.pt", weights_only=False)
        after = torch.load(restored / f"{strategy}.pt", weights_only=False)
        assert "model.table" in before and any(k.startswith("opt0.") for k in before), strategy
        assert_restored(before, after)
