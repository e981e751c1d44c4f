"""What the strategies do to a LightningModule before any process starts (one process, no group)."""

from __future__ import annotations

import lightning as L
import pytest
from torch import nn

from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy, ShardedStateMixin
from lightning_sharded.hooks import has_sharded_state_hooks


class Plain(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)


class WithMixin(ShardedStateMixin, Plain):
    pass


@pytest.mark.parametrize("strategy_class", [ShardedFSDPStrategy, ShardedModelParallelStrategy])
@pytest.mark.parametrize("model_class", [Plain, WithMixin])
def test_hooks_are_registered_once(strategy_class: type, model_class: type) -> None:
    model = model_class()
    strategy = strategy_class()
    strategy._lightning_module = model
    before = len(model._state_dict_hooks)
    strategy._register_sharded_state_hooks()
    strategy._register_sharded_state_hooks()
    assert has_sharded_state_hooks(model)
    assert len(model._state_dict_hooks) == before + (0 if model_class is WithMixin else 1)


def test_defaults() -> None:
    assert ShardedFSDPStrategy()._sharded_state_dict_type == "sharded"
    assert ShardedFSDPStrategy(state_dict_type="full")._sharded_state_dict_type == "full"
    assert ShardedFSDPStrategy().restore_checkpoint_after_setup
    assert ShardedModelParallelStrategy().restore_checkpoint_after_setup
    assert ShardedFSDPStrategy()._model_key == "model"
    assert ShardedModelParallelStrategy()._model_key == "state_dict"
