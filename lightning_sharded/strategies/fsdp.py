"""``ShardedFSDPStrategy``: Lightning's FSDP1 strategy that runs on CPU, keeps sharded attributes and
restores any checkpoint into the wrapped model, at any world size."""

from __future__ import annotations

import inspect
import os
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch.nn import Module
from typing_extensions import override

from lightning_sharded.checkpoint.integrity import VerifyMode
from lightning_sharded.checkpoint.names import MODEL
from lightning_sharded.foreign import foreign_modules, skipped_log
from lightning_sharded.strategies._checkpointing import (
    DEFAULT_CHECKPOINT_TIMEOUT,
    ShardedCheckpointing,
    StateDictType,
    check_state_dict_type,
)
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
        state_dict_type: ``"sharded"`` (default) writes a directory of shards per checkpoint, readable by
            stock ``FSDPStrategy`` too; ``"full"`` writes one ``torch.save`` file that plain
            ``torch.load`` and a single-device Trainer read.
        async_save: write and publish sharded checkpoints in the background (see ``docs/async-save.md``).
        verify: on a load, compare every file's CRC-32 with the checkpoint's manifest; presence and sizes
            are always checked. ``True`` or ``"before"``: nothing of a damaged checkpoint is loaded
            (local files: the model's values are read beside it, checked from the reads, then copied
            in; object storage: every file checksummed before the first read). ``"during"``: from the
            load's own reads, straight into the model; a damaged file then fails the resume after its
            tensors were read (see ``docs/checkpoint-format.md``).
        save_rank_state: save each rank's RNG states, train dataloader state and generators, and the
            objects registered with ``register_rank_state``, with every checkpoint, so a resume at the
            same world size continues exactly from any point (see ``docs/checkpoint-format.md``).
        warm_start: a checkpoint (sharded directory or full file) whose model state (weights and sharded
            attributes) a ``fit`` without ``ckpt_path`` starts from; the optimizers, LR schedulers,
            loops and step count start fresh, and only the model's bytes are read. A ``fit`` that resumes
            (``ckpt_path``) ignores it, so a run configured with both resumes itself after a crash.
        exclude_from_loading: parts of a checkpoint a resume leaves out, by their Lightning checkpoint
            key: ``"optimizer_states"``, ``"lr_schedulers"``, ``"loops"``, ``"callbacks"``,
            ``"callbacks.<Name>"`` (one callback), ``"rank_state"``; one line says what was left out.
        save_trainable_only: save only the parameters with ``requires_grad`` (and buffers, sharded
            attributes and everything else); the checkpoint names ``frozen_source`` as where a load reads
            the frozen parameters from.
        frozen_source: the weights the frozen parameters were loaded from (a Hugging Face directory, a
            full or a sharded checkpoint); required with ``save_trainable_only``. On a load it overrides
            the source a trainable-only checkpoint names.
        frozen_prefix: the part of the frozen parameters' keys the source's keys lack (``"model."``).
        checkpoint_timeout: seconds a rank waits for the others at a step of a save or a load (its
            collectives run on a gloo group of their own with this timeout) before it fails with a
            ``CheckpointError`` naming the ranks that did not come (dead or hung); ``None``: the process
            group's own timeout (30 minutes). Raise it when one rank writes much more than the others.
        check_space: refuse a local save before writing anything when its estimated size (plus a
            margin) does not fit in the free space of its filesystem (see ``docs/troubleshooting.md``).
        **kwargs: keyword arguments of ``FSDPStrategy`` and of ``FullyShardedDataParallel``.

    Example::

        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ShardedFSDPStrategy(
            auto_wrap_policy={torch.nn.Linear}))
        trainer.fit(model, ckpt_path="checkpoints/last.ckpt")
    """

    strategy_name = "sharded_fsdp"
    _model_key = MODEL
    _registry_names = ("sharded_fsdp", "sharded_fsdp_cpu_offload")

    def __init__(
        self,
        *args: Any,
        state_dict_type: StateDictType = "sharded",
        async_save: bool = False,
        verify: bool | VerifyMode = False,
        save_rank_state: bool = True,
        warm_start: str | os.PathLike[str] | None = None,
        exclude_from_loading: Sequence[str] = (),
        save_trainable_only: bool = False,
        frozen_source: str | os.PathLike[str] | None = None,
        frozen_prefix: str = "",
        checkpoint_timeout: float | None = DEFAULT_CHECKPOINT_TIMEOUT,
        check_space: bool = True,
        **kwargs: Any,
    ) -> None:
        kwargs["state_dict_type"] = check_state_dict_type(state_dict_type)
        super().__init__(*args, **kwargs)
        self._sharded_state_dict_type = state_dict_type
        self._init_async_save(async_save)
        self._init_verify(verify)
        self.save_rank_state = save_rank_state
        self._init_partial(
            warm_start, exclude_from_loading, save_trainable_only, frozen_source, frozen_prefix
        )
        self._init_faults(checkpoint_timeout, check_space)

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
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self._fsdp_device_id(),
                **kwargs,
            )
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

        with enable_wrap(
            wrapper_cls=FullyShardedDataParallel,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self._fsdp_device_id(),
            **self.kwargs,
        ):
            yield


def _signature() -> inspect.Signature:
    """``FSDPStrategy``'s parameters (``state_dict_type`` defaulting to ``"sharded"``), then ours."""
    parent = inspect.signature(FSDPStrategy.__init__).parameters.values()
    params = [
        p.replace(default="sharded") if p.name == "state_dict_type" else p
        for p in parent
        if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    keyword = inspect.Parameter.KEYWORD_ONLY
    params += [
        inspect.Parameter("async_save", keyword, default=False, annotation="bool"),
        inspect.Parameter("verify", keyword, default=False, annotation='bool | Literal["before", "during"]'),
        inspect.Parameter("save_rank_state", keyword, default=True, annotation="bool"),
        inspect.Parameter("warm_start", keyword, default=None, annotation="str | os.PathLike[str] | None"),
        inspect.Parameter("exclude_from_loading", keyword, default=(), annotation="Sequence[str]"),
        inspect.Parameter("save_trainable_only", keyword, default=False, annotation="bool"),
        inspect.Parameter("frozen_source", keyword, default=None, annotation="str | os.PathLike[str] | None"),
        inspect.Parameter("frozen_prefix", keyword, default="", annotation="str"),
        inspect.Parameter(
            "checkpoint_timeout", keyword, default=DEFAULT_CHECKPOINT_TIMEOUT, annotation="float | None"
        ),
        inspect.Parameter("check_space", keyword, default=True, annotation="bool"),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation="Any"),
    ]
    return inspect.Signature(params, return_annotation=None)


# `inspect.signature` (IDEs, Lightning's CLI, `save_hyperparameters`) shows the parent's parameters.
ShardedFSDPStrategy.__signature__ = _signature()  # type: ignore[attr-defined]
