"""Exact resume in the strategies: what each rank saves of its own (:func:`rank_extras`), and when a
resume sets it back (:func:`plan`'s :class:`ExactResume`): at the moment the unbroken run would go on
drawing from each state (``docs/checkpoint-format.md``, "When it is restored";
:class:`~.train_loaders.ResumePoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.utilities import CombinedLoader, rank_zero_info

from lightning_sharded.checkpoint import collective, rank_state, train_loaders
from lightning_sharded.checkpoint.rank_state import quoted
from lightning_sharded.checkpoint.train_loaders import ResumePoint
from lightning_sharded.user_state import registered_rank_state, stateful

__all__ = ["ExactResume", "plan", "rank_extras", "train_loaders_of"]


def train_loaders_of(trainer: Any) -> list[Any]:
    """The train dataloaders of ``trainer``'s fit, flattened as Lightning iterates them (``[]``: none yet)."""
    iterables = getattr(trainer, "train_dataloader", None)
    return [] if iterables is None else list(CombinedLoader(iterables).flattened)


def _call(name: str, obj: Any, method: str, *args: Any) -> Any:
    """``obj.method(*args)`` of the registered state ``name``; its error says which state and method."""
    try:
        return getattr(obj, method)(*args)
    except Exception as err:
        done = "saved" if method == "state_dict" else "restored"
        raise RuntimeError(
            f"The registered per-rank state {name!r} could not be {done}: its {method}() raised"
            f" {type(err).__name__}: {err}"
        ) from err


def rank_extras(module: Any) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """This rank's train dataloader generator states (``None`` outside a fit) and registered states."""
    loaders = train_loaders_of(getattr(module, "_trainer", None))
    generators = train_loaders.generator_states(loaders) if loaders else None
    return generators, {
        name: _call(name, obj, "state_dict") for name, obj in registered_rank_state(module).items()
    }


#: No plain loader was positioned.
_UNSET = object()


@dataclass
class ExactResume:
    """One resume's pending per-rank state, and when each part of it is set.

    Attributes:
        outcome: What :func:`~.rank_state.restore` decided for this rank.
        done: Batches of the epoch done before the checkpoint (the position of a plain loader).
        epoch: The checkpoint's epoch.
        during: Whether the checkpoint's epoch is still the one running (a skip applies in it only).
        early: Set the RNG and generators as the train dataloader is set up (else at ``on_train_start``).
        position: Restore the position of plain loaders (mid-epoch, at the same world size).
        empty_first: The first iterator of loaders that get no state yields nothing.
        loader_state: Lightning loads a state into the train dataloaders that have one.
        stepped: The loggers' step to set at the first batch (``None``: Lightning counts it right).
    """

    outcome: rank_state.RankRestore
    done: int
    epoch: int
    during: Callable[[], bool]
    early: bool
    position: bool
    empty_first: bool
    loader_state: bool
    stepped: int | None = None
    _registered: dict[str, Any] = field(default_factory=dict)
    _loaders: list[Any] = field(default_factory=list)
    _deferred: dict[int, dict[str, Any]] = field(default_factory=dict)
    _skipped: list[str] = field(default_factory=list)
    #: Why a plain loader's position is not restored (``None``: it is; unset: no plain loader to position).
    _why: Any = _UNSET
    _started: bool = False

    def __post_init__(self) -> None:
        self._registered = dict(self.outcome.registered)

    def _restore_registered(self, module: Any) -> None:
        """Load the registered objects' states (collective: a failure on one rank fails every rank alike)."""

        def load() -> None:
            objects = registered_rank_state(module)
            for name in sorted(self._registered.keys() & objects.keys()):
                _call(name, objects[name], "load_state_dict", self._registered.pop(name))

        collective.agree(load)

    def _saved(self, index: int) -> dict[str, Any] | None:
        """The saved generator states of train dataloader ``index``, if any."""
        saved = self.outcome.generators
        return saved[index] if saved is not None and index < len(saved) else None

    def _set_generators(self, index: int, loader: Any) -> None:
        states = self._saved(index)
        mismatched = train_loaders.set_generator_states(loader, states) if states is not None else []
        if mismatched:
            self._skipped.append(f"the generator(s) {', '.join(mismatched)} of train dataloader {index}")

    def on_train_loader(self, loader: Any, module: Any) -> None:
        """A train dataloader of the resume's first setup (a later reload has nothing to restore) is set
        up: Lightning has not loaded its state nor created its iterator yet."""
        if self._started:
            return
        index = len(self._loaders)
        self._loaders.append(loader)
        if index == 0:
            self._restore_registered(module)
        plain = stateful(loader) is None or not self.loader_state
        if self.early:
            if self.outcome.rng is not None:  # again for each loader: the last set is the one before iter()
                rank_state.set_rng_states(self.outcome.rng)
            self._set_generators(index, loader)
        elif self.empty_first and plain:
            train_loaders.skip_epoch(loader, self.during)
        elif self.position and plain and self.done:
            self._position(index, loader)

    def _position(self, index: int, loader: Any) -> None:
        """Skip the batches done in the epoch at ``loader``'s sampler, or defer its generators."""
        if index == 0:
            self._why = train_loaders.skip_batches(loader, self.done, self.during)
        else:  # several loaders: Lightning counts the batches of the longest one, not each one's position
            if 0 not in self._deferred:
                train_loaders.unskip(self._loaders[0])
                self._deferred[0] = self._saved(0) or {}
            self._why = "the fit has several train dataloaders"
        if self._why is not None:
            self._deferred[index] = self._saved(index) or {}

    def on_train_start(self, trainer: Any, module: Any) -> list[str]:
        """Set what is still pending but the deferred generators, now that the first iterator exists (its
        creation draws random numbers; a ``StatefulDataLoader`` resets its generator); returns what could
        not be restored."""
        self._started = True
        self._restore_registered(module)
        loaders = train_loaders_of(trainer)
        where = f"batch {self.done} of epoch {self.epoch}"
        if self._why is None:
            rank_zero_info(
                f"Resumed the train dataloader at {where}: its sampler skips the {self.done} batch(es) done"
                " before the checkpoint, none of them loaded (Lightning's warning that the dataloader is not"
                " resumable does not apply to it)."
            )
        elif self._why is not _UNSET:
            rank_zero_info(
                f"The train dataloader's position ({where}) is not restored: {self._why}. Lightning starts"
                " the epoch over; its generators are set after the first batch, so that the epochs after it"
                " are drawn as in the unbroken run."
            )
        if not self.early:
            if self.outcome.rng is not None:
                self._skipped.extend(rank_state.set_rng_states(self.outcome.rng))
            for index, loader in enumerate(loaders):
                if index not in self._deferred:
                    self._set_generators(index, loader)
        saved = self.outcome.generators
        if saved is not None and len(saved) != len(loaders):
            self._skipped.append(
                f"the generators of the train dataloaders (the checkpoint has {len(saved)} dataloader(s),"
                f" this fit {len(loaders)})"
            )
        if self._registered:
            self._skipped.append(
                f"the registered state {quoted(self._registered)} (nothing is registered under that name now)"
            )
        absent = registered_rank_state(module).keys() - set(self.outcome.registered_saved)
        if absent and self.outcome.saved_world_size is not None:
            self._skipped.append(f"the registered state {quoted(absent)} (the checkpoint has none of it)")
        return self._skipped

    @property
    def pending_first_batch(self) -> bool:
        """Whether :meth:`on_first_batch` has something to set."""
        return bool(self._deferred) or self.stepped is not None

    def on_first_batch(self, trainer: Any) -> None:
        """The first resumed batch was fetched: set the generators deferred for a restarted epoch, and
        the loggers' step where Lightning's restart counted it once more."""
        if trainer is None:
            return
        loop = trainer.fit_loop.epoch_loop
        if self.stepped is not None and hasattr(loop, "_batches_that_stepped"):
            loop._batches_that_stepped = self.stepped
        loaders = train_loaders_of(trainer)
        for index, states in sorted(self._deferred.items()):
            if index < len(loaders) and states:
                train_loaders.set_generator_states(loaders[index], states)
        self._deferred.clear()


def plan(outcome: rank_state.RankRestore, metadata: dict[str, Any], trainer: Any) -> ExactResume:
    """When a resume sets each part of ``outcome``, for the checkpoint ``metadata``: at
    :attr:`ResumePoint.LAST_BATCH` it drops the train dataloader's saved position (the done epoch's end);
    training by steps, it reads an :attr:`ResumePoint.EPOCH_END` one as ``AFTER_LAST_BATCH``."""
    point = train_loaders.resume_point(metadata)
    stepped = None
    if point is ResumePoint.EPOCH_END and trainer.max_steps != -1:
        stepped = train_loaders.batches_stepped(metadata)
        train_loaders.to_after_last_batch(metadata)
        point = ResumePoint.AFTER_LAST_BATCH
    if point is ResumePoint.LAST_BATCH:
        rank_state.set_loader_state(metadata, None)
    epoch = train_loaders.epoch_of(metadata)
    return ExactResume(
        outcome=outcome,
        done=train_loaders.batches_done(metadata),
        epoch=epoch,
        during=lambda: bool(trainer.current_epoch == epoch),
        early=point in (ResumePoint.LAST_BATCH, ResumePoint.EPOCH_END),
        position=point is ResumePoint.MID_EPOCH and outcome.saved_world_size == trainer.world_size,
        empty_first=point is ResumePoint.AFTER_LAST_BATCH,
        loader_state=rank_state.loader_state(metadata) is not None,
        stepped=stepped,
    )
