"""``ShardedModelParallelStrategy``: Lightning's FSDP2/DTensor strategy with the checkpoint core of
``ShardedFSDPStrategy`` and an optional ``fully_shard`` policy for plain models."""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_deprecation, rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.constants import default_pg_timeout
from typing_extensions import Unpack, override

from lightning_sharded._compat import materialize_distributed_module, optimizers_to_device
from lightning_sharded.checkpoint.names import STATE_DICT
from lightning_sharded.foreign import foreign_modules, foreign_parameters, is_inside_foreign, skipped_log
from lightning_sharded.strategies._checkpointing import ShardedCheckpointing
from lightning_sharded.strategies._options import (
    CheckpointOptions,
    CheckpointOptionsKwargs,
    StateDictType,
    show_options,
)
from lightning_sharded.strategies._reentry import refuse_fsdp1_for_fsdp2

#: Which submodules get their own ``fully_shard``: a collection of module classes, or a predicate.
FullyShardPolicy = Collection[type[nn.Module]] | Callable[[nn.Module], bool]


class ShardedModelParallelStrategy(ShardedCheckpointing, ModelParallelStrategy):
    """FSDP2 (``fully_shard``) and tensor parallelism for sharded models, on CPU (gloo) and CUDA (nccl).

    It restores checkpoints exactly as :class:`~lightning_sharded.ShardedFSDPStrategy` does, through the
    same code: sharded directories from this library or stock Lightning (``FSDPStrategy`` or
    ``ModelParallelStrategy``) and full files, at any world size, model, sharded attributes and optimizer
    state, ``strict_loading`` honoured both ways. So a run can move between FSDP1 and FSDP2.

    Args:
        data_parallel_size: as in ``ModelParallelStrategy``. With a ``fully_shard_policy`` and both sizes
            left at ``"auto"``, every process is data parallel (``data_parallel_size=world size``,
            ``tensor_parallel_size=1``), which is what a policy-sharded model needs.
        tensor_parallel_size: as in ``ModelParallelStrategy``.
        save_distributed_checkpoint: deprecated: use ``state_dict_type`` (``False`` means ``"full"``).
        process_group_backend: as in ``ModelParallelStrategy``.
        timeout: as in ``ModelParallelStrategy``.
        fully_shard_policy: module classes (or a predicate on modules) that get their own ``fully_shard``
            after ``configure_model``, followed by the root module, when ``configure_model`` did not
            apply ``fully_shard`` itself. With a policy, ``configure_model`` need not be overridden.
            Modules TorchRec sharded (its ``ShardedModule`` s) and everything in them are left alone:
            no ``fully_shard`` inside them, and the root's ignores their parameters (said once in the log).
        **options: the checkpoint options (:class:`~lightning_sharded.strategies._options.CheckpointOptions`,
            each shown in this class's signature), as for :class:`~lightning_sharded.ShardedFSDPStrategy`.

    Example::

        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ShardedModelParallelStrategy(
            fully_shard_policy={torch.nn.Linear}))
        trainer.fit(model, ckpt_path="checkpoints/last.ckpt")
    """

    strategy_name = "sharded_model_parallel"
    _model_key = STATE_DICT
    _registry_names = ("sharded_model_parallel",)

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        fully_shard_policy: FullyShardPolicy | None = None,
        **options: Unpack[CheckpointOptionsKwargs],
    ) -> None:
        if save_distributed_checkpoint is not None:
            implied: StateDictType = "sharded" if save_distributed_checkpoint else "full"
            rank_zero_deprecation(
                f"`save_distributed_checkpoint={save_distributed_checkpoint}` is deprecated, to be removed"
                f" in the next release: pass `state_dict_type={implied!r}` instead."
            )
            if options.setdefault("state_dict_type", implied) != implied:
                raise ValueError(
                    f"`save_distributed_checkpoint={save_distributed_checkpoint}` and"
                    f" `state_dict_type={options['state_dict_type']!r}` contradict each other; pass only"
                    " `state_dict_type`."
                )
        rest: dict[str, Any] = dict(options)
        checked = CheckpointOptions.take(rest)
        if rest:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments {sorted(rest)}")
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=checked.state_dict_type == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._fully_shard_policy = fully_shard_policy
        checked.apply(self)

    @override
    def setup_environment(self) -> None:
        if (
            self._fully_shard_policy is not None
            and self._data_parallel_size == "auto"
            and self._tensor_parallel_size == "auto"
        ):
            self._data_parallel_size = self.num_nodes * self.num_processes
            self._tensor_parallel_size = 1
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Stock's ``setup`` after registering the sharded-state hooks (its errors keep stock's type and
        words, then say what this strategy offers). With a ``fully_shard_policy`` the policy is the
        parallelization: it is applied before the model is materialized, and stock's requirement of a
        ``configure_model`` does not hold; the rest is stock's sequence (see docs/strategies.md)."""
        self._register_sharded_state_hooks()
        assert self.model is not None
        refuse_fsdp1_for_fsdp2(self.model, type(self).__name__)
        if self._fully_shard_policy is None:
            try:
                super().setup(trainer)
            except TypeError as err:  # stock's words, then what this strategy offers instead
                hint = ""
                if "FSDP2" in str(err):
                    hint = " For FSDP1 (`FullyShardedDataParallel`) use `ShardedFSDPStrategy`."
                elif "configure_model" in str(err):
                    hint = " Or pass `fully_shard_policy=` to `ShardedModelParallelStrategy` to shard a plain"
                    hint += " model."
                raise TypeError(f"{err}{hint}".rstrip()) from err
            return
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._apply_fully_shard_policy(self.model)
        materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _apply_fully_shard_policy(self, model: nn.Module) -> None:
        """``fully_shard`` every submodule the policy picks (innermost first), then the root."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if any(isinstance(module, FSDPModule) for module in model.modules()):
            rank_zero_warn(
                "A `fully_shard_policy` is set, but `configure_model` already applied `fully_shard`."
                " The policy will be ignored."
            )
            return
        policy = self._fully_shard_policy
        assert policy is not None
        if callable(policy) and not isinstance(policy, type):
            picks: Callable[[nn.Module], bool] = policy  # type: ignore[assignment]
        else:
            classes = tuple(policy)  # type: ignore[arg-type]

            def picks(module: nn.Module) -> bool:
                return isinstance(module, classes)

        mesh = self.device_mesh["data_parallel"]
        # TorchRec's sharded modules move their tables between ranks themselves: no `fully_shard` inside
        # them, and the root's leaves their parameters alone (else the tables are flattened into the
        # root's group and never train).
        foreign = foreign_modules(model)
        inside = is_inside_foreign(model)
        for module in reversed(list(model.modules())):
            if module is not model and id(module) not in inside and picks(module):
                fully_shard(module, mesh=mesh)
        if foreign:
            rank_zero_info(skipped_log("`fully_shard_policy` (and the root's `fully_shard`)", foreign))
        fully_shard(model, mesh=mesh, ignored_params=foreign_parameters(model) or None)


# `inspect.signature` (IDEs, Lightning's CLI, `save_hyperparameters`) shows the options too.
show_options(ShardedModelParallelStrategy.__init__)
