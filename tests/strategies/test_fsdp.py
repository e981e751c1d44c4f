"""ShardedFSDPStrategy (FSDP1) in real multi-process runs on CPU: resume matrix, formats, top-k.

Each fit trains a model with FSDP-wrapped layers, a DTensor table, a ShardedTensor cache and Adam, saves,
and writes the full values gathered with torch's own helpers; each resume writes the same values as
they are right after the restore. They must be equal, exactly. See ``plan.py`` for the jobs.
"""

from __future__ import annotations

import pytest
import torch

from tests._compare import assert_restored, model_keys, optimizer_keys
from tests.distributed.models import _table_values
from tests.strategies.plan import Session, resume_name


def test_training_changed_every_value(runs: Session) -> None:
    # Guards the comparisons: restoring nothing must not look like restoring everything.
    saved = runs["fsdp2"]
    assert saved["global_step"] == 3
    assert not torch.equal(saved["model.table"], _table_values())
    assert torch.equal(saved["model.cache"], torch.full((6, 3), 1.5))
    assert {k.rsplit(".", 1)[-1] for k in optimizer_keys(saved)} >= {"exp_avg", "exp_avg_sq", "step"}
    assert not saved["info.layers_are_dtensors"]  # FSDP1: flat parameters, not DTensors


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 2), (2, 1), (1, 2)])
def test_resume_sharded_at_any_world_size(runs: Session, saved_on: int, resumed_on: int) -> None:
    saved = runs[f"fsdp{saved_on}"]
    assert (runs.root / f"fsdp{saved_on}" / ".metadata").is_file()
    assert (runs.root / f"fsdp{saved_on}" / "meta.pt").is_file()
    assert (runs.root / f"fsdp{saved_on}" / "lightning_sharded.json").is_file()  # the manifest
    restored = runs[resume_name(f"fsdp{saved_on}", "fsdp", resumed_on)]
    assert {"model.cache", "model.table"} <= set(model_keys(restored))
    assert_restored(saved, restored)


def test_saving_over_a_checkpoint_replaces_it_and_leaves_nothing_behind(runs: Session) -> None:
    # "fsdp2", "mp2" and "fsdp2-full" were saved after step 1 and again after step 3, at the same path.
    from lightning_sharded.checkpoint import read_manifest
    from lightning_sharded.checkpoint.commit import leftovers

    for name in ("fsdp2", "mp2", "fsdp2-full"):
        assert runs[name]["global_step"] == 3
        assert leftovers(runs.root / name) == []
    manifest = read_manifest(runs.root / "fsdp2")
    assert manifest is not None and manifest.global_step == 3 and manifest.world_size == 2
    assert torch.load(runs.root / "fsdp2-full", weights_only=False)["global_step"] == 3


def test_model_checkpoint_save_top_k_keeps_two_directories(runs: Session) -> None:
    runs["fsdp2"]
    folder = runs.root / "fsdp2-topk"
    kept = sorted(p.name for p in folder.iterdir())
    assert kept == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]
    assert all((folder / name / ".metadata").is_file() for name in kept)


def test_stock_fsdp_checkpoint_resumes(runs: Session) -> None:
    assert (runs.root / "stock-fsdp2" / "meta.pt").is_file()
    assert_restored(runs["stock-fsdp2"], runs[resume_name("stock-fsdp2", "fsdp", 1)])


def test_our_sharded_checkpoint_resumes_in_stock_fsdp(runs: Session) -> None:
    assert_restored(runs["fsdp2"], runs[resume_name("fsdp2", "stock-fsdp", 2)])


def test_stock_model_parallel_checkpoint_resumes(runs: Session) -> None:
    assert_restored(runs["stock-mp2"], runs[resume_name("stock-mp2", "fsdp", 2)])


def test_full_file_from_a_single_device_trainer_resumes(runs: Session) -> None:
    # The single-device model holds the table as a plain buffer; it loads into the DTensor table.
    assert (runs.root / "single").is_file()
    assert_restored(runs["single"], runs[resume_name("single", "fsdp", 2)])


def test_full_save_is_a_plain_file_a_single_device_trainer_resumes(runs: Session) -> None:
    saved = runs["fsdp2-full"]
    path = runs.root / "fsdp2-full"
    assert path.is_file()
    checkpoint = torch.load(path, weights_only=False)  # plain torch: no process group, no library
    state = checkpoint["state_dict"]
    for key in ("table", "cache", "layer1.weight", "layer2.bias"):
        assert torch.equal(state[key], saved[f"model.{key}"]), key
    assert sorted(checkpoint["optimizer_states"][0]["state"]) == [
        0,
        1,
        2,
        3,
    ]  # keyed like Optimizer.state_dict()
    assert checkpoint["global_step"] == 3
    # A stock single-device Trainer (no library strategy) resumes from it, Adam state included.
    restored = runs[resume_name("fsdp2-full", "single", 1)]
    keys = [k for k in model_keys(saved) + optimizer_keys(saved) if k != "opt0.lr"]
    assert_restored(saved, restored, keys)


def test_validate_test_predict_with_ckpt_path(runs: Session) -> None:
    saved, results = runs["fsdp2"], runs["evaluate"]
    for fn in ("validate", "test", "predict"):
        assert_restored(saved, results[fn]["values"], model_keys(saved), step=False)
        assert not optimizer_keys(results[fn]["values"])  # no optimizer outside fitting
    assert "val_loss" in results["validate"]["output"][0]
    assert "test_loss" in results["test"]["output"][0]
    assert len(results["predict"]["output"]) == 2
