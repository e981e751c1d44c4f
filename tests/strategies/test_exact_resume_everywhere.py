"""Exact resume everywhere (issue 30): the user's run with a seeded ``StatefulDataLoader`` per rank resumes
every step on both ranks, for every variant (FSDP1 and FSDP2, sync and async, sharded and full), from a
mid-epoch checkpoint and from an epoch-end one; objects of one's own registered with
``register_rank_state`` resume with it; and a property test over stop points (hypothesis, on 2 processes)
for three kinds of train dataloader.

One launch per phase of ``tests/distributed/scenario_exact_resume.py`` (see its docstring) serves every test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import run_ranks
from tests.distributed.scenario_exact_resume import (
    BATCHES,
    EPOCH_END,
    NAMED,
    SAVED_AT,
    STEPS,
    VARIANTS,
    epoch_checkpoint,
    step_checkpoint,
)

SCRIPT = Path(__file__).parents[1] / "distributed" / "scenario_exact_resume.py"


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("exact_resume")
    for phase in ("unbroken", "resume", "property"):
        run_ranks(SCRIPT, 2, phase, str(root), timeout=400)
    return root


def result(out: Path, case: str, phase: str, rank: int) -> dict[str, Any]:
    return torch.load(out / f"{case}.{phase}.rank{rank}.pt", weights_only=False)  # type: ignore[no-any-return]


def equal_steps(out: Path, case: str, phase: str, saved_at: int) -> tuple[int, int]:
    """Resumed steps equal to the unbroken run's (epoch, batch, samples, loss), and all, on both ranks."""
    equal = total = 0
    for rank in (0, 1):
        unbroken, resumed = result(out, case, "unbroken", rank), result(out, case, phase, rank)
        want = {s: v for s, v in unbroken["record"].items() if s > saved_at}
        assert sorted(resumed["record"]) == list(range(saved_at + 1, STEPS + 1)) == sorted(want)
        equal += sum(resumed["record"][s] == v for s, v in want.items())
        total += len(want)
        assert len(resumed["values"]) == len(unbroken["values"]) == 5  # 4 parameters (shards), the DTensor
        assert all(torch.equal(a, b) for a, b in zip(resumed["values"], unbroken["values"], strict=True))
    return equal, total


@pytest.mark.parametrize("case", list(VARIANTS))
def test_the_users_run_resumes_every_step_on_both_ranks(out: Path, case: str) -> None:
    assert equal_steps(out, case, "resume", SAVED_AT) == (26, 26)  # steps 8-20: epoch 0's end and epoch 1


@pytest.mark.parametrize("case", list(VARIANTS))
def test_an_epoch_end_checkpoint_resumes_every_step(out: Path, case: str) -> None:
    assert epoch_checkpoint(out, case, 0, EPOCH_END).exists()
    assert equal_steps(out, case, "resume-epoch-end", EPOCH_END) == (16, 16)


def test_each_rank_saves_the_generator_its_loader_owns(out: Path) -> None:
    path = step_checkpoint(out, "fsdp2-sharded", SAVED_AT)
    states = [torch.load(path / f"rank_state/rank-0000{r}.pt", weights_only=True) for r in (0, 1)]
    # One loader; its generator is also its RandomSampler's: kept once, under the loader's own name.
    assert [list(s["train_dataloader_generators"][0]) for s in states] == [["generator"], ["generator"]]
    first, second = (s["train_dataloader_generators"][0]["generator"] for s in states)
    assert first.dtype == torch.uint8 and not torch.equal(first, second)  # seeded 1000 + rank
    full = torch.load(step_checkpoint(out, "fsdp1-full", SAVED_AT), weights_only=True)
    ranks = full["lightning_sharded_rank_state"]["ranks"]
    assert [list(s["train_dataloader_generators"][0]) for s in ranks] == [["generator"], ["generator"]]


def test_registered_objects_resume_with_the_run(out: Path) -> None:
    assert equal_steps(out, "registered", "resume", SAVED_AT) == (26, 26)
    assert equal_steps(out, "registered", "resume-epoch-end", EPOCH_END) == (16, 16)
    path = step_checkpoint(out, "registered", SAVED_AT)
    for rank in (0, 1):
        saved = torch.load(path / f"rank_state/rank-0000{rank}.pt", weights_only=True)["registered"]
        assert sorted(saved) == ["augment_rng", "noise_gen", "schedule"]
        assert saved["schedule"] == {"weight": saved["schedule"]["weight"], "steps": SAVED_AT}
        assert saved["augment_rng"]["state"]["bit_generator"] == "PCG64"


def test_every_stop_point_resumes_the_unbroken_steps(out: Path) -> None:
    """The property test's log: every example ran on both ranks and trained the unbroken run's steps."""
    logs = [result(out, "property", "log", rank)["log"] for rank in (0, 1)]
    assert logs[0] == logs[1]
    log = logs[0]
    named = [(e["kind"], e["by"], e["epochs"], e["trigger"], e["stop"]) for e in log]
    assert set(NAMED) <= set(named)
    assert len(log) >= len(NAMED) + 30  # and the drawn ones
    assert all(e["verdicts"] == [None, None] for e in log)
    stops = {(e["trigger"], e["stop"]) for e in log}
    # first batch, mid-epoch, last batch of an epoch, first of the next, epoch ends
    assert {("batch", 1), ("batch", 4), ("batch", BATCHES), ("batch", BATCHES + 1)} <= stops
    assert {("epoch end", 1), ("epoch end", 2)} <= stops
