"""An optimizer with no per-parameter state (plain SGD) resumes from a sharded checkpoint in one process.

A sharded load builds the optimizer's state to read into from the checkpoint's index and calls a
trainable parameter without state missing from the checkpoint only when the optimizer has state at
all: plain SGD has none, and its resume must not fail. (A mutant that negated that condition passed the
load tests, which all resume Adam.)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lightning_sharded.checkpoint import state_dicts
from lightning_sharded.checkpoint.load import restore_checkpoint
from tests.checkpoint.one_process import save_sharded, stepped


def test_plain_sgd_without_state_resumes_with_its_parameter_groups(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    stepped(model, optimizer, 8)
    assert not state_dicts.optimizer_state_dict(model, optimizer, full=False)["state"]  # the case under test
    path = save_sharded(tmp_path / "sharded.ckpt", model, optimizer)

    fresh = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    resumed = torch.optim.SGD(fresh.parameters(), lr=1.0)
    restore_checkpoint(path, fresh, [resumed])
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True))
    assert resumed.param_groups[0]["lr"] == 0.25
    assert not resumed.state


def test_adam_state_resumes_as_it_was_saved_values_dtypes_and_no_grad(tmp_path: Path) -> None:
    # Every state tensor comes back equal, of its dtype and not requiring grad (as the optimizer made it):
    # a template that required grad would hand autograd leaves to the optimizer, saved so again later.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.25)
    stepped(model, optimizer, 8)
    path = save_sharded(tmp_path / "sharded.ckpt", model, optimizer)

    fresh = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    resumed = torch.optim.Adam(fresh.parameters(), lr=1.0)
    restore_checkpoint(path, fresh, [resumed])
    saved, restored = optimizer.state_dict()["state"], resumed.state_dict()["state"]
    assert sorted(saved) == sorted(restored)
    for index, state in saved.items():
        assert sorted(state) == sorted(restored[index])
        for name, value in state.items():
            back = restored[index][name]
            assert torch.equal(back, value) and back.dtype == value.dtype, (index, name)
            assert not back.requires_grad, (index, name)
