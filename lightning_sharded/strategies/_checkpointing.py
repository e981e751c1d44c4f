"""The checkpoint half both strategies share: gather, save, restore after setup, remove.

It calls :mod:`lightning_sharded.checkpoint.save` and :mod:`~lightning_sharded.checkpoint.load`, which
hold the checkpoint logic. The strategies put it first in their bases: its overrides replace the parent's.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sharded._exit import drain_at_exit
from lightning_sharded._registry import register
from lightning_sharded.checkpoint import collective, commit, load, names, rank_state, save, state_dicts
from lightning_sharded.checkpoint.async_save import AsyncSaver
from lightning_sharded.checkpoint.backends import Location, absolute, basename, location
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.load.parts import RANK_STATE, drop_parts
from lightning_sharded.strategies import _exact_resume
from lightning_sharded.strategies._options import StateDictType
from lightning_sharded.strategies._partial import PartialCheckpoints

#: What Lightning types a checkpoint path as (its `_PATH`, spelled here without the private name).
PathLike = str | os.PathLike[str]
#: Where the Lightning strategies ours extend live (their names lead stock's words in our errors).
_STOCK = "lightning.pytorch.strategies"


def _remove(path: Location) -> None:
    """Remove the checkpoint at ``path`` with its save leftovers; one that is not there is fine."""
    with contextlib.suppress(FileNotFoundError):
        commit.remove_checkpoint(path)


def _key(path: Location) -> str:
    """The one spelling of a checkpoint's path that a save and a later load compare."""
    return str(absolute(path))


class ShardedCheckpointing(PartialCheckpoints):
    """Checkpoint overrides shared by :class:`ShardedFSDPStrategy` and :class:`ShardedModelParallelStrategy`,
    which apply their :class:`~lightning_sharded.strategies._options.CheckpointOptions`."""

    #: Where the model state goes in a sharded directory ("model" for FSDP, "state_dict" for ModelParallel).
    _model_key: str = "model"
    # The options (`CheckpointOptions.apply` sets them; `async_save` may be switched later).
    _sharded_state_dict_type: StateDictType
    async_save: bool
    save_rank_state: bool
    check_space: bool
    _async_saver: AsyncSaver | None = None
    #: The paths of background saves that failed (by :func:`_key`), with their errors.
    _failed_saves: Mapping[str, BaseException] = {}
    #: What a resume still has to set of each rank's own state, and when (:meth:`_restore_rank_state`).
    _resume: _exact_resume.ExactResume | None = None
    #: The names the class registers in Lightning's ``StrategyRegistry`` (:mod:`lightning_sharded._registry`).
    _registry_names: tuple[str, ...] = ()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register this class's names (``sharded_fsdp``...) in ``strategy_registry``, as Lightning's own
        strategies do; ``import lightning_sharded`` registers them in Lightning's registry already."""
        register(strategy_registry, cls._registry_names, strategy=cls)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # The process group exists now: let its worker threads finish before the interpreter exits.
        drain_at_exit()
        self._schedule_warm_start()

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint being written in the background, if any, is published.

        Raises:
            CheckpointError: that background save failed (the previous checkpoint at its path is intact).
        """
        if self._async_saver is not None:
            self._waited(self._async_saver.wait)

    def _waited(self, wait: Any) -> None:
        """Run ``wait`` (the saver's wait or close); a background save it reports failed is remembered
        by its path, so a later load of that path raises its error instead of reading what is there."""
        saver = self._async_saver
        assert saver is not None
        try:
            wait()
        except BaseException as err:
            if saver.failed is not None:
                self._failed_saves = {**self._failed_saves, _key(saver.failed): err}
                saver.failed = None
            raise

    def _saver(self) -> AsyncSaver:
        if self._async_saver is None:
            self._async_saver = AsyncSaver(type(self).__name__, timeout_s=self.checkpoint_timeout)
        return self._async_saver

    def _custom_checkpoint_io(self) -> CheckpointIO | None:
        """The ``CheckpointIO`` plugin given to the Trainer, or ``None`` for the default one."""
        plugin = self.checkpoint_io
        return None if type(plugin) is TorchCheckpointIO else plugin

    def _defer_logger_notifications(self) -> None:
        """Defer the loggers' ``after_save_checkpoint`` (W&B/MLflow ``log_model`` upload the file), which
        ``ModelCheckpoint`` calls right after ``save_checkpoint`` returns, until the save in flight is
        published (checked at every training batch and by every wait); a save that fails drops it."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        for logger in trainer.loggers if trainer is not None else []:
            original = logger.after_save_checkpoint
            if getattr(original, "_lightning_sharded_deferred", False):
                continue

            def deferred(checkpoint_callback: Any, _original: Any = original) -> None:
                saver = self._async_saver
                if saver is None:
                    _original(checkpoint_callback)
                else:
                    saver.on_published(lambda: _original(checkpoint_callback))

            deferred._lightning_sharded_deferred = True  # type: ignore[attr-defined]
            logger.after_save_checkpoint = deferred  # type: ignore[method-assign]

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._async_saver is not None:
            self._async_saver.poll()  # deferred logger notifications of a save published meanwhile
        resume, self._resume = self._resume, None
        if resume is not None:  # generators of a restarted epoch, set once its shuffle is drawn
            resume.on_first_batch(getattr(self.lightning_module, "_trainer", None))
        super().on_train_batch_start(batch, batch_idx)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        if self._resume is not None and trainer is not None and trainer.training:
            self._resume.on_train_loader(dataloader, module)  # before Lightning loads it or iterates it
        return dataloader

    @property
    def _saves_sharded(self) -> bool:
        return self._sharded_state_dict_type == "sharded"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return self._drop_frozen(state_dicts.model_state_dict(self.model, full=not self._saves_sharded))

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        with self._bounded():  # the FSDP1 fast path's agreement: on the bounded gloo group
            return state_dicts.optimizer_state_dict(self.model, optimizer, full=not self._saves_sharded)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: ``load_checkpoint()`` already loaded the model into its shards."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: ``load_checkpoint()`` already loaded the optimizer states."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Any | None = None
    ) -> None:
        """Save a sharded directory (``state_dict_type="sharded"``) or one full file (``"full"``).

        Collective. The path of rank 0 is used on every rank. A full file goes through the strategy's
        ``CheckpointIO`` plugin when one was given (``Trainer(plugins=[...])``, e.g. ``AsyncCheckpointIO``
        or a cloud IO), else through this library's atomic commit. A sharded directory cannot be written
        by a plugin: a non-default one raises a ``TypeError`` that says what to use instead. With
        ``async_save=True``, a SLURM requeue save (``hpc_ckpt_*``) is written synchronously: the job
        is requeued right after it.
        """
        plugin = self._save_plugin(storage_options)
        start = time.perf_counter()
        local = location(filepath)
        self._failed_saves = {k: v for k, v in self._failed_saves.items() if k != _key(local)}
        hpc = basename(local).startswith("hpc_ckpt_")  # Lightning's `_SignalConnector` names it so
        if self.async_save and self._saves_sharded and not hpc and plugin is None:
            self._save_in_background(checkpoint, local)
            rank_zero_info(
                f"Staged a sharded checkpoint for {str(local)!r} in {time.perf_counter() - start:.2f} s;"
                " writing it in the background"
            )
            return
        path = location(self.broadcast(filepath))
        with self._bounded():
            rank_files = self._add_rank_state(checkpoint)
        frozen = self._frozen_part() if names.STATE_DICT in checkpoint else None
        self.wait_for_checkpoint()  # saves publish in order
        if plugin is not None:
            if frozen is not None:
                checkpoint[names.FROZEN_KEY] = frozen.to_dict()
            if self.is_global_zero:
                plugin.save_checkpoint(checkpoint, path, storage_options=storage_options)
            self.barrier("ShardedCheckpointing.save_checkpoint")
            return
        with self._bounded():
            save.save_checkpoint(
                path,
                checkpoint,
                sharded=self._saves_sharded,
                model_key=self._model_key,
                rank=self.global_rank,
                extra_files=rank_files,
                check_space=self.check_space,
                frozen=frozen,
            )
        rank_zero_info(
            f"Saved a {self._sharded_state_dict_type} checkpoint to {str(path)!r} in"
            f" {time.perf_counter() - start:.2f} s"
        )

    def _save_plugin(self, storage_options: Any | None) -> CheckpointIO | None:
        """The ``CheckpointIO`` plugin a save goes through (``None``: this library's commit), after
        refusing what neither can do."""
        plugin = self._custom_checkpoint_io()
        if plugin is not None and self._saves_sharded:
            raise TypeError(
                f"`{type(self).__name__}` writes sharded checkpoints itself; the `{type(plugin).__name__}`"
                " plugin cannot write a sharded directory. For background saves pass `async_save=True` to"
                " the strategy instead of `AsyncCheckpointIO`; to save through the plugin, use"
                " `state_dict_type='full'`; else remove the plugin."
            )
        if storage_options is not None and plugin is None:
            mro = type(self).__mro__
            stock = next((c.__name__ for c in mro if c.__module__.startswith(_STOCK)), mro[0].__name__)
            raise TypeError(  # stock's words first, then what this strategy does with them
                f"`{stock}.save_checkpoint(..., storage_options=...)` is not supported because `{stock}` does"
                f" not use the `CheckpointIO`: `{type(self).__name__}` takes `storage_options` only with a"
                " `CheckpointIO` plugin and `state_dict_type='full'`; the default commit takes no options."
            )
        return plugin

    def _save_in_background(self, checkpoint: dict[str, Any], path: Location) -> None:
        """Stage a sharded save on the async saver and return. It takes no collective in the training
        thread: rank 0's path and whether every rank collected its own state are agreed by the
        background write, before anything is written."""
        save.save_in_background(
            self._saver(),
            path,
            checkpoint,
            model_key=self._model_key,
            rank=self.global_rank,
            optimizers=self.optimizers,
            rank_files=lambda: self._add_rank_state(checkpoint, agree=False),
            frozen=self._frozen_part() if names.STATE_DICT in checkpoint else None,
            check_space=self.check_space,
        )
        self._defer_logger_notifications()

    @override
    def barrier(self, name: str | None = None) -> None:
        """The parent's barrier, except the one ``Trainer.save_checkpoint`` passes after every save: a
        save here ends with every rank leaving the same collective (the commit's outcome, or for a full
        file rank 0's decision), and an async save has nothing to wait for; that barrier only made the
        training thread wait for the slowest rank (3-5 ms of a 50 MB async save's 8-27 ms here). A pending
        warm start runs at the one Lightning's checkpoint connector passes once the restore step is over."""
        if name == "Trainer.save_checkpoint":
            return
        super().barrier(name)  # type: ignore[safe-super]  # the parent strategy's
        if name == "_CheckpointConnector.resume_end" and self._warm_start_pending:
            self._run_warm_start()

    def _add_rank_state(self, checkpoint: dict[str, Any], *, agree: bool = True) -> dict[str, bytes] | None:
        """Add this rank's RNG and train dataloader state to the save (collective; ``save_rank_state``).

        Sharded: returns this rank's file for the directory, and marks ``meta.pt``. Full: every rank's
        state is gathered into ``checkpoint`` (rank 0 writes it). Returns ``None`` when nothing is saved.
        ``agree=False`` (a sharded async save): not collective; an error is this rank's own, and the
        caller has every rank agree on it later.
        """
        if not self.save_rank_state:
            return None
        module = self.lightning_module

        def collect() -> dict[str, Any]:  # registered objects' state_dict() may fail: on every rank alike
            generators, registered = _exact_resume.rank_extras(module)
            return rank_state.collect(
                checkpoint,
                rank=self.global_rank,
                world_size=self.world_size,
                generators=generators,
                registered=registered,
            )

        own = collective.agree(collect) if agree else collect()
        if not self._saves_sharded:
            checkpoint[names.RANK_STATE_KEY] = rank_state.gathered(own)
            return None
        checkpoint[names.RANK_STATE_KEY] = rank_state.marker(self.world_size)
        return {names.rank_state_file(self.global_rank): rank_state.to_bytes(own)}

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded directory or full file into the wrapped model (and optimizers when fitting).

        Returns the rest of the Lightning checkpoint (loops, callbacks...) for the Trainer to restore.
        """
        path = location(self.broadcast(checkpoint_path))
        self.wait_for_checkpoint()  # it may be the very checkpoint being written
        err = self._failed_saves.get(_key(path))
        if err is not None:  # its background save failed (and none was started since): it is not there
            raise CheckpointError(
                f"The checkpoint {str(path)!r} was not saved: its background save (`async_save=True`)"
                f" failed: {err} What is at that path is an older checkpoint, or nothing. Load another"
                " checkpoint (`ckpt_path=`), or save this one again."
            ) from err
        self._cancel_warm_start(path)
        module = self.lightning_module
        assert module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        exclude = self.exclude_from_loading if fitting else ()
        optimizers = list(self.optimizers) if fitting and names.OPTIMIZER_STATES not in exclude else []
        start = time.perf_counter()
        restored = self._restore(path, optimizers, weights_only)
        what = "model and optimizer states" if optimizers else "model state"
        metadata = restored.metadata
        if not fitting or RANK_STATE in exclude:
            metadata.pop(names.RANK_STATE_KEY, None)  # RNG and train dataloader state matter to fit only
        else:
            with self._bounded():
                what += self._restore_rank_state(restored, weights_only, str(path))
        rank_zero_info(f"Loaded the {what} from {str(path)!r} in {time.perf_counter() - start:.2f} s")
        if exclude:
            left_out = drop_parts(metadata, exclude, str(path))
            rank_zero_info(f"Not loaded from {str(path)!r} (`exclude_from_loading`): {'; '.join(left_out)}")
        return metadata

    def _restore_rank_state(self, restored: load.Restored, weights_only: bool | None, path: str) -> str:
        """Take a resume's per-rank state out of ``restored.metadata`` (collective); each part is set
        later, at its moment (:mod:`~lightning_sharded.strategies._exact_resume`), this rank's train
        dataloader state where Lightning loads it. Returns what to add to the load's log line."""
        metadata, rank, world_size = restored.metadata, self.global_rank, self.world_size
        outcome = rank_state.restore(
            metadata, restored.found, rank=rank, world_size=world_size, weights_only=weights_only, path=path
        )
        module = self.lightning_module
        assert module is not None
        self._resume = _exact_resume.plan(outcome, metadata, module.trainer)
        if outcome.warning is not None:
            rank_zero_warn(outcome.warning)
            return ""
        return ", and every rank's own RNG and train dataloader states" if outcome.rng is not None else ""

    @override
    def on_train_start(self) -> None:
        """Set the per-rank state of the checkpoint being resumed that is due now, on every rank.

        Here, at the last hook before the first batch is fetched: after the train dataloader was set up,
        its state loaded and its iterator created (which draws random numbers), and after every
        ``on_train_start`` of callbacks and the LightningModule (see
        :mod:`~lightning_sharded.strategies._exact_resume` for what is set earlier or later).
        """
        if self._warm_start_pending:  # Lightning passed no `resume_end` barrier: the latest moment
            self._run_warm_start()
        super().on_train_start()
        # Before the first step, whether async_save is on yet or not (it may be switched on later):
        # the saver then knows when a save comes from inside a step (which copies everything at once).
        self._saver().follow(self.optimizers)
        resume, self._resume = self._resume, None
        module = self.lightning_module
        if resume is not None and module is not None:
            skipped = resume.on_train_start(module.trainer, module)
            if skipped:
                rank_zero_warn(f"Not restored from the checkpoint's per-rank state: {'; '.join(skipped)}.")
            self._resume = resume if resume.pending_first_batch else None

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        """Remove a checkpoint directory or file (on rank 0), as ``ModelCheckpoint(save_top_k=...)`` asks."""
        path = location(filepath)
        if self._async_saver is not None and str(self._async_saver.in_flight) == str(path):
            self.wait_for_checkpoint()
        if not self.is_global_zero:
            return
        plugin, saver = self._custom_checkpoint_io(), self._async_saver
        if plugin is not None:  # the plugin wrote it, the plugin removes it
            plugin.remove_checkpoint(path)
        elif self.async_save and saver is not None:  # after the save in flight, off the training thread
            saver.later(lambda: _remove(path), f"removing {str(path)!r}")
        else:
            _remove(path)

    @override
    def teardown(self) -> None:
        """Wait for a background save (raising its error: it must not be lost), then tear down as usual."""
        saver = self._async_saver
        self._resume = None
        try:
            if saver is not None:
                self._waited(saver.close)
        finally:
            self._async_saver = None
            super().teardown()
