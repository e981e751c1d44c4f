"""Both strategies' signatures show their parents' parameters (issue 12, item 8)."""

from __future__ import annotations

import inspect

import pytest
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy


def test_fsdp_signature_shows_fsdp_strategy_parameters_and_ours() -> None:
    shown = inspect.signature(ShardedFSDPStrategy).parameters
    parent = [n for n, p in inspect.signature(FSDPStrategy).parameters.items() if p.kind is not p.VAR_KEYWORD]
    assert [n for n in shown if n in parent] == parent
    assert shown["state_dict_type"].default == "sharded"
    assert shown["async_save"].default is False and shown["verify"].default is False
    assert shown["cpu_offload"].default is None


def test_model_parallel_signature_shows_its_parents_parameters() -> None:
    shown = inspect.signature(ShardedModelParallelStrategy).parameters
    for name in inspect.signature(ModelParallelStrategy).parameters:
        assert name in shown, name
    assert shown["async_save"].default is False


def test_save_distributed_checkpoint_is_a_deprecated_alias_of_state_dict_type() -> None:
    with pytest.deprecated_call(match="state_dict_type='full'"):
        strategy = ShardedModelParallelStrategy(save_distributed_checkpoint=False)
    assert strategy._sharded_state_dict_type == "full"
    assert strategy._save_distributed_checkpoint is False  # type: ignore[attr-defined]
    shown = inspect.signature(ShardedModelParallelStrategy).parameters
    assert shown["state_dict_type"].default == "sharded" and shown["verify"].default is False
