"""Partial loads and saves of both strategies: a warm start, parts left out of a resume, and
trainable-only checkpoints (only what trains is saved; the frozen rest is read from where it came from).

It decides what to load or save and calls :mod:`lightning_sharded.checkpoint.load` and
:func:`~lightning_sharded.checkpoint.tools.pretrained.load_frozen`; the checkpoint logic is theirs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from lightning_sharded._fqn import parameter_names
from lightning_sharded.checkpoint import collective, load
from lightning_sharded.checkpoint.async_save import wait_for_saves_to
from lightning_sharded.checkpoint.backends import Location, local_path, location
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.integrity import VerifyMode
from lightning_sharded.checkpoint.load.checks import global_shape, summarize_keys
from lightning_sharded.checkpoint.manifest import FrozenPart
from lightning_sharded.foreign import attach_fused_state
from lightning_sharded.hooks import register_sharded_state_hooks

__all__ = ["PartialCheckpoints"]


class PartialCheckpoints(ParallelStrategy):
    """The warm start, ``exclude_from_loading`` and ``save_trainable_only`` of the strategies."""

    # The options (`CheckpointOptions.apply` sets them, paths absolute, `verify` as its mode).
    warm_start: str | None
    exclude_from_loading: tuple[str, ...]
    save_trainable_only: bool
    frozen_source: str | None
    frozen_prefix: str
    verify: VerifyMode | None
    checkpoint_timeout: float | None
    _bounded_group: Any = None
    _bounded_group_made: bool = False
    _warm_start_pending: bool = False
    _warm_started: bool = False
    _frozen_checked: FrozenPart | None = None

    def _register_sharded_state_hooks(self) -> None:
        """Register the sharded-state hooks on the LightningModule unless it has them (the mixin)."""
        module = self.lightning_module
        if module is not None:
            register_sharded_state_hooks(module)  # idempotent: a no-op for a module of the mixin
            # TorchRec's fused optimizer state: its layouts are exchanged here, on every rank at once,
            # rather than at the first state_dict() (after configure_model, which sharded the tables).
            attach_fused_state(module)

    # ------------------------------------------------------------------------------------- loading

    @contextlib.contextmanager
    def _bounded(self) -> Iterator[None]:
        """Inside, the checkpoint's collectives run on a gloo group whose collectives fail after
        :attr:`checkpoint_timeout` (made on first use: collective, as every save and load is)."""
        if not self._bounded_group_made:
            if self.checkpoint_timeout is not None:
                self._bounded_group = collective.bounded_group(self.checkpoint_timeout)
            self._bounded_group_made = True
        with collective.scope(self._bounded_group):
            yield

    def _restore(
        self,
        path: Location,
        optimizers: Sequence[Optimizer],
        weights_only: bool | None,
        *,
        read_metadata: bool = True,
    ) -> load.Restored:
        """Load ``path`` into the model (and ``optimizers``), and a trainable-only checkpoint's frozen
        part from its source; collective, bounded (every load: a resume, a warm start, a frozen part).
        Warns about what a non-strict load skipped."""
        # It may be one that an earlier Trainer's strategy still writes in the background (after `fit`).
        wait_for_saves_to(path)
        with self._bounded():
            assert self.model is not None
            module = self.lightning_module
            assert module is not None
            self._register_sharded_state_hooks()
            restored = load.restore_checkpoint(
                path,
                self.model,
                optimizers,
                strict=module.strict_loading,
                weights_only=weights_only,
                verify=self.verify,
                read_metadata=read_metadata,
            )
            if restored.keys:
                rank_zero_warn(
                    f"Loaded the checkpoint {str(path)!r} non-strictly (`strict_loading=False`), skipping"
                    f" keys that only one side has. {restored.keys.describe()}"
                )
            frozen = restored.frozen
            if frozen is not None and frozen.keys:
                from lightning_sharded.checkpoint.tools.pretrained import load_frozen

                if self.frozen_source is not None and self.frozen_source != frozen.source:
                    rank_zero_info(
                        f"{str(path)!r} names {frozen.source!r} as its frozen source; reading the frozen"
                        f" weights from `frozen_source={self.frozen_source!r}` instead."
                    )
                    frozen = FrozenPart(self.frozen_source, frozen.keys, self.frozen_prefix)
                load_frozen(self.model, frozen, checkpoint=str(path), weights_only=weights_only)
                rank_zero_info(
                    f"{str(path)!r} holds the trainable weights only: read its {len(frozen.keys)} frozen"
                    f" parameter(s) from {frozen.source!r}"
                )
            return restored

    def _schedule_warm_start(self) -> None:
        """At the start of a fit: a warm start waits for the end of Lightning's restore step, where it
        runs unless the fit resumed from a checkpoint (``ckpt_path``) meanwhile."""
        module = self.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        self._warm_start_pending = bool(self.warm_start) and fitting and not self._warm_started

    def _cancel_warm_start(self, resumed_from: Location) -> None:
        if self._warm_start_pending:
            self._warm_start_pending = False
            rank_zero_info(
                f"Resuming from {str(resumed_from)!r}: `warm_start={self.warm_start!r}` is not loaded (it"
                " starts runs that do not resume)."
            )

    def _run_warm_start(self) -> None:
        self._warm_start_pending = False
        self._warm_started = True
        assert self.warm_start is not None
        path = location(self.warm_start)
        start = time.perf_counter()
        self._restore(path, [], None, read_metadata=False)
        rank_zero_info(
            f"Warm start: loaded the model state from {str(path)!r} in {time.perf_counter() - start:.2f} s;"
            " the optimizers, LR schedulers, loops and step count start fresh"
        )

    # -------------------------------------------------------------------------------------- saving

    def _frozen_part(self) -> FrozenPart | None:
        """With ``save_trainable_only``: the parameters with ``requires_grad=False`` (clean names) and the
        source they are read from; ``None`` when nothing is frozen or the option is off."""
        module = self.lightning_module
        if not self.save_trainable_only or module is None:
            return None
        names = parameter_names(module)
        keys = tuple(sorted({names[id(p)] for p in module.parameters() if not p.requires_grad}))
        if not keys:
            return None
        assert self.frozen_source is not None
        return FrozenPart(self.frozen_source, keys, self.frozen_prefix)

    def _drop_frozen(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (the model's, sharded or full) without the frozen parameters. The first time, the
        frozen source is checked to hold each of them with its shape (on rank 0, shared): a
        trainable-only checkpoint that could not be loaded is never written."""
        frozen = self._frozen_part()
        if frozen is None:
            return state
        if frozen != self._frozen_checked:
            shapes = {key: global_shape(state[key]) for key in frozen.keys if key in state}
            collective.decide(lambda: _check_source(frozen, shapes))
            self._frozen_checked = frozen
        return {key: value for key, value in state.items() if key not in frozen.keys}


def _check_source(frozen: FrozenPart, shapes: dict[str, tuple[int, ...] | None]) -> None:
    """Rank 0: the frozen source holds every frozen key (less the prefix) with the model's shape."""
    from lightning_sharded.checkpoint.tools.weight_sources import list_source

    prefix = frozen.prefix
    hint = f" with `frozen_prefix={prefix!r}`" if prefix else ""
    outside = [key for key in frozen.keys if not key.startswith(prefix)]
    if outside:
        raise CheckpointError(
            f"`save_trainable_only`: the frozen parameter(s) {summarize_keys(outside)} do not start with"
            f" `frozen_prefix={prefix!r}`, so they cannot come from {frozen.source!r}. Freeze only weights"
            " loaded from the frozen source, or set `frozen_prefix` to what their keys start with."
        )
    on_disk = local_path(location(frozen.source))  # a URL is looked up by list_source below
    if on_disk is not None and not on_disk.exists():
        raise FileNotFoundError(
            f"`save_trainable_only`: the frozen source {frozen.source!r} does not exist. Name the weights the"
            " frozen parameters were loaded from with `frozen_source=`."
        )
    listing = list_source(frozen.source, True)
    missing = [key for key in frozen.keys if key[len(prefix) :] not in listing.shapes]
    differ = [
        f"{key}: the source has {list(listing.shapes[key[len(prefix) :]])}, the model {list(shape)}"
        for key, shape in sorted(shapes.items())
        if key not in missing and shape is not None and tuple(shape) != listing.shapes[key[len(prefix) :]]
    ]
    if missing or differ:
        found = f" lacks {summarize_keys(missing)}" if missing else ""
        bad = f"{';' if missing else ''} holds other shapes ({'; '.join(differ)})" if differ else ""
        raise CheckpointError(
            f"`save_trainable_only`: the frozen source {listing.shown!r}{hint}{found}{bad}, so a checkpoint"
            " without those frozen parameters could not be loaded. Name the weights they were loaded from"
            " with `frozen_source=` (and `frozen_prefix=`), or set `save_trainable_only=False`."
        )
