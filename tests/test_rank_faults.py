"""A rank that dies or hangs mid-save or mid-load: the others raise within the checkpoint's timeout,
naming it; the previous checkpoint stays whole and the next save removes what the failed one left.

``tests/distributed/rank_fault_driver.py`` runs every case at once (3 ranks each, a 3 s timeout on
the checkpoint's gloo group; about 13 s in all); each test below checks one case.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_sharded import verify_checkpoint
from lightning_sharded.checkpoint.commit import leftovers
from lightning_sharded.checkpoint.presence import GRACE_S
from tests._compare import assert_version
from tests.distributed.rank_fault_driver import CASES, SLACK_S, TIMEOUT_S, WORLD_SIZE, expected

DRIVER = Path(__file__).parent / "distributed" / "rank_fault_driver.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("rank-faults")
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(out)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_others_name_the_rank_within_the_timeout(run: tuple[Path, dict[str, Any]], case: str) -> None:
    out, results = run
    operation, _, _, faulty = CASES[case]
    codes = results[case]["crash"]
    assert codes[faulty] == -9, codes  # it hung (then was killed) or killed itself
    hang = "kill" not in case
    for rank in (r for r in range(WORLD_SIZE) if r != faulty):
        assert codes[rank] == 4, codes
        result = json.loads((out / case / "crashed" / f"result.rank{rank}.json").read_text())
        message = result["message"]
        assert result["type"] == "RanksLost", message
        if faulty == 0 and not hang:  # rank 0 serves the job's store: its death is named from that
            assert "rank 0 most likely died" in message, message
        else:
            assert f"rank(s) {faulty} did not reach the checkpoint's step" in message, message
            assert f"within {TIMEOUT_S:g} s (dead, hung, or slower than the timeout" in message, message
        what = "Saving" if operation == "save" else "Loading"
        assert message.startswith(f"{what} the checkpoint '{out / case / 'crashed' / 'ckpt'}' failed"), (
            message
        )
        if hang:  # the checkpoint's timeout, not the process group's 30 minutes
            assert TIMEOUT_S * 0.9 <= result["elapsed"] <= TIMEOUT_S + SLACK_S, result
        else:  # a dead rank's connection closes at once
            assert result["elapsed"] <= GRACE_S + SLACK_S, result


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_previous_checkpoint_stays_whole(run: tuple[Path, dict[str, Any]], case: str) -> None:
    out, results = run
    ckpt = out / case / "crashed" / "ckpt"
    assert_version(ckpt, 1, expected(1))
    if CASES[case][0] == "load":  # a load changes nothing on disk
        assert leftovers(ckpt) == []
        return
    # what the failed save left is a staging directory only, which the next save removes
    assert all(p.name.startswith(".ckpt.staging-") for p in leftovers(ckpt)), leftovers(ckpt)
    assert results[case]["recover"] == [0] * WORLD_SIZE
    recovered = out / case / "recovered" / "ckpt"
    assert_version(recovered, 3, expected(3))
    assert leftovers(recovered) == []


# ----------------------------------------------------------------- through the strategy (Lightning)

SCENARIO = Path(__file__).parent / "distributed" / "scenario_timeout.py"
STRATEGY_TIMEOUT_S = 4.0


def test_the_strategy_s_checkpoint_timeout_bounds_a_save_and_a_resume(tmp_path: Path) -> None:
    """``checkpoint_timeout=4`` on ``ShardedModelParallelStrategy``: rank 1 hangs in ``save_checkpoint``
    (after writing its shards), or in the resume (before reading them); rank 0 raises naming it within
    the timeout, not the process group's 30 minutes, and exits."""
    import os
    import signal
    import time

    from lightning_sharded._launch import free_port
    from tests.distributed.launch import rank_env, run_ranks, start_rank

    ckpt = tmp_path / "ckpt"
    args = ["--ckpt", str(ckpt), "--timeout", str(STRATEGY_TIMEOUT_S)]
    run_ranks(SCENARIO, 2, "prepare", "--out", str(tmp_path / "prepare.json"), *args, timeout=120)
    before = sorted(p.name for p in tmp_path.iterdir())
    launches = {}
    for phase, fault in (("save", "after_write@1:hang"), ("resume", "before_read@1:hang")):
        port = free_port()
        argv = [str(SCENARIO), phase, "--out", str(tmp_path / f"{phase}.json"), *args]
        env = {"LIGHTNING_SHARDED_FAULT": fault}
        launches[phase] = [start_rank(argv, rank_env(r, 2, port, env)) for r in range(2)]
    deadline = time.monotonic() + 90
    for phase, (first, hung) in launches.items():
        try:
            first.communicate(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if hung.poll() is None:
                os.killpg(hung.pid, signal.SIGKILL)
            hung.communicate()
        assert first.returncode == 4, (phase, first.returncode)
        result = json.loads((tmp_path / f"{phase}.json").read_text())
        assert result["type"] == "RanksLost", result
        assert "rank(s) 1 did not reach the checkpoint's step" in result["message"], result
        assert f"within {STRATEGY_TIMEOUT_S:g} s" in result["message"], result
        assert result["elapsed"] <= STRATEGY_TIMEOUT_S + SLACK_S + 3, result  # a resume's setup included
    verify_checkpoint(ckpt)  # the save that failed left the one before whole
    assert all(p.name.startswith(".ckpt.staging-") for p in leftovers(ckpt))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".ckpt.staging-")) == sorted(
        [*before, "save.json", "resume.json"]
    )


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("broadcast_fails", [False, True], ids=["outcome-shared", "rank-0-lost"])
def test_an_interrupted_rank_raises_its_interrupt_whatever_the_publish_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupt: type[BaseException], broadcast_fails: bool
) -> None:
    """Ctrl-C (or ``sys.exit``) on a rank during a save ends the program there as it would without us:
    the rank re-raises its own interrupt, from rank 0's outcome or from the error of a broadcast whose
    rank 0 is gone, never a ``CheckpointError`` in its place."""
    from lightning_sharded.checkpoint import collective
    from lightning_sharded.checkpoint.backends import backend_for
    from lightning_sharded.checkpoint.commit import _Commit

    def broadcast(obj: Any, where: Any, step: str) -> Any:
        if broadcast_fails:
            raise RuntimeError("connection closed by peer")
        return obj

    monkeypatch.setattr(collective, "broadcast", broadcast)
    run = _Commit(tmp_path / "ckpt", backend_for(tmp_path / "ckpt"), collective.Ranks(1, 2, 0, None))
    run.error = interrupt()
    with pytest.raises(interrupt) as raised:
        run.share_outcome(None, alone=False)
    assert raised.value is run.error
    assert isinstance(raised.value.__cause__, RuntimeError) == broadcast_fails
