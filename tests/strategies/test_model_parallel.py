"""ShardedModelParallelStrategy (FSDP2) in real multi-process runs on CPU, and FSDP1 <-> FSDP2 resumes.

The same model as the FSDP1 tests: ``fully_shard`` layers (applied in ``configure_model``, or by the
strategy's ``fully_shard_policy`` on a plain model), a DTensor table, a ShardedTensor cache and Adam.
"""

from __future__ import annotations

import pytest
import torch

from tests._compare import assert_restored, model_keys
from tests.distributed.models import _table_values
from tests.strategies.plan import Session, resume_name


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 2), (2, 1), (1, 2)])
def test_resume_sharded_at_any_world_size(runs: Session, saved_on: int, resumed_on: int) -> None:
    saved = runs[f"mp{saved_on}"]
    assert not torch.equal(saved["model.table"], _table_values())
    assert (runs.root / f"mp{saved_on}" / ".metadata").is_file()
    restored = runs[resume_name(f"mp{saved_on}", "mp", resumed_on)]
    assert restored["info.layers_are_dtensors"]
    assert {"model.table", "model.cache"} <= set(model_keys(restored))
    assert_restored(saved, restored)


def test_fully_shard_policy_shards_a_plain_model(runs: Session) -> None:
    # "mp1" trains a model whose configure_model shards nothing: only the policy made DTensors.
    saved = runs["mp1"]
    assert saved["info.layers_are_dtensors"]
    restored = runs[resume_name("mp1", "mp-policy", 2)]
    assert restored["info.layers_are_dtensors"]
    assert_restored(saved, restored)


@pytest.mark.parametrize(("source", "resumed_on"), [("fsdp2", 1), ("fsdp1", 2)])
def test_fsdp1_checkpoint_resumes_under_fsdp2(runs: Session, source: str, resumed_on: int) -> None:
    restored = runs[resume_name(source, "mp", resumed_on)]
    assert restored["info.layers_are_dtensors"]
    assert_restored(runs[source], restored)


@pytest.mark.parametrize(("source", "resumed_on"), [("mp2", 2), ("mp2", 1), ("mp1", 2)])
def test_fsdp2_checkpoint_resumes_under_fsdp1(runs: Session, source: str, resumed_on: int) -> None:
    restored = runs[resume_name(source, "fsdp", resumed_on)]
    assert not restored["info.layers_are_dtensors"]
    assert_restored(runs[source], restored)


def test_stock_model_parallel_checkpoint_resumes(runs: Session) -> None:
    assert_restored(runs["stock-mp2"], runs[resume_name("stock-mp2", "mp", 1)])


def test_our_sharded_checkpoint_resumes_in_stock_model_parallel(runs: Session) -> None:
    assert_restored(runs["mp2"], runs[resume_name("mp2", "stock-mp", 2)])


def test_full_save_resumes_at_another_world_size(runs: Session) -> None:
    assert (runs.root / "mp2-full").is_file()
    assert_restored(runs["mp2-full"], runs[resume_name("mp2-full", "mp", 1)])
