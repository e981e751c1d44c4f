"""Every way a resume can fail, as a user sees it: the exception type and what its message says.

The cases run at 2 processes in one launch (``plan.error_cases``); each resumes with
``ShardedFSDPStrategy`` from a broken path or from a checkpoint that does not fit the model.
"""

from __future__ import annotations

from typing import Any

import pytest

from lightning_sharded import CheckpointError, ShardedFSDPStrategy, ShardedModelParallelStrategy
from tests._compare import assert_restored, model_keys, optimizer_keys
from tests.strategies.plan import Session

# case -> (exception type, fragments the message must contain; "{root}" is the session folder)
EXPECTED: dict[str, tuple[str, list[str]]] = {
    # A CheckpointError (so the ValueError stock raises, with its words) and a FileNotFoundError.
    "missing": (
        "MissingCheckpointError",
        ["{root}/does-not-exist", "does not exist", "does not point to a valid checkpoint", "ckpt_path"],
    ),
    "empty": ("CheckpointError", ["{root}/broken/empty", "is empty"]),
    "not-a-checkpoint": ("CheckpointError", ["{root}/broken/not-a-checkpoint", "not a sharded checkpoint"]),
    "no-meta": (
        "CheckpointError",
        ["{root}/broken/no-meta", "'meta.pt'", "did not finish", "earlier checkpoint"],
    ),
    "no-index": ("CheckpointError", ["{root}/broken/no-index", "'.metadata'", "earlier checkpoint"]),
    "truncated-shard": (
        "CheckpointError",
        ["{root}/broken/truncated-shard", "'__0_0.distcp' (written by rank 0) is truncated: 64 bytes"],
    ),
    "corrupt-entry": (
        "CheckpointError",
        ["{root}/broken/corrupt-entry", "failed on rank(s) [0, 1]", "rank 1:"],
    ),
    "garbage-file": (
        "CheckpointError",
        ["{root}/broken/garbage.ckpt", "is not a checkpoint: it is not a torch.save file"],
    ),
    "not-lightning-file": (
        "CheckpointError",
        ["{root}/broken/not-lightning.ckpt", "no 'state_dict'", "weights"],
    ),
    "unexpected-strict": (
        "CheckpointError",
        ["{root}/fsdp2'", 'Unexpected key(s) in the checkpoint: "cache"'],
    ),
    "unexpected-strict-full": (
        "CheckpointError",
        ["{root}/fsdp2-full", 'Unexpected key(s) in the checkpoint: "cache"'],
    ),
    "missing-strict": (
        "CheckpointError",
        ["{root}/fsdp2'", 'Missing key(s) in the checkpoint: "extra"', "strict_loading"],
    ),
    "missing-strict-full": (
        "CheckpointError",
        ["{root}/single", 'Missing key(s) in the checkpoint: "extra"'],
    ),
    "size-mismatch": (
        "CheckpointError",
        ["{root}/fsdp2'", "size mismatch for layer1.weight", "[16, 8]", "[32, 8]"],
    ),
    "size-mismatch-full": (
        "CheckpointError",
        ["{root}/single", "size mismatch for layer2.weight", "[4, 16]"],
    ),
    # A CheckpointError and the RuntimeError stock raises, stock's words first.
    "optimizer-count": (
        "OptimizerCountError",
        [
            "{root}/fsdp2'",
            "You have configured 2 optimizers but the checkpoint contains 1 optimizers to load",
        ],
    ),
    "optimizer-count-full": (
        "OptimizerCountError",
        [
            "{root}/single",
            "You have configured 2 optimizers but the checkpoint contains 1 optimizers to load",
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_error_names_what_and_where(runs: Session, case: str) -> None:
    outcome: dict[str, Any] = runs["errors"][case]
    kind, fragments = EXPECTED[case]
    assert outcome["type"] == kind, outcome.get("traceback", outcome)
    for fragment in fragments:
        assert fragment.format(root=runs.root) in outcome["message"], outcome["message"]
    if kind in ("CheckpointError", "MissingCheckpointError", "OptimizerCountError"):
        assert "ValueError" in outcome["mro"]
    also = {"MissingCheckpointError": "FileNotFoundError", "OptimizerCountError": "RuntimeError"}.get(kind)
    assert also is None or also in outcome["mro"], outcome["mro"]
    # DCP's CheckpointException is a BaseException; it must never reach the user.
    assert "CheckpointException" not in outcome["mro"]


def test_failed_loads_changed_nothing_on_disk(runs: Session) -> None:
    runs["errors"]
    assert runs.before == runs.after


def test_non_strict_loads_the_overlap_without_unexpected_keys(runs: Session) -> None:
    # The model has no "cache"; the checkpoint's cache is skipped, the rest loads.
    outcome = runs["errors"]["non-strict-unexpected"]
    assert outcome["type"] is None, outcome.get("traceback")
    saved, restored = runs["fsdp2"], outcome["values"]
    assert "model.cache" not in restored
    assert_restored(
        saved, restored, [k for k in model_keys(saved) if k != "model.cache"] + optimizer_keys(saved)
    )


def test_non_strict_leaves_keys_the_checkpoint_lacks_alone(runs: Session) -> None:
    outcome = runs["errors"]["non-strict-missing"]
    assert outcome["type"] is None, outcome.get("traceback")
    assert_restored(runs["fsdp2"], outcome["values"])


def test_state_dict_type_is_checked() -> None:
    with pytest.raises(ValueError, match="Unknown state_dict_type: partial"):
        ShardedFSDPStrategy(state_dict_type="partial")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown state_dict_type: partial"):
        ShardedModelParallelStrategy(state_dict_type="partial")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contradict"):
        ShardedModelParallelStrategy(save_distributed_checkpoint=False, state_dict_type="sharded")
    assert ShardedModelParallelStrategy(save_distributed_checkpoint=False)._sharded_state_dict_type == "full"


def test_checkpoint_error_is_a_value_error() -> None:
    assert issubclass(CheckpointError, ValueError)
