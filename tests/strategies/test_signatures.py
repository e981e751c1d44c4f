"""Both strategies' signatures show their parents' parameters (issue 12, item 8)."""

from __future__ import annotations

import inspect
import typing

import pytest
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from typing_extensions import Unpack, get_overloads

from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy
from lightning_sharded.strategies._options import CheckpointOptions, CheckpointOptionsKwargs


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


def test_static_tools_see_the_declared_options() -> None:
    """IDEs and mypy read no `__signature__`: they read `**options: Unpack[CheckpointOptionsKwargs]`, which
    must name and type each option exactly as `CheckpointOptions` declares it."""
    declared = typing.get_type_hints(CheckpointOptions)
    assert typing.get_type_hints(CheckpointOptionsKwargs) == declared
    assert CheckpointOptionsKwargs.__optional_keys__ == frozenset(declared)
    static = Unpack[CheckpointOptionsKwargs]
    assert typing.get_type_hints(ShardedModelParallelStrategy.__init__)["options"] == static
    fsdp = [typing.get_type_hints(f)["kwargs"] for f in get_overloads(ShardedFSDPStrategy.__init__)]
    assert static in fsdp
