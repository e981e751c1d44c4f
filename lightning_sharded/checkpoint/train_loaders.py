"""The train dataloaders' part of an exact resume: their generators, where the epoch stood, their position.

Every ``torch.Generator`` a loader owns is saved per rank: ``torchdata``'s ``StatefulDataLoader``
restores its position but leaves these in another state than the unbroken run's (the next epoch's
shuffle differed); a plain ``DataLoader`` saves nothing.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

__all__ = [
    "GENERATOR_PATHS",
    "ResumePoint",
    "batches_done",
    "batches_stepped",
    "epoch_of",
    "fit_loop",
    "generator_states",
    "resume_point",
    "set_generator_states",
    "skip_batches",
    "skip_epoch",
    "to_after_last_batch",
    "unskip",
]

#: Where a loader keeps a generator, in the order they are saved.
GENERATOR_PATHS = ("generator", "sampler.generator", "batch_sampler.sampler.generator")
_BATCH_PROGRESS = "epoch_loop.batch_progress"
_EPOCH_PROGRESS = "epoch_progress"


def generators(loader: Any) -> dict[str, torch.Generator]:
    """The generators ``loader`` owns, by the first path of :data:`GENERATOR_PATHS` that reaches each."""
    found: dict[str, torch.Generator] = {}
    for path in GENERATOR_PATHS:
        gen = functools.reduce(lambda obj, part: getattr(obj, part, None), path.split("."), loader)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found.values()):
            found[path] = gen
    return found


def generator_states(loaders: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
    """Each loader's generators' states (``get_state()``), in loader order."""
    return [{path: gen.get_state() for path, gen in generators(loader).items()} for loader in loaders]


def set_generator_states(loader: Any, states: Mapping[str, torch.Tensor]) -> list[str]:
    """Set ``loader``'s generators from its entry of :func:`generator_states`; returns the paths saved but
    not found now, or found now but not saved."""
    now = generators(loader)
    for path in sorted(now.keys() & states.keys()):
        now[path].set_state(states[path])
    return sorted(now.keys() ^ states.keys())


class ResumePoint(enum.Enum):
    """Where in its epoch a checkpoint was saved, as the fit loop's progress in it tells. What a resume
    does at each is a row of the table of ``docs/checkpoint-format.md``, "When it is restored":
    ``MID_EPOCH`` (within an epoch), ``LAST_BATCH`` (on the last batch), ``EPOCH_END`` (at the epoch's
    end; by steps read as ``AFTER_LAST_BATCH``, :func:`to_after_last_batch`) and ``AFTER_LAST_BATCH``
    (after the last batch's validation; a plain loader's first iterator then yields nothing,
    :func:`skip_epoch`).
    """

    MID_EPOCH = "mid-epoch"
    LAST_BATCH = "last batch"
    AFTER_LAST_BATCH = "after the last batch"
    EPOCH_END = "epoch end"


def fit_loop(checkpoint: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    """``checkpoint["loops"]["fit_loop"][key]`` of a Lightning checkpoint, or ``None`` if not a mapping."""
    loop: Any = checkpoint
    for part in ("loops", "fit_loop", key):
        loop = loop.get(part) if isinstance(loop, Mapping) else None
    return loop if isinstance(loop, Mapping) else None


def _counts(progress: Mapping[str, Any] | None, which: str) -> tuple[int, int, int, int]:
    counts = (progress or {}).get(which) or {}
    return tuple(int(counts.get(k, 0)) for k in ("ready", "started", "processed", "completed"))  # type: ignore[return-value]


def resume_point(checkpoint: Mapping[str, Any]) -> ResumePoint | None:
    """Where the Lightning checkpoint ``checkpoint`` was saved in its epoch (``None``: no loop progress)."""
    batches, epochs = fit_loop(checkpoint, _BATCH_PROGRESS), fit_loop(checkpoint, _EPOCH_PROGRESS)
    if batches is None or epochs is None:
        return None
    _, epoch_started, epoch_processed, _ = _counts(epochs, "total")
    if epoch_processed >= epoch_started:
        return ResumePoint.EPOCH_END
    if not batches.get("is_last_batch"):
        return ResumePoint.MID_EPOCH
    _, _, processed, completed = _counts(batches, "current")
    return ResumePoint.LAST_BATCH if completed < processed else ResumePoint.AFTER_LAST_BATCH


def to_after_last_batch(checkpoint: Mapping[str, Any]) -> None:
    """Rewrite an ``EPOCH_END`` checkpoint's fit loop progress, in place, as an ``AFTER_LAST_BATCH`` one's:
    the epoch counted as not processed yet (its batches stay done)."""
    epochs = fit_loop(checkpoint, _EPOCH_PROGRESS)
    for which in ("total", "current"):
        counts = epochs.get(which) if epochs is not None else None
        if isinstance(counts, dict) and int(counts.get("started", 0)) > 0:
            done = int(counts["started"]) - 1
            counts["processed"], counts["completed"] = done, min(int(counts.get("completed", 0)), done)


def batches_stepped(checkpoint: Mapping[str, Any]) -> int | None:
    """The fit loop's count of batches that stepped the optimizer (the loggers' step) in a checkpoint."""
    value = (fit_loop(checkpoint, "epoch_loop.state_dict") or {}).get("_batches_that_stepped")
    return int(value) if isinstance(value, int) else None


def epoch_of(checkpoint: Mapping[str, Any]) -> int:
    """The epoch a resume of ``checkpoint`` runs first (``trainer.current_epoch``: the completed epochs)."""
    return _counts(fit_loop(checkpoint, _EPOCH_PROGRESS), "current")[3]


def batches_done(checkpoint: Mapping[str, Any]) -> int:
    """The batches of the current epoch fetched before the checkpoint (its fit loop's progress)."""
    return _counts(fit_loop(checkpoint, _BATCH_PROGRESS), "current")[0]


class _SkipOnce(torch.utils.data.Sampler[Any]):
    """Stands in for a batch sampler's sampler until its next iteration, which puts the sampler back and,
    if ``during()`` (the resumed epoch is the one running), skips its first ``skip`` indices (all of them
    without iterating it, when ``skip`` covers the epoch). Its length stays the sampler's, from which
    Lightning counts the epoch's batches."""

    def __init__(self, owner: Any, sampler: Any, skip: int, during: Callable[[], bool]) -> None:
        self.owner, self.sampler, self.skip, self.during = owner, sampler, skip, during

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        self.owner.sampler = self.sampler
        if not self.during():
            return iter(self.sampler)
        if self.skip >= len(self.sampler):
            return iter(())
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __getattr__(self, name: str) -> Any:  # set_epoch, num_replicas...: the sampler's own
        if name in ("owner", "sampler", "skip", "during"):
            raise AttributeError(name)
        return getattr(self.sampler, name)


def _batch_sampler(loader: Any) -> tuple[Any, Any] | str:
    """``loader``'s ``BatchSampler`` and the sampler it draws from, or why it has none."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None)
    if not isinstance(batch_sampler, BatchSampler) or sampler is None:
        return f"its batches are not made by a `BatchSampler` (it has {type(batch_sampler).__name__})"
    return batch_sampler, sampler.sampler if isinstance(sampler, _SkipOnce) else sampler


def skip_batches(loader: Any, batches: int | None, during: Callable[[], bool]) -> str | None:
    """Make ``loader``'s next iterator skip its first ``batches`` batches at its sampler, none loaded, if
    it starts while ``during()`` is true (in the resumed epoch). Only where the skipped indices are the
    unbroken run's: its ``BatchSampler`` draws from a ``DistributedSampler`` or ``SequentialSampler``
    (``None``: the whole epoch, from any sampler). Returns ``None`` when done, else why it cannot be."""
    found = _batch_sampler(loader)
    if isinstance(found, str):
        return found
    batch_sampler, sampler = found
    if batches is not None and type(sampler) not in (DistributedSampler, SequentialSampler):
        return (
            f"the order of its `{type(sampler).__name__}` cannot be drawn again (use a `DistributedSampler`,"
            " or torchdata's `StatefulDataLoader`, whose state holds its position)"
        )
    skip = len(sampler) if batches is None else batches * batch_sampler.batch_size
    batch_sampler.sampler = _SkipOnce(batch_sampler, sampler, skip, during)
    return None


def skip_epoch(loader: Any, during: Callable[[], bool]) -> bool:
    """Make ``loader``'s next iterator yield nothing (its sampler not iterated) if it starts while
    ``during()`` is true; ``False`` if it cannot (no ``BatchSampler``)."""
    return skip_batches(loader, None, during) is None


def unskip(loader: Any) -> None:
    """Undo :func:`skip_batches` / :func:`skip_epoch` on ``loader`` before its next iterator exists."""
    found = _batch_sampler(loader)
    if not isinstance(found, str):
        found[0].sampler = found[1]
