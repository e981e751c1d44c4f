"""Fit, then test (issue 47): after ``trainer.fit(model)``, ``validate``, ``test`` and ``predict`` with
``ckpt_path="best"``, ``"last"`` or a path, and a second ``fit(ckpt_path=...)`` on a new Trainer, all with
the same model object in the same process, start from exactly the chosen checkpoint, with both strategies,
sync and async, sharded and full; an evaluation reads only the model's part of a checkpoint, and a
weights-only checkpoint serves it; a model used with FSDP1 then FSDP2 (or the reverse) is refused, saying
to build a new one; an async save that failed at the end of ``fit`` is raised again by a load of its path.

One launch of ``tests/distributed/scenario_after_fit.py`` (see its docstring) serves every test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharded import load_checkpoint
from tests._compare import assert_restored as assert_same
from tests._compare import model_keys, optimizer_keys
from tests.distributed.launch import run_ranks
from tests.distributed.scenario_after_fit import EVALUATIONS, FAILURES, MANUAL, VARIANTS, WEIGHTS_ONLY

SCRIPT = Path(__file__).parents[1] / "distributed" / "scenario_after_fit.py"
RANKS = [0, 1]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("after_fit")
    run_ranks(SCRIPT, 2, str(root), timeout=400)
    return root


def result(out: Path, case: str, rank: int) -> dict[str, Any]:
    values: dict[str, Any] = torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)
    assert "failed" not in values, values.get("failed")
    return values


def checkpoint(out: Path, case: str, which: str) -> Path:
    """The file or directory that ``ckpt_path=which`` ("best", "last", "step4") names."""
    return (
        out
        / case
        / {"best": "epoch=0-step=2.ckpt", "last": "last.ckpt", "step4": "epoch=0-step=4.ckpt"}[which]
    )


def forward(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The scenario model's forward with plain tensors (``layer2(relu(layer1(x)))``)."""
    hidden = torch.relu(x @ state["layer1.weight"].T + state["layer1.bias"])
    return hidden @ state["layer2.weight"].T + state["layer2.bias"]  # type: ignore[no-any-return]


def check_evaluation(out: Path, case: str, rank: int, fn: str) -> dict[str, Any]:
    """The weights after ``fn`` are the ones recorded when its checkpoint was saved, and every forward of
    ``fn`` computed with that checkpoint's weights (read back here in one plain process)."""
    values = result(out, case, rank)
    which, step = EVALUATIONS[fn]
    stage: dict[str, Any] = values[fn]
    saved = values["saved"][step]
    assert_same(saved, stage["values"], model_keys(saved), step=False)
    assert model_keys(stage["values"]) == model_keys(saved)
    state = load_checkpoint(checkpoint(out, case, which))["state_dict"]
    assert stage["io"], f"{fn} ran no forward"
    for x, y in stage["io"]:
        torch.testing.assert_close(y, forward(state, x), rtol=1e-5, atol=1e-6)
    return stage


@pytest.mark.parametrize("fn", list(EVALUATIONS))
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("case", list(VARIANTS))
def test_an_evaluation_after_fit_starts_from_the_chosen_checkpoint(
    out: Path, case: str, rank: int, fn: str
) -> None:
    stage = check_evaluation(out, case, rank, fn)
    if case.endswith("full"):
        assert stage["read"] == []  # a full file is not read through DCP
    else:  # the model's part only: no optimizer state read
        assert stage["read"] and any(key.endswith(".table") for key in stage["read"])
        assert all(key.split(".")[0] in ("model", "state_dict") for key in stage["read"]), stage["read"]


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("case", list(VARIANTS))
def test_a_second_fit_with_the_same_model_resumes_exactly(out: Path, case: str, rank: int) -> None:
    values = result(out, case, rank)
    refit, saved = values["refit"], values["saved"]
    assert optimizer_keys(saved[4]), "nothing of the optimizer recorded"
    assert_same(saved[4], refit["restored"])  # weights, sharded attributes, optimizer state, step
    assert model_keys(refit["restored"]) == model_keys(saved[4])
    assert_same(saved[6], refit["end"])  # and the steps after it are the first run's
    # This rank's own RNG state (each rank draws its own numbers) at the resumed batches is the first run's.
    assert sorted(refit["rng"]) == [4, 5]
    assert all(torch.equal(refit["rng"][step], values["rng"][step]) for step in (4, 5))


@pytest.mark.parametrize("fn", list(EVALUATIONS))
@pytest.mark.parametrize("case", list(WEIGHTS_ONLY))
def test_a_weights_only_checkpoint_serves_an_evaluation(out: Path, case: str, fn: str) -> None:
    which, _ = EVALUATIONS[fn]
    assert not load_checkpoint(checkpoint(out, case, which)).get("optimizer_states")
    for rank in RANKS:
        check_evaluation(out, case, rank, fn)


@pytest.mark.parametrize(
    ("case", "refusing"),
    [
        ("then-fsdp2", "ShardedModelParallelStrategy"),
        ("stock-then-fsdp2", "ShardedModelParallelStrategy"),
        ("then-fsdp1", "ShardedFSDPStrategy"),
    ],
)
def test_a_model_sharded_by_the_other_fsdp_is_refused(out: Path, case: str, refusing: str) -> None:
    for rank in RANKS:
        outcome = result(out, case, rank)
        assert outcome["type"] == "TypeError", outcome
        assert f"`{refusing}`" in outcome["message"]
        assert "Build a new model for this Trainer" in outcome["message"]


def test_other_fsdp_options_on_a_wrapped_model_are_refused(out: Path) -> None:
    for rank in RANKS:
        outcome = result(out, "then-other-options", rank)
        assert outcome["type"] == "ValueError", outcome
        message = outcome["message"]
        assert message.startswith(
            "`ShardedFSDPStrategy`: this model was wrapped by FSDP1 in an earlier Trainer"
        )
        assert "sharding_strategy=FULL_SHARD" in message and "now sharding_strategy=SHARD_GRAD_OP" in message
        assert "Build a new model for this Trainer" in message


def test_a_copy_or_pickle_of_a_wrapped_module_forgets_the_wrapper() -> None:
    """The wrapper belongs to its process and process group: a copy of the module has none to reuse."""
    import copy
    import pickle

    from lightning_sharded.strategies._reentry import fsdp1_root, remember_fsdp1_root

    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    module = torch.nn.Linear(2, 2)
    wrapper = Wrapper(module)
    remember_fsdp1_root(module, wrapper, ("a",))
    assert fsdp1_root(module, ("a",), "S") is wrapper
    assert "_lightning_sharded_fsdp1_root" not in module.state_dict()
    for other in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert fsdp1_root(other, ("a",), "S") is None
        assert torch.equal(other.weight, module.weight)
    with pytest.raises(ValueError, match=r"with other options \(a; now b\)"):
        fsdp1_root(module, ("b",), "S")


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_failed_async_save_is_raised_by_a_load_of_its_path(out: Path, case: str) -> None:
    last = out / case / "last.ckpt"
    assert load_checkpoint(last)["global_step"] == 4  # the previous last.ckpt: the failed save left it
    for rank in RANKS:
        outcome = result(out, case, rank)
        assert outcome["fit"]["type"] == "StorageError"
        assert f"saving the checkpoint '{last}' failed on rank(s) 1" in outcome["fit"]["message"]
        # validate(ckpt_path="last") would read step 4's weights: it raises the save's error instead.
        assert outcome["last"]["type"] == "CheckpointError"
        message = outcome["last"]["message"]
        assert message.startswith(f"The checkpoint '{last}' was not saved: its background save")
        assert "No space left on device (injected)" in message
        assert outcome["best"]["type"] is None  # another checkpoint still loads
        assert_same(
            outcome["saved"][2],
            outcome["best"]["value"]["values"],
            model_keys(outcome["saved"][2]),
            step=False,
        )


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("case", list(MANUAL))
def test_a_new_trainer_resumes_from_an_async_save_made_after_fit(out: Path, case: str, rank: int) -> None:
    # trainer.save_checkpoint(path) after fit writes in the background (slowed down here); a new Trainer's
    # fit(ckpt_path=path) at once waits for it to be published instead of finding no checkpoint there.
    values = result(out, case, rank)
    assert optimizer_keys(values["saved"]), "nothing of the optimizer recorded"
    assert values["saved"]["global_step"] == 4
    assert_same(values["saved"], values["restored"])
    # The second Trainer resumed and saved on the process groups the first one made (a gloo group holds
    # 3 threads and ~5 descriptors per rank until the process exits): it made only what a Trainer that
    # neither loads nor saves makes (FSDP2: Lightning's device mesh).
    made = values["groups"]
    assert made["resume and save"] == made["plain fit"], made
