"""TorchRec models (issue 42): embedding tables sharded by TorchRec, their fused optimizer state and the
dense part resume exactly, under both strategies, sync and async, sharded and full, at another plan and
at another world size; wrappers leave TorchRec's sharded modules alone; the offline tools read it all.

One session run (``TorchRecRuns``), three launches of ``tests/distributed/scenario_torchrec.py`` on gloo
(2 processes, then 1, then 2 again). The model is ``tests/distributed/torchrec_models.py``'s
``RecModel``: 3 tables of 64 x 8, the fused kernel with exact Adagrad applied in backward unless a job
says otherwise, Adam on the dense MLP. "saved" is what the saving run held after its save, "restored"
what the resumed run held when training started, "final" what it held at the end; every comparison is
bit for bit. A run that saves after 2 steps (the end of an epoch at 2 ranks) and resumes to 4 ends
equal to the run that trained 4 steps unbroken.

TorchRec needs its own environment (it pins ``torchmetrics==1.0.3``): ``.ci/run`` builds it and runs
these tests there with ``LIGHTNING_SHARDED_REQUIRE_TORCHREC=1``, under which a missing TorchRec fails the
run (``tests/conftest.py``); elsewhere they are skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import Results, run_batch, run_ranks

REQUIRE_ENV = "LIGHTNING_SHARDED_REQUIRE_TORCHREC"
HAVE_TORCHREC = importlib.util.find_spec("torchrec") is not None
if not HAVE_TORCHREC and os.environ.get(REQUIRE_ENV) == "1":
    raise ImportError(f"{REQUIRE_ENV}=1 but TorchRec cannot be imported in {sys.executable}")

pytestmark = [
    pytest.mark.torchrec,
    pytest.mark.slow,
    pytest.mark.skipif(
        not HAVE_TORCHREC,
        reason="TorchRec is not installed here; .ci/run runs these in its TorchRec venv"
        f" with {REQUIRE_ENV}=1 (see docs/torchrec.md)",
    ),
]

SCRIPT = Path(__file__).parent / "distributed" / "scenario_torchrec.py"
#: A plan that moves every table to another layout than the default (t0 row, t1 table@0, t2 table@1).
OTHER_PLAN = {"t0": "table:1", "t1": "row", "t2": "column"}
SKIPPED_LOG = "leaves the modules TorchRec sharded alone"


class TorchRecRuns:
    """Every job of the module, run once per session: ``results[name]`` is a job's result."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.outs: dict[str, Path] = {}
        self.jobs: dict[int, list[dict[str, Any]]] = {}
        self.outputs: list[str] = []

    def add(self, name: str, world: int, kind: str, **job: Any) -> None:
        out = self.root / f"{name.replace('/', '_')}.result.pt"
        self.outs[name] = out
        self.jobs.setdefault(world, []).append({"kind": kind, "out": str(out), **job})

    def ckpt(self, name: str) -> str:
        return str(self.root / name)

    def launch(self, world: int, first: bool = False) -> None:
        jobs_file = self.root / f"jobs-{len(self.outs)}.pt"
        torch.save(self.jobs.pop(world), jobs_file)
        if first:  # this launch's output is read (the log lines)
            self.outputs = run_ranks(SCRIPT, world, "batch", str(jobs_file), timeout=300)
        else:
            run_batch(SCRIPT, world, jobs_file, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Results, TorchRecRuns]:
    r = TorchRecRuns(tmp_path_factory.mktemp("torchrec"))
    # ---- 2 processes: unbroken runs, saves, resumes at the same world size, wrapping
    for strategy in ("mp", "fsdp"):
        r.add(f"{strategy}/unbroken", 2, "fit", steps=4, ckpt=None, strategy=strategy)
        for sdt in ("sharded", "full"):
            ckpt = r.ckpt(f"{strategy}-{sdt}.ckpt")
            common = {"strategy": strategy, "state_dict_type": sdt}
            r.add(f"{strategy}/{sdt}/saved", 2, "fit", steps=2, ckpt=ckpt, **common)
            r.add(f"{strategy}/{sdt}/same", 2, "resume", steps=4, ckpt=ckpt, **common)
            r.add(f"{strategy}/{sdt}/other-plan", 2, "resume", steps=4, ckpt=ckpt, plan=OTHER_PLAN, **common)
    async_ckpt = r.ckpt("mp-async.ckpt")
    r.add("mp/async/saved", 2, "fit", steps=2, ckpt=async_ckpt, async_save=True)
    r.add("mp/async/same", 2, "resume", steps=4, ckpt=async_ckpt, async_save=True)
    for strategy in ("mp-policy", "fsdp", "ddp"):
        r.add(f"wrap/{strategy}/dense", 2, "wrap", strategy=strategy, kernel="dense", optimizer="sgd")
    r.add("wrap/ddp/fused", 2, "wrap", strategy="ddp")
    r.launch(2, first=True)
    # ---- 1 process: 2 -> 1 (sharded and full, another plan), and a 1-process save
    r.add("2to1/mp/sharded", 1, "resume", steps=4, ckpt=r.ckpt("mp-sharded.ckpt"))
    r.add("2to1/fsdp/full", 1, "resume", steps=4, ckpt=r.ckpt("fsdp-full.ckpt"), strategy="fsdp",
          state_dict_type="full", plan=OTHER_PLAN)  # fmt: skip
    r.add("1/saved", 1, "fit", steps=4, ckpt=r.ckpt("one.ckpt"))
    r.launch(1)
    # ---- offline: a consolidated file of the 2-rank checkpoint, for DDP
    from lightning_sharded import consolidate_checkpoint

    consolidate_checkpoint(r.ckpt("mp-sharded.ckpt"), r.ckpt("consolidated.ckpt"))
    # ---- 2 processes again: 1 -> 2 into another plan; DDP from the consolidated file
    r.add("1to2/mp/other-plan", 2, "resume", steps=8, ckpt=r.ckpt("one.ckpt"), plan=OTHER_PLAN)
    r.add("1to2/fsdp", 2, "resume", steps=8, ckpt=r.ckpt("one.ckpt"), strategy="fsdp")
    r.add("ddp/consolidated", 2, "resume", steps=4, ckpt=r.ckpt("consolidated.ckpt"), strategy="ddp")
    r.launch(2)
    return Results(r.outs), r


def assert_equal(expected: dict[str, Any], actual: dict[str, Any], what: str) -> None:
    keys = sorted(k for k in expected if k != "global_step")
    assert any(k.startswith("fused.") for k in keys) or not any(k.startswith("fused") for k in actual)
    missing = [k for k in keys if k not in actual]
    assert not missing, f"{what}: not there: {missing}"
    differ = [k for k in keys if not torch.equal(expected[k], actual[k])]
    assert not differ, f"{what}: differ for {differ}"


def fused_keys(values: dict[str, Any]) -> list[str]:
    return sorted(k for k in values if k.startswith("fused."))


@pytest.mark.parametrize("strategy", ["mp", "fsdp"])
@pytest.mark.parametrize("sdt", ["sharded", "full"])
@pytest.mark.parametrize("plan", ["same", "other-plan"])
def test_resume_restores_tables_fused_state_and_dense_and_continues_exactly(
    runs: tuple[Results, TorchRecRuns], strategy: str, sdt: str, plan: str
) -> None:
    results, _ = runs
    saved = results[f"{strategy}/{sdt}/saved"]
    # Every table's fused Adagrad state is there (3 tables x momentum1), not only this rank's.
    assert fused_keys(saved) == ["fused.t0.momentum1", "fused.t1.momentum1", "fused.t2.momentum1"]
    assert all(saved[k].abs().sum() > 0 for k in fused_keys(saved)), "the fused optimizer never ran"
    resumed = results[f"{strategy}/{sdt}/{plan}"]
    assert_equal(saved, resumed["restored"], "restored")
    assert resumed["restored"]["global_step"] == 2
    if plan == "same":
        # Another plan adds a bag's rows in another order (a row-wise table's pooled sums are partial
        # sums added across ranks): a continued run is exact with the same plan only.
        assert_equal(results[f"{strategy}/unbroken"], resumed["final"], "continued vs unbroken")


def test_async_save_resumes_exactly(runs: tuple[Results, TorchRecRuns]) -> None:
    results, _ = runs
    resumed = results["mp/async/same"]
    assert_equal(results["mp/async/saved"], resumed["restored"], "restored")
    assert_equal(results["mp/unbroken"], resumed["final"], "continued vs unbroken")


@pytest.mark.parametrize(
    ("name", "saved"), [("2to1/mp/sharded", "mp/sharded/saved"), ("2to1/fsdp/full", "fsdp/full/saved")]
)
def test_two_processes_to_one(runs: tuple[Results, TorchRecRuns], name: str, saved: str) -> None:
    results, _ = runs
    assert_equal(results[saved], results[name]["restored"], "restored at 1 process")


@pytest.mark.parametrize("name", ["1to2/mp/other-plan", "1to2/fsdp"])
def test_one_process_to_two(runs: tuple[Results, TorchRecRuns], name: str) -> None:
    results, _ = runs
    assert_equal(results["1/saved"], results[name]["restored"], "restored at 2 processes")


def test_consolidated_file_resumes_under_ddp(runs: tuple[Results, TorchRecRuns]) -> None:
    results, _ = runs
    assert_equal(results["mp/sharded/saved"], results["ddp/consolidated"]["restored"], "restored by DDP")


@pytest.mark.parametrize("name", ["mp-policy/dense", "fsdp/dense", "ddp/dense", "ddp/fused"])
def test_wrappers_leave_torchrec_tables_training(runs: tuple[Results, TorchRecRuns], name: str) -> None:
    """fully_shard_policy, FSDP1's auto_wrap_policy and DDP: every table changed after 2 steps."""
    results, _ = runs
    assert results[f"wrap/{name}"] == {"t0": True, "t1": True, "t2": True}


def test_what_is_left_alone_is_said_once_per_run(runs: tuple[Results, TorchRecRuns]) -> None:
    _, r = runs
    rank0 = r.outputs[0]
    for what in ("`fully_shard_policy`", "FSDP (`auto_wrap_policy`", "DDP leaves"):
        lines = [line for line in rank0.splitlines() if SKIPPED_LOG in line and what in line]
        assert lines, f"no log line for {what}"
        assert all("sparse (ShardedEmbeddingBagCollection)" in line for line in lines)
    assert SKIPPED_LOG not in r.outputs[1], "said by rank 1 too"


def test_tools_read_torchrec_checkpoints(runs: tuple[Results, TorchRecRuns]) -> None:
    """load_checkpoint, verify, inspect and consolidate: full tables and fused state, as saved."""
    from lightning_sharded import load_checkpoint, verify_checkpoint

    results, r = runs
    saved = results["mp/sharded/saved"]
    verify_checkpoint(r.ckpt("mp-sharded.ckpt"))
    for path in ("mp-sharded.ckpt", "consolidated.ckpt", "fsdp-full.ckpt"):
        state = load_checkpoint(r.ckpt(path))["state_dict"]
        expected = saved if path != "fsdp-full.ckpt" else results["fsdp/full/saved"]
        for t in ("t0", "t1", "t2"):
            assert torch.equal(state[f"sparse.embedding_bags.{t}.weight"], expected[f"table.{t}"]), path
            assert torch.equal(
                state[f"sparse.fused_optimizer__{t}__momentum1"], expected[f"fused.{t}.momentum1"]
            )
    shown = subprocess.run(
        [sys.executable, "-m", "lightning_sharded.cli", "inspect", r.ckpt("mp-sharded.ckpt")],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "sparse.fused_optimizer__t2__momentum1" in shown and "(64, 8)" in shown
