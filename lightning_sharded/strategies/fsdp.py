"""``ShardedFSDPStrategy``: Lightning's FSDP1 strategy that runs on CPU, keeps sharded attributes and
restores any checkpoint into the wrapped model, at any world size."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch.nn import Module
from typing_extensions import Unpack, overload, override

from lightning_sharded.checkpoint.names import MODEL
from lightning_sharded.foreign import foreign_modules, skipped_log
from lightning_sharded.strategies._checkpointing import ShardedCheckpointing
from lightning_sharded.strategies._options import CheckpointOptions, CheckpointOptionsKwargs, show_options
from lightning_sharded.strategies._reentry import fsdp1_root, refuse_fsdp2_for_fsdp1, remember_fsdp1_root

_UNSET = object()


class ShardedFSDPStrategy(ShardedCheckpointing, FSDPStrategy):
    """FSDP1 (``FullyShardedDataParallel``) for sharded models, on CPU (gloo) and CUDA (nccl).

    Differences from Lightning's ``FSDPStrategy``:

    - runs with ``accelerator="cpu"`` (it passes ``device_id=torch.device("cpu")`` to FSDP);
    - registers the sharded-state hooks on the LightningModule at setup, so ``DTensor`` and
      ``ShardedTensor`` attributes are saved and restored with the model;
    - saves sharded by default; restores sharded directories written by this library, by stock
      ``FSDPStrategy`` and by stock ``ModelParallelStrategy``, and full checkpoint files (read
      memory-mapped, one tensor at a time), at any world size, model and optimizer state;
    - honours ``strict_loading`` both ways, and raises
      :class:`~lightning_sharded.CheckpointError` naming the key, file or rank when a checkpoint
      does not fit.

    Args:
        *args: positional arguments of ``FSDPStrategy``.
        **kwargs: keyword arguments of ``FSDPStrategy`` and of ``FullyShardedDataParallel``, and the
            checkpoint options (:class:`~lightning_sharded.strategies._options.CheckpointOptions`, each
            shown in this class's signature), ``state_dict_type`` defaulting to ``"sharded"``.

    Example::

        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ShardedFSDPStrategy(
            auto_wrap_policy={torch.nn.Linear}))
        trainer.fit(model, ckpt_path="checkpoints/last.ckpt")
    """

    strategy_name = "sharded_fsdp"
    _model_key = MODEL
    _registry_names = ("sharded_fsdp", "sharded_fsdp_cpu_offload")

    # For static tools: the options by name and type (PEP 692), and anything else `FSDPStrategy` takes
    # (mypy knows no TypedDict with extra items).
    @overload
    def __init__(self, *args: Any, **kwargs: Unpack[CheckpointOptionsKwargs]) -> None: ...
    @overload
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = CheckpointOptions.take(kwargs)
        kwargs["state_dict_type"] = options.state_dict_type
        super().__init__(*args, **kwargs)
        options.apply(self)

    def _fsdp_device_id(self) -> int | torch.device | None:
        # FSDP1 refuses `device_id=None` on CPU ("FSDP needs a non-CPU accelerator device"); it accepts the
        # CPU device itself.
        device = self.root_device
        return device if device.type == "cpu" else device.index

    @override
    def setup_environment(self) -> None:
        if (
            self.cpu_offload is not None
            and self.cpu_offload.offload_params
            and self.root_device.type == "cpu"
        ):
            raise ValueError(
                "CPU offloading (`cpu_offload=True`, the `sharded_fsdp_cpu_offload` strategy) moves FSDP's"
                " parameters between the GPU and the CPU: with `accelerator='cpu'` they are on the CPU"
                " already (torch's FSDP1 fails to pin their memory). Use `strategy='sharded_fsdp'` on CPU."
            )
        mesh = self.kwargs.get("device_mesh")
        if isinstance(mesh, tuple):
            # The parent builds a tuple mesh on "cuda" unconditionally; build it on our device instead.
            del self.kwargs["device_mesh"]
        super().setup_environment()
        if isinstance(mesh, tuple):
            from torch.distributed.device_mesh import init_device_mesh

            self.kwargs["device_mesh"] = init_device_mesh(self.root_device.type, mesh)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._register_sharded_state_hooks()
        super().setup(trainer)

    @override
    def _setup_model(self, model: Module) -> Module:
        """Stock's, with two changes. A model this strategy wrapped in an earlier Trainer (``fit`` then
        ``validate``, or a second ``fit``) gets the same wrapper again: wrapping its flat shards anew would
        lose every shape; one sharded with FSDP2 (``fully_shard``) is refused. On CPU the model is wrapped
        here first, with ``device_id`` the CPU device (stock passes ``root_device.index``, ``None`` on CPU,
        which FSDP1 refuses), and so is a model holding TorchRec's sharded modules (passed as
        ``ignored_modules``); stock's method then finds it wrapped and does the rest (torchmetrics,
        activation checkpointing, its warnings). On CUDA, stock's method alone."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        refuse_fsdp2_for_fsdp1(model, type(self).__name__)
        options = self._wrap_options()
        wrapped = fsdp1_root(model, options, type(self).__name__)
        if wrapped is not None:
            return wrapped
        original = model
        if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return FSDPStrategy._setup_model(self, model)  # by name: a test borrows this method
        foreign = foreign_modules(model)
        if self.root_device.type != "cpu" and not foreign:
            result = FSDPStrategy._setup_model(self, model)
        else:
            kwargs = dict(self.kwargs)
            if foreign:
                # TorchRec's sharded modules move their tables between ranks themselves: FSDP neither
                # wraps anything inside them nor flattens their parameters.
                ignored = [m for _, m in foreign]
                ignored += [m for m in kwargs.pop("ignored_modules", None) or () if m not in ignored]
                kwargs["ignored_modules"] = ignored
                rank_zero_info(skipped_log("FSDP (`auto_wrap_policy` and the root wrapper)", foreign))
            model = FullyShardedDataParallel(module=model, **_wrapping(self), **kwargs)
            # Applied just now: stock would warn that it is ignored on a wrapped model (and delete it).
            policy = self.kwargs.pop("auto_wrap_policy", _UNSET)
            try:
                result = FSDPStrategy._setup_model(self, model)
            finally:
                if policy is not _UNSET:
                    self.kwargs["auto_wrap_policy"] = policy
        remember_fsdp1_root(original, result, options)
        return result

    def _wrap_options(self) -> tuple[str, ...]:
        """What a module wrapped by FSDP1 keeps for good: a later setup of it must match."""
        return (
            f"sharding_strategy={self.sharding_strategy.name}",
            f"mixed_precision={self.mixed_precision_config}",
            f"cpu_offload={self.cpu_offload}",
            f"use_orig_params={bool(self.kwargs.get('use_orig_params', False))}",
            f"device={self.root_device}",
            f"world_size={self.world_size}",
        )

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stock's on CUDA; on CPU the same ``enable_wrap`` with ``device_id`` the CPU device (stock's
        ``None`` there is refused by FSDP1, and nested ``enable_wrap`` contexts are refused by torch)."""
        if self.root_device.type != "cpu":
            with super().model_sharded_context():
                yield
            return
        from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **_wrapping(self), **self.kwargs):
            yield


def _wrapping(strategy: Any) -> dict[str, Any]:
    """The arguments of the FSDP1 wrappers ``strategy`` makes itself: stock's, ``device_id`` its own."""
    return {
        "cpu_offload": strategy.cpu_offload,
        "mixed_precision": strategy.mixed_precision_config,
        "sharding_strategy": strategy.sharding_strategy,
        "device_id": strategy._fsdp_device_id(),
    }


# `inspect.signature` (IDEs, Lightning's CLI, `save_hyperparameters`) shows the parent's parameters and ours.
show_options(ShardedFSDPStrategy.__init__, FSDPStrategy.__init__, state_dict_type="sharded")
