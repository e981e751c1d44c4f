"""``ShardedStateMixin``: sharded attributes of a LightningModule survive checkpoints."""

from __future__ import annotations

import os
from typing import IO, Any

import torch

from lightning_sharded._compat import load_module_from
from lightning_sharded.foreign import ddp_ignored_names, foreign_modules, skipped_log
from lightning_sharded.hooks import receiving_full_values, register_sharded_state_hooks
from lightning_sharded.tensors import gather_full_values
from lightning_sharded.user_state import register_rank_state

_DDP_IGNORE = "_lightning_sharded_ddp_ignore"
_DDP_SAID = "_lightning_sharded_ddp_said"


class ShardedStateMixin:
    """Registers the sharded-state hooks on every instance; put it first in the bases.

    Every ``DTensor`` or ``ShardedTensor`` held as a plain attribute anywhere in the module tree (set in
    ``__init__`` or later, in ``configure_model``) is saved by ``state_dict()`` under the key a
    parameter at that place would have, and restored by ``load_state_dict()``, strict loading
    included, resharded into the attribute's layout.

    When the checkpoint is one file (single device, DDP, FSDP with ``state_dict_type="full"``),
    :meth:`on_save_checkpoint` gathers each sharded attribute into a full CPU tensor first: a pickled
    ``DTensor`` would hold only one rank's shard and cannot be read back by ``torch.load`` with
    Lightning's ``map_location``. If you override ``on_save_checkpoint``, call ``super()``.

    Example::

        import lightning as L
        from lightning_sharded import ShardedStateMixin

        class MyModel(ShardedStateMixin, L.LightningModule):
            def __init__(self, vocab: int = 1000) -> None:
                super().__init__()
                self.save_hyperparameters()
                self.table = None  # becomes a DTensor in configure_model
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        register_sharded_state_hooks(self)  # type: ignore[arg-type]

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """What ``DistributedDataParallel`` must leave alone: what the user set, plus the parameters and
        buffers of modules TorchRec sharded (their values differ per rank by design; TorchRec moves them).

        DDP reads this attribute when it wraps the model; the TorchRec part is said once in the log.
        """
        user = list(self.__dict__.get(_DDP_IGNORE, ()))
        names = ddp_ignored_names(self)  # type: ignore[arg-type]
        if names and not self.__dict__.get(_DDP_SAID):
            from lightning.pytorch.utilities import rank_zero_info

            object.__setattr__(self, _DDP_SAID, True)
            rank_zero_info(skipped_log("DDP", foreign_modules(self)))  # type: ignore[arg-type]
        return sorted(set(user) | set(names))

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, names: Any) -> None:
        # DistributedDataParallel._set_params_and_buffers_to_ignore_for_model sets it: kept beside ours.
        object.__setattr__(self, _DDP_IGNORE, list(names))

    def register_rank_state(self, name: str, obj: Any, *, replace: bool = False) -> None:
        """Keep ``obj``'s state per rank in every checkpoint: :func:`lightning_sharded.register_rank_state`.

        Example::

            def setup(self, stage: str) -> None:
                self.rng = np.random.default_rng(1234 + self.global_rank)
                self.register_rank_state("augment_rng", self.rng)
        """
        register_rank_state(self, name, obj, replace=replace)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Gather sharded attributes into full tensors when the checkpoint is written as one file."""
        parent = getattr(super(), "on_save_checkpoint", None)
        if parent is not None:
            parent(checkpoint)
        strategy = getattr(getattr(self, "_trainer", None), "strategy", None)
        # A sharded directory: Lightning's FSDPStrategy says so with `state_dict_type="sharded"`,
        # ModelParallelStrategy with `save_distributed_checkpoint=True` (ours inherit both attributes).
        sharded = getattr(strategy, "_state_dict_type", None) == "sharded"
        sharded = sharded or bool(getattr(strategy, "_save_distributed_checkpoint", False))
        if "state_dict" in checkpoint and not sharded:
            gather_full_values(checkpoint["state_dict"])

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | os.PathLike[str] | IO[bytes],
        map_location: Any = None,
        hparams_file: str | os.PathLike[str] | None = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning's ``load_from_checkpoint``, which also accepts a sharded checkpoint directory.

        A directory (written by this library, or by stock ``FSDPStrategy`` or ``ModelParallelStrategy``)
        is read in this process without any process group (:func:`lightning_sharded.load_checkpoint`:
        the whole model in memory, for inference on one machine), its optimizer states left unread; then
        Lightning's own path (migration, ``hparams_file`` and ``kwargs``, ``configure_model``,
        ``load_state_dict`` with ``strict``). A sharded attribute still ``None`` (or not set) after
        ``configure_model``, as one made only under a process group is, receives the full tensor; strict
        loading still refuses keys no module has. A file is loaded as Lightning does, except that with a
        device (or device string) as ``map_location`` only the model state goes to that device: the
        rest, optimizer states included, stays memory-mapped on CPU and is read only if used. A
        trainable-only checkpoint (a directory or a file) gets its frozen parameters from the source it
        names.

        ``weights_only`` is passed on as stock Lightning passes it: ``None`` (the default) and ``True``
        read the pickles safely (what Lightning writes is allowed, see
        :mod:`lightning_sharded.checkpoint.unpickling`), ``False`` unpickles anything, running code from
        the checkpoint: only for a checkpoint you trust.

        Raises:
            FileNotFoundError: nothing at ``checkpoint_path``.
            CheckpointError: the directory is not a checkpoint or is damaged, or its keys or shapes do
                not fit the model (the message lists them), or it holds a type a safe load refuses.
        """
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        read = _read(checkpoint_path, device, weights_only)
        if read is None:
            parent: Any = super()
            return parent.load_from_checkpoint(
                checkpoint_path, map_location, hparams_file, strict, weights_only, **kwargs
            )
        checkpoint, sharded = read
        if not sharded:
            return load_module_from(cls, checkpoint, checkpoint_path, hparams_file, strict, **kwargs)
        from lightning_sharded.checkpoint.errors import CheckpointError

        try:
            with receiving_full_values():
                return load_module_from(cls, checkpoint, checkpoint_path, hparams_file, strict, **kwargs)
        except RuntimeError as err:
            if "state_dict" not in str(err):
                raise
            raise CheckpointError(
                f"The checkpoint {str(checkpoint_path)!r} does not fit {cls.__name__}: {err}\nBuild the model"
                " with the hyperparameters it was trained with (they set the shapes); for missing or"
                " unexpected keys only, strict=False loads the keys that match."
            ) from err


def _read(
    path: str | os.PathLike[str] | IO[bytes], device: str | torch.device | None, weights_only: bool | None
) -> tuple[dict[str, Any], bool] | None:
    """The checkpoint at ``path`` as this library reads it, and whether it is a sharded directory;
    ``None`` for Lightning's own load (a file object, a file elsewhere than on this machine). A full
    file is this library's when it is trainable-only (its frozen parameters read from the source it
    names: the model gets every key) or its model state goes to a device (the rest memory-mapped)."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    from lightning_sharded.checkpoint.backends import local_path
    from lightning_sharded.checkpoint.detect import CheckpointKind, detect

    # What is at the path, by the detector (its errors name one file of a checkpoint directory,
    # Hugging Face weights, nothing there).
    found = detect(path)
    sharded = found.kind is CheckpointKind.SHARDED
    file = None if sharded else local_path(found.data)
    if sharded or (file is not None and _is_trainable_only(file, weights_only)):
        from lightning_sharded.checkpoint.tools import load_checkpoint

        where = device or "cpu"
        return load_checkpoint(path, where, weights_only=weights_only, optimizer_states=not sharded), sharded
    if file is not None and device is not None and torch.device(device).type != "cpu":
        return _model_state_to(path, device, weights_only), False
    return None


def _is_trainable_only(path: str | os.PathLike[str], weights_only: bool | None) -> bool:
    """Whether the full file at ``path`` is a trainable-only checkpoint (memory-mapped: no tensor is
    read). A file that cannot be read this way is left to Lightning's own load and its errors."""
    from lightning_sharded.checkpoint.names import FROZEN_KEY

    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except Exception:
        return False
    return isinstance(checkpoint, dict) and checkpoint.get(FROZEN_KEY) is not None


def _model_state_to(
    path: str | os.PathLike[str], map_location: str | torch.device, weights_only: bool | None
) -> dict[str, Any]:
    """The full checkpoint file at ``path`` as ``torch.load`` reads it, with ``state_dict`` on
    ``map_location`` and everything else memory-mapped on CPU (an optimizer state the model does not
    need is neither read nor copied to the device)."""
    from lightning_sharded.checkpoint.tools.reader import map_tensors

    device = torch.device(map_location)
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), dict):
        checkpoint["state_dict"] = map_tensors(checkpoint["state_dict"], lambda t: t.to(device))
    return checkpoint  # type: ignore[no-any-return]
