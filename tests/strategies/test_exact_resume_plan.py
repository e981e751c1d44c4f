"""When a resume sets each rank's own state (``strategies/_exact_resume.py``), in one process: what the plan
makes of each stop point, the plain loader's position, the registered objects and what it reports."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_sharded import register_rank_state
from lightning_sharded.checkpoint import rank_state, train_loaders
from lightning_sharded.strategies import _exact_resume
from tests.checkpoint.test_train_loaders import AFTER_LAST, END, LAST, MID
from tests.test_user_state import Counter

DATA = list(range(12))


def fake_trainer(max_steps: int = -1, loaders: Any = None, epoch: int = 0) -> Any:
    """What `_exact_resume` reads of a Trainer, without one."""
    return SimpleNamespace(max_steps=max_steps, world_size=1, current_epoch=epoch, train_dataloader=loaders)


def with_loader_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    checkpoint = copy.deepcopy(checkpoint)
    checkpoint["loops"]["fit_loop"]["state_dict"] = {"combined_loader": [{"pos": 6}]}
    return checkpoint


def own(generators: Any = None, registered: dict[str, Any] | None = None) -> rank_state.RankRestore:
    return rank_state.RankRestore(
        rng=rank_state.rng_states(),
        generators=generators,
        registered=registered or {},
        registered_saved=tuple(registered or ()),
        saved_world_size=1,
    )


def test_a_last_batch_checkpoint_starts_the_next_epoch_from_the_saved_states() -> None:
    metadata = with_loader_state(LAST)
    resume = _exact_resume.plan(own(), metadata, fake_trainer())
    assert rank_state.loader_state(metadata) is None  # the finished epoch's end is not restored
    assert resume.early and not resume.position and not resume.empty_first and resume.stepped is None


@pytest.mark.parametrize("max_steps", [-1, 18])
def test_an_epoch_end_checkpoint_by_epochs_as_the_last_batch_by_steps_as_after_it(max_steps: int) -> None:
    metadata = with_loader_state(END)
    resume = _exact_resume.plan(own(), metadata, fake_trainer(max_steps))
    if max_steps == -1:  # Lightning ignores the loader state and starts the next epoch at once
        assert resume.early and metadata["loops"] == with_loader_state(END)["loops"]
    else:  # read as saved after the last batch's validation; the loggers' step kept for the first batch
        assert not resume.early and resume.empty_first and resume.stepped == 6
        assert (
            metadata["loops"]["fit_loop"]["epoch_progress"]
            == AFTER_LAST["loops"]["fit_loop"]["epoch_progress"]
        )
        assert rank_state.loader_state(metadata) == [{"pos": 6}]  # exhausted: Lightning finishes the epoch


def test_a_plain_loaders_position_is_skipped_at_its_sampler_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=1)
    loader = DataLoader(DATA, batch_size=2, sampler=sampler)
    unbroken = [b.tolist() for b in loader]
    resume = _exact_resume.plan(own(), copy.deepcopy(MID), fake_trainer(loaders=loader))
    assert resume.position and resume.done == 5
    module = nn.Linear(1, 1)
    resume.on_train_loader(loader, module)
    with caplog.at_level(logging.INFO):
        assert resume.on_train_start(fake_trainer(loaders=loader), module) == []
    assert [b.tolist() for b in loader] == unbroken[5:]
    assert (
        "Resumed the train dataloader at batch 5 of epoch 0: its sampler skips the 5 batch(es) done before"
        " the checkpoint, none of them loaded"
    ) in caplog.text
    assert not resume.pending_first_batch


def test_a_shuffled_loaders_generators_wait_for_the_first_batch(caplog: pytest.LogCaptureFixture) -> None:
    g = torch.Generator().manual_seed(3)
    loader = DataLoader(DATA, batch_size=2, shuffle=True, generator=g)
    saved = torch.Generator().manual_seed(42).get_state()
    resume = _exact_resume.plan(
        own(generators=[{"generator": saved}]), copy.deepcopy(MID), fake_trainer(loaders=loader)
    )
    module = nn.Linear(1, 1)
    resume.on_train_loader(loader, module)
    with caplog.at_level(logging.INFO):
        resume.on_train_start(fake_trainer(loaders=loader), module)
    assert (
        "The train dataloader's position (batch 5 of epoch 0) is not restored: the order of its"
        in caplog.text
    )
    assert resume.pending_first_batch and not torch.equal(g.get_state(), saved)
    resume.on_first_batch(
        SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()), train_dataloader=loader)
    )
    assert torch.equal(g.get_state(), saved)


def test_registered_objects_are_restored_and_the_unmatched_names_reported() -> None:
    module = nn.Linear(1, 1)
    counter, fresh = Counter(), Counter()
    register_rank_state(module, "counter", counter)
    register_rank_state(module, "fresh", fresh)
    outcome = own(registered={"counter": {"n": 7}, "gone": {"n": 1}})
    resume = _exact_resume.plan(outcome, copy.deepcopy(MID), fake_trainer())
    resume.on_train_loader(DataLoader(DATA, batch_size=2), module)
    assert counter.n == 7 and fresh.n == 0  # at the train dataloader's setup, before its first iterator
    assert resume.on_train_start(fake_trainer(), module) == [
        "the registered state 'gone' (nothing is registered under that name now)",
        "the registered state 'fresh' (the checkpoint has none of it)",
    ]


def test_a_registered_load_that_fails_names_the_state() -> None:
    class Broken(Counter):
        def load_state_dict(self, state: dict[str, int]) -> None:
            raise KeyError("level")

    module = nn.Linear(1, 1)
    register_rank_state(module, "curriculum", Broken())
    resume = _exact_resume.plan(own(registered={"curriculum": {}}), copy.deepcopy(MID), fake_trainer())
    with pytest.raises(
        Exception,
        match=r"The registered per-rank state 'curriculum' could not be restored: its"
        r" load_state_dict\(\) raised KeyError: 'level'",
    ):
        resume.on_train_loader(DataLoader(DATA, batch_size=2), module)


def test_a_registered_save_that_fails_names_the_state() -> None:
    class Broken(Counter):
        def state_dict(self) -> dict[str, int]:
            raise ValueError("not now")

    module = nn.Linear(1, 1)
    register_rank_state(module, "mix", Broken())
    with pytest.raises(
        RuntimeError, match=r"'mix' could not be saved: its state_dict\(\) raised ValueError: not now"
    ):
        _exact_resume.rank_extras(module)


def test_a_checkpoint_without_loop_progress_is_left_alone() -> None:
    metadata = {"epoch": 0, "state_dict": {}}
    resume = _exact_resume.plan(rank_state.RankRestore(), metadata, fake_trainer())
    assert metadata == {"epoch": 0, "state_dict": {}}
    assert not (resume.early or resume.position or resume.empty_first)


class _StatefulLoader(DataLoader):  # type: ignore[type-arg]
    """A loader Lightning loads a position into (as torchdata's ``StatefulDataLoader``)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize(
    ("point", "when"),
    [("last batch", "setup"), ("after last batch", "start"), ("mid epoch, stateful", "start")],
)
def test_the_saved_generators_are_set_back_at_their_moment(point: str, when: str) -> None:
    """Each generator a loader owns (its own and its sampler's) holds the saved state once the resume
    reaches the point's moment: the loader's setup (before its first iterator), or ``on_train_start``."""
    from torch.utils.data import RandomSampler

    metadata = {
        "last batch": LAST,
        "after last batch": AFTER_LAST,
        "mid epoch, stateful": with_loader_state(MID),
    }[point]
    loader_gen, sampler_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    kind = _StatefulLoader if point.endswith("stateful") else DataLoader
    loader = kind(
        DATA, batch_size=2, sampler=RandomSampler(DATA, generator=sampler_gen), generator=loader_gen
    )
    saved = {
        "generator": torch.Generator().manual_seed(40).get_state(),
        "sampler.generator": torch.Generator().manual_seed(41).get_state(),
    }
    assert sorted(saved) == sorted(train_loaders.generators(loader))  # both, each once
    resume = _exact_resume.plan(
        own(generators=[saved]), copy.deepcopy(metadata), fake_trainer(loaders=loader)
    )
    module = nn.Linear(1, 1)

    def restored() -> bool:
        return torch.equal(loader_gen.get_state(), saved["generator"]) and torch.equal(
            sampler_gen.get_state(), saved["sampler.generator"]
        )

    resume.on_train_loader(loader, module)
    assert restored() == (when == "setup"), point
    assert resume.on_train_start(fake_trainer(loaders=loader), module) == []
    assert restored(), point
    assert not resume.pending_first_batch
