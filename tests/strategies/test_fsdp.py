"""ShardedFSDPStrategy (FSDP1) in real multi-process runs on CPU: resume matrix, formats, top-k.

Each fit trains a model with FSDP-wrapped layers, a DTensor table, a ShardedTensor cache and Adam, saves,
and writes the full values gathered with torch's own helpers; each resume writes the same values as
they are right after the restore. They must be equal, exactly.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import Runs, assert_same, model_keys, optimizer_keys
from tests.distributed.models import _table_values

FSDP = ("--strategy", "fsdp", "--sharded-tensor")


def test_training_changed_every_value(runs: Runs) -> None:
    # Guards the comparisons below: restoring nothing must not look like restoring everything.
    saved = runs.fit("fsdp2", 2, *FSDP, "--top-k", str(runs.ckpt("fsdp2-topk")))
    assert saved["global_step"] == 3
    assert not torch.equal(saved["model.table"], _table_values())
    assert torch.equal(saved["model.cache"], torch.full((6, 3), 1.5))
    assert {k.rsplit(".", 1)[-1] for k in optimizer_keys(saved)} >= {"exp_avg", "exp_avg_sq", "step"}


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 2), (2, 1), (1, 2)])
def test_resume_sharded_at_any_world_size(runs: Runs, saved_on: int, resumed_on: int) -> None:
    name = f"fsdp{saved_on}"
    flags = (*FSDP, "--top-k", str(runs.ckpt("fsdp2-topk"))) if saved_on == 2 else FSDP
    saved = runs.fit(name, saved_on, *flags)
    assert (runs.ckpt(name) / ".metadata").is_file() and (runs.ckpt(name) / "meta.pt").is_file()
    restored = runs.run("resume", resumed_on, name, *FSDP)
    assert "model.cache" in model_keys(restored) and "model.table" in model_keys(restored)
    assert_same(saved, restored)


def test_model_checkpoint_save_top_k_keeps_two_directories(runs: Runs) -> None:
    runs.fit("fsdp2", 2, *FSDP, "--top-k", str(runs.ckpt("fsdp2-topk")))
    kept = sorted(p.name for p in runs.ckpt("fsdp2-topk").iterdir())
    assert kept == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]
    assert all((runs.ckpt("fsdp2-topk") / name / ".metadata").is_file() for name in kept)


def test_stock_fsdp_checkpoint_resumes(runs: Runs) -> None:
    saved = runs.fit("stock-fsdp2", 2, "--strategy", "stock-fsdp", "--sharded-tensor")
    assert (runs.ckpt("stock-fsdp2") / "meta.pt").is_file()
    assert_same(saved, runs.run("resume", 1, "stock-fsdp2", *FSDP))


def test_our_sharded_checkpoint_resumes_in_stock_fsdp(runs: Runs) -> None:
    saved = runs.fit("fsdp2", 2, *FSDP, "--top-k", str(runs.ckpt("fsdp2-topk")))
    restored = runs.run("resume", 2, "fsdp2", "--strategy", "stock-fsdp", "--sharded-tensor")
    assert_same(saved, restored)


def test_stock_model_parallel_checkpoint_resumes(runs: Runs) -> None:
    saved = runs.fit("stock-mp2", 2, "--strategy", "stock-mp", "--sharded-tensor")
    assert_same(saved, runs.run("resume", 2, "stock-mp2", *FSDP))


def test_full_file_from_a_single_device_trainer_resumes(runs: Runs) -> None:
    # The single-device model holds the table as a plain buffer; it loads into the DTensor table.
    saved = runs.fit("single", 1, "--strategy", "single")
    assert runs.ckpt("single").is_file()
    assert_same(saved, runs.run("resume", 2, "single", "--strategy", "fsdp"))


def test_full_save_is_a_plain_file_a_single_device_trainer_resumes(runs: Runs) -> None:
    saved = runs.fit("fsdp2-full", 2, *FSDP, "--state-dict-type", "full")
    path = runs.ckpt("fsdp2-full")
    assert path.is_file()
    checkpoint = torch.load(path, weights_only=False)  # plain torch, no process group, no library
    assert torch.equal(checkpoint["state_dict"]["table"], saved["model.table"])
    assert torch.equal(checkpoint["state_dict"]["layer1.weight"], saved["model.layer1.weight"])
    assert torch.equal(checkpoint["state_dict"]["cache"], saved["model.cache"])
    assert sorted(checkpoint["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    assert checkpoint["global_step"] == 3
    # A stock single-device Trainer (no library strategy) resumes from it, Adam state included.
    restored = runs.run("resume", 1, "fsdp2-full", "--strategy", "single", "--sharded-tensor")
    keys = model_keys(saved) + optimizer_keys(saved)
    keys.remove("opt0.lr")
    assert_same(saved, restored, keys)


def test_validate_test_predict_with_ckpt_path(runs: Runs) -> None:
    saved = runs.fit("fsdp2", 2, *FSDP, "--top-k", str(runs.ckpt("fsdp2-topk")))
    results = runs.run("evaluate", 2, "fsdp2", *FSDP)
    for fn in ("validate", "test", "predict"):
        assert_same(saved, results[fn]["values"], model_keys(saved))
        assert not optimizer_keys(results[fn]["values"])  # no optimizer outside fitting
    assert "val_loss" in results["validate"]["output"][0]
    assert "test_loss" in results["test"]["output"][0]
    assert len(results["predict"]["output"]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_resume_sharded_on_cuda(runs: Runs) -> None:
    flags = ("--strategy", "fsdp", "--accelerator", "cuda")
    saved = runs.fit("fsdp2-cuda", 2, *flags)
    assert_same(saved, runs.run("resume", 2, "fsdp2-cuda", *flags))
    assert_same(saved, runs.run("resume", 1, "fsdp2-cuda", *flags))
