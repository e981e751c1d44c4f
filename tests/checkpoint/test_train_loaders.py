"""The train dataloaders' part of an exact resume, in one process: which generators a loader owns, where
a checkpoint stands in its epoch (from real fit-loop progress), and the skip at the sampler."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_sharded.checkpoint import train_loaders
from lightning_sharded.checkpoint.train_loaders import ResumePoint

DATA = list(range(12))


def test_every_generator_a_loader_owns_once_each() -> None:
    g = torch.Generator().manual_seed(1)
    shuffled = DataLoader(DATA, batch_size=2, shuffle=True, generator=g)  # its RandomSampler shares g
    assert train_loaders.generators(shuffled) == {"generator": g}
    own, other = torch.Generator(), torch.Generator()
    two = DataLoader(DATA, batch_size=2, sampler=RandomSampler(DATA, generator=other), generator=own)
    assert train_loaders.generators(two) == {"generator": own, "sampler.generator": other}
    custom = DataLoader(DATA, batch_sampler=BatchSampler(RandomSampler(DATA, generator=other), 2, False))
    assert train_loaders.generators(custom) == {"batch_sampler.sampler.generator": other}
    stateful = StatefulDataLoader(DATA, batch_size=2, shuffle=True)  # its sampler seeds its own
    assert list(train_loaders.generators(stateful)) == ["sampler.generator"]
    assert train_loaders.generators(DataLoader(DATA, batch_size=2)) == {}


def test_generator_states_set_back_and_mismatches_named() -> None:
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(DATA, batch_size=2, shuffle=True, generator=g)
    states = train_loaders.generator_states([loader])
    first = [b.tolist() for b in loader]
    assert train_loaders.set_generator_states(loader, states[0]) == []
    assert [b.tolist() for b in loader] == first
    other = DataLoader(DATA, batch_size=2, sampler=RandomSampler(DATA, generator=torch.Generator()))
    assert train_loaders.set_generator_states(other, states[0]) == ["generator", "sampler.generator"]


def progress(
    batch: tuple[int, int, int, int], last: bool, epoch: tuple[int, int, int, int]
) -> dict[str, Any]:
    """A checkpoint's fit-loop progress: (ready, started, processed, completed) of batches and epochs."""

    def counts(c: tuple[int, int, int, int]) -> dict[str, int]:
        return dict(zip(("ready", "started", "processed", "completed"), c, strict=True))

    return {
        "loops": {
            "fit_loop": {
                "epoch_loop.batch_progress": {
                    "total": counts(batch),
                    "current": counts(batch),
                    "is_last_batch": last,
                },
                "epoch_progress": {"total": counts(epoch), "current": counts(epoch)},
                "epoch_loop.state_dict": {"_batches_that_stepped": 6},
            }
        },
        "epoch": 0,
    }


# As Lightning 2.6 writes them, 6 batches an epoch (checked against real checkpoints of the scenario).
MID = progress((5, 5, 5, 4), False, (1, 1, 0, 0))  # on_train_batch_end of batch 5
LAST = progress((6, 6, 6, 5), True, (1, 1, 0, 0))  # on_train_batch_end of the last batch
AFTER_LAST = progress((6, 6, 6, 6), True, (1, 1, 0, 0))  # on_validation_end after the last batch
MID_VALIDATION = progress((3, 3, 3, 3), False, (1, 1, 0, 0))  # on_validation_end within the epoch
END = progress((6, 6, 6, 6), True, (1, 1, 1, 0))  # on_train_epoch_end
AFTER_FIT = progress((6, 6, 6, 6), True, (1, 1, 1, 1))  # trainer.save_checkpoint after fit


@pytest.mark.parametrize(
    ("checkpoint", "point"),
    [
        (MID, ResumePoint.MID_EPOCH),
        (MID_VALIDATION, ResumePoint.MID_EPOCH),
        (LAST, ResumePoint.LAST_BATCH),
        (AFTER_LAST, ResumePoint.AFTER_LAST_BATCH),
        (END, ResumePoint.EPOCH_END),
        (AFTER_FIT, ResumePoint.EPOCH_END),
        ({"epoch": 0}, None),
    ],
)
def test_where_a_checkpoint_stands_in_its_epoch(
    checkpoint: dict[str, Any], point: ResumePoint | None
) -> None:
    assert train_loaders.resume_point(checkpoint) is point


def test_an_epoch_end_read_as_after_its_last_batch() -> None:
    for saved in (END, AFTER_FIT):
        checkpoint = copy.deepcopy(saved)
        train_loaders.to_after_last_batch(checkpoint)
        assert checkpoint == AFTER_LAST  # batches, loggers' step and all
        assert train_loaders.resume_point(checkpoint) is ResumePoint.AFTER_LAST_BATCH
        assert train_loaders.epoch_of(checkpoint) == 0  # the epoch Lightning finishes first
    assert train_loaders.epoch_of(AFTER_FIT) == 1 and train_loaders.epoch_of({}) == 0
    assert train_loaders.batches_done(MID) == 5 and train_loaders.batches_stepped(END) == 6
    assert train_loaders.batches_done({}) == 0 and train_loaders.batches_stepped({}) is None


def distributed(epoch: int = 0) -> DataLoader[int]:
    sampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(epoch)
    return DataLoader(DATA, batch_size=2, sampler=sampler)


def test_a_distributed_samplers_done_batches_are_skipped_in_the_resumed_epoch_only() -> None:
    unbroken = [b.tolist() for b in distributed()]  # 3 batches of this rank's 6 samples
    loader = distributed()
    sampler = loader.sampler
    assert train_loaders.skip_batches(loader, 2, lambda: True) is None
    assert len(loader) == 3  # Lightning counts the epoch from it: unchanged
    assert [b.tolist() for b in loader] == unbroken[2:]
    assert loader.batch_sampler.sampler is sampler  # put back: the next epoch is whole
    sampler.set_epoch(1)
    assert [b.tolist() for b in loader] == [b.tolist() for b in distributed(1)]


def test_a_skip_whose_epoch_is_over_is_no_skip() -> None:
    loader = distributed()
    assert train_loaders.skip_batches(loader, 2, lambda: False) is None
    assert [b.tolist() for b in loader] == [b.tolist() for b in distributed()]
    assert train_loaders.skip_epoch(loader, lambda: True)
    assert list(loader) == []
    assert train_loaders.skip_epoch(loader, lambda: True)
    train_loaders.unskip(loader)
    assert len(list(loader)) == 3


def test_an_empty_first_epoch_draws_nothing_from_the_sampler() -> None:
    def shuffled() -> DataLoader[int]:
        return DataLoader(
            DATA, batch_size=2, sampler=RandomSampler(DATA, generator=torch.Generator().manual_seed(5))
        )

    loader = shuffled()
    before = loader.sampler.generator.get_state()
    assert train_loaders.skip_epoch(loader, lambda: True)
    assert list(loader) == []
    assert torch.equal(loader.sampler.generator.get_state(), before)
    assert [b.tolist() for b in loader] == [b.tolist() for b in shuffled()]  # as if the epoch had not been


def test_what_cannot_be_skipped_says_why() -> None:
    shuffled = DataLoader(DATA, batch_size=2, shuffle=True)
    why = train_loaders.skip_batches(shuffled, 1, lambda: True)
    assert why is not None and why.startswith("the order of its `RandomSampler` cannot be drawn again")
    assert isinstance(shuffled.batch_sampler.sampler, RandomSampler)  # left as it was
    unbatched = DataLoader(DATA, batch_size=None)
    assert train_loaders.skip_batches(unbatched, 1, lambda: True) == (
        "its batches are not made by a `BatchSampler` (it has NoneType)"
    )
    assert not train_loaders.skip_epoch(unbatched, lambda: True)
    sequential = DataLoader(DATA, batch_size=5, sampler=SequentialSampler(DATA))
    assert train_loaders.skip_batches(sequential, 1, lambda: True) is None
    assert [b.tolist() for b in sequential] == [list(range(5, 10)), [10, 11]]
