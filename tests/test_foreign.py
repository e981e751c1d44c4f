"""lightning_sharded.foreign without TorchRec: modules are recognised by TorchRec's class only once TorchRec
was imported (a stand-in module here), nothing is imported to look, and the DDP names are the ones
``named_parameters`` gives. The real TorchRec runs are in tests/test_torchrec.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from lightning_sharded import ShardedStateMixin
from lightning_sharded.foreign import (
    ddp_ignored_names,
    foreign_modules,
    foreign_parameters,
    is_inside_foreign,
)


class FakeShardedModule(nn.Module):
    """Stands for ``torchrec.distributed.types.ShardedModule``: a table of which this rank holds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)
        self.table = nn.Parameter(torch.empty(0))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = FakeShardedModule()
        self.dense = nn.Linear(2, 1)


@pytest.fixture
def torchrec_types(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("torchrec.distributed.types")
    fake.ShardedModule = FakeShardedModule  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchrec.distributed.types", fake)


def test_nothing_is_foreign_and_nothing_imported_without_torchrec() -> None:
    if "torchrec.distributed.types" in sys.modules:
        pytest.skip("TorchRec was imported in this process (the TorchRec venv): nothing to prove here")
    model = Model()
    assert foreign_modules(model) == [] and ddp_ignored_names(model) == []
    assert "torchrec.distributed.types" not in sys.modules


def test_sharded_modules_their_insides_and_ddp_names(torchrec_types: None) -> None:
    model = Model()
    assert foreign_modules(model) == [("sparse", model.sparse)]
    assert foreign_parameters(model) == set(model.sparse.parameters())
    assert is_inside_foreign(model) == {id(model.sparse), id(model.sparse.inner)}
    assert ddp_ignored_names(model) == ["sparse.inner.bias", "sparse.inner.weight", "sparse.table"]


def test_the_mixin_gives_ddp_the_names_beside_the_users(torchrec_types: None) -> None:
    import lightning as L

    class Rec(ShardedStateMixin, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.sparse = FakeShardedModule()
            self.dense = nn.Linear(2, 1)

    model = Rec()
    assert model._ddp_params_and_buffers_to_ignore == [
        "sparse.inner.bias",
        "sparse.inner.weight",
        "sparse.table",
    ]
    # What DistributedDataParallel._set_params_and_buffers_to_ignore_for_model does: kept, and ours added.
    model._ddp_params_and_buffers_to_ignore = ["dense.bias"]
    assert model._ddp_params_and_buffers_to_ignore == [
        "dense.bias",
        "sparse.inner.bias",
        "sparse.inner.weight",
        "sparse.table",
    ]
