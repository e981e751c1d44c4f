"""TorchRec tables trained by the Lightning optimizer (dense kernel): their optimizer state (Adam, Adagrad,
TorchRec's ``KeyedOptimizerWrapper`` and ``CombinedOptimizer``) is saved whole and restored exactly under
``ShardedModelParallelStrategy``, with the same plan, another plan, 2 -> 1 and 1 -> 2 processes.

Two launches of ``tests/distributed/scenario_torchrec_state.py`` at 2 processes and one at 1 (gloo). Every
comparison is bit for bit: "saved" is what the saving run held after its save (tables, dense weights and
every optimizer state tensor, gathered), "restored" what the resumed run held when training started,
"final" what it held at the end, compared with a run that trained as many steps unbroken (the save falls
on an epoch boundary: 16 samples, 2 steps an epoch at 2 processes). On main the tables' state came back as
one rank's copy under the same plan (and the log said "Loaded the model and optimizer states").

TorchRec needs its own environment (``.ci/run`` runs these with ``LIGHTNING_SHARDED_REQUIRE_TORCHREC=1``,
under which a missing TorchRec fails the run); elsewhere they are skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import run_batch

REQUIRE_ENV = "LIGHTNING_SHARDED_REQUIRE_TORCHREC"
HAVE_TORCHREC = importlib.util.find_spec("torchrec") is not None
if not HAVE_TORCHREC and os.environ.get(REQUIRE_ENV) == "1":
    raise ImportError(f"{REQUIRE_ENV}=1 but TorchRec cannot be imported in {sys.executable}")

pytestmark = [
    pytest.mark.torchrec,
    pytest.mark.slow,
    pytest.mark.skipif(
        not HAVE_TORCHREC,
        reason="TorchRec is not installed here; .ci/run runs these in its TorchRec venv with"
        f" {REQUIRE_ENV}=1",
    ),
]

SCRIPT = Path(__file__).parent / "distributed" / "scenario_torchrec_state.py"
PLANS_SCRIPT = Path(__file__).parent / "distributed" / "torchrec_plans_script.py"
PLAN = "t0=row,t1=table:0,t2=table:1"
#: Every table in another layout: row-wise <-> column-wise <-> table-wise.
OTHER = "t0=column,t1=row,t2=table:0"
OPTIMIZERS = ("adam", "adagrad", "keyed", "combined")
#: Plain Adam's tables' state through a full checkpoint file and an async sharded save (fsdp: FSDP1).
VARIANTS = {
    "full": ("--state-dict-type", "full"),
    "async": ("--async-save",),
    "fsdp-full": ("--strategy", "fsdp", "--state-dict-type", "full"),
}


class Runs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.jobs: dict[int, list[list[str]]] = {}

    def add(
        self, world: int, phase: str, ckpt: str, out: str, plan: str, optimizer: str, steps: int, *extra: str
    ) -> None:
        self.jobs.setdefault(world, []).append(
            [
                *extra,
                phase,
                "--ckpt",
                str(self.root / ckpt),
                "--out",
                str(self.root / f"{out}.pt"),
                "--plan",
                plan,
                "--optimizer",
                optimizer,
                "--steps",
                str(steps),
            ]
        )

    def launch(self, world: int) -> None:
        jobs_file = self.root / f"jobs-{world}-{len(list(self.root.iterdir()))}.pt"
        torch.save(self.jobs.pop(world), jobs_file)
        run_batch(SCRIPT, world, jobs_file, timeout=400)

    def __getitem__(self, name: str) -> Any:
        result = torch.load(self.root / f"{name}.pt", weights_only=False)
        assert "error" not in result, result.get("traceback")
        return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    runs = Runs(tmp_path_factory.mktemp("torchrec-state"))
    for opt in OPTIMIZERS:
        runs.add(2, "fit", f"ck-{opt}", f"saved-{opt}", PLAN, opt, 2)
        runs.add(2, "resume", f"ck-{opt}", f"same-{opt}", PLAN, opt, 4)
        runs.add(2, "resume", f"ck-{opt}", f"other-{opt}", OTHER, opt, 4)
        runs.add(2, "fit", f"ck4-{opt}", f"unbroken-{opt}", PLAN, opt, 4)
    runs.jobs[2].append(
        [
            "fit",
            "--ckpt",
            str(runs.root / "old"),
            "--out",
            str(runs.root / "old-saved.pt"),
            "--plan",
            PLAN,
            "--optimizer",
            "adam",
            "--unwrapped",
        ]
    )
    runs.add(2, "resume", "old", "old-resume", PLAN, "adam", 4)
    fsdp = ("--strategy", "fsdp")
    runs.add(2, "fit", "ck-fsdp", "saved-fsdp", PLAN, "adam", 2, *fsdp)
    runs.add(2, "resume", "ck-fsdp", "same-fsdp", PLAN, "adam", 4, *fsdp)
    runs.add(2, "fit", "ck4-fsdp", "unbroken-fsdp", PLAN, "adam", 4, *fsdp)
    for variant, flags in VARIANTS.items():  # the unbroken run is unbroken-adam
        runs.add(2, "fit", f"ck-{variant}", f"saved-{variant}", PLAN, "adam", 2, *flags)
        runs.add(2, "resume", f"ck-{variant}", f"same-{variant}", PLAN, "adam", 4, *flags)
        runs.add(2, "resume", f"ck-{variant}", f"other-{variant}", OTHER, "adam", 4, *flags)
    runs.launch(2)
    for opt in OPTIMIZERS:
        runs.add(1, "resume", f"ck-{opt}", f"to1-{opt}", PLAN, opt, 4)
    runs.add(1, "fit", "ck-one", "saved-one", PLAN, "adam", 2)
    runs.launch(1)
    runs.add(2, "resume", "ck-one", "to2", OTHER, "adam", 3)
    runs.launch(2)
    return runs


def _differ(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in sorted(expected) if k not in actual or not torch.equal(expected[k], actual[k])]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("resume", ["same", "other"])
def test_tables_state_restored_exactly_and_training_continues(
    runs: Runs, optimizer: str, resume: str
) -> None:
    saved = runs[f"saved-{optimizer}"]
    assert any(k.startswith("opt.t2.") for k in saved) and saved["opt.t2.step"].item() == 2
    result = runs[f"{resume}-{optimizer}"]
    assert _differ(saved, result["restored"]) == []
    assert _differ(runs[f"unbroken-{optimizer}"], result["final"]) == []


def test_tables_adam_state_restored_exactly_under_fsdp1(runs: Runs) -> None:
    """``ShardedFSDPStrategy`` (the dense part wrapped by FSDP1, TorchRec's modules left to TorchRec) with a
    plain Adam over every parameter: the tables' state comes back bit for bit and training continues as the
    unbroken run; main refused the resume ("size mismatch for ...t2.weight.exp_avg: the checkpoint has
    shape [64, 8], the model [0]")."""
    saved = runs["saved-fsdp"]
    assert saved["opt.t2.step"].item() == 2 and saved["opt.t0.exp_avg"].abs().sum() > 0
    result = runs["same-fsdp"]
    assert _differ(saved, result["restored"]) == []
    assert _differ(runs["unbroken-fsdp"], result["final"]) == []


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("resume", ["same", "other"])
def test_tables_state_through_full_and_async_checkpoints(runs: Runs, variant: str, resume: str) -> None:
    """A full checkpoint file (the tables' state gathered whole on rank 0) and an async sharded save restore
    the tables' Adam state bit for bit, under the same plan and under another."""
    saved = runs[f"saved-{variant}"]
    assert saved["opt.t2.step"].item() == 2 and saved["opt.t0.exp_avg"].abs().sum() > 0
    result = runs[f"{resume}-{variant}"]
    assert _differ(saved, result["restored"]) == []
    if resume == "same":
        unbroken = runs["unbroken-fsdp" if variant.startswith("fsdp") else "unbroken-adam"]
        assert _differ(unbroken, result["final"]) == []


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_tables_state_restored_at_one_process(runs: Runs, optimizer: str) -> None:
    assert _differ(runs[f"saved-{optimizer}"], runs[f"to1-{optimizer}"]["restored"]) == []


def test_tables_state_saved_at_one_process_restored_at_two_in_another_plan(runs: Runs) -> None:
    assert _differ(runs["saved-one"], runs["to2"]["restored"]) == []


def test_state_saved_per_rank_is_refused_naming_key_and_shapes(runs: Runs) -> None:
    """A checkpoint holding one rank's copy of a table's state (how main saved it) is refused, naming the
    key and both shapes; main loaded it and said "Loaded the model and optimizer states"."""
    result = torch.load(runs.root / "old-resume.pt", weights_only=False)
    assert result.get("error") == "CheckpointError", result
    assert "size mismatch for optimizer_0.state.sparse.embedding_bags.t0.weight.exp_avg" in result["message"]
    assert "the checkpoint has shape [32, 8], the model [64, 8]" in result["message"]


def test_property_state_round_trip_over_plans(tmp_path: Path) -> None:
    """Hypothesis over plans (each table row-wise, table-wise on either rank or column-wise), saved under
    one and loaded under another, in one launch of 2 processes: every table's Adam state is equal bit for
    bit (on main a load under another plan crashed in Adam's step or read another rank's state)."""
    from tests.distributed.launch import run_ranks

    out = tmp_path / "plans.pt"
    run_ranks(PLANS_SCRIPT, 2, str(out), "5", timeout=400)
    result = torch.load(out, weights_only=False)
    assert "failed" not in result, result["failed"]
    assert result["examples"] == 5
