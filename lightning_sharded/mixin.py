"""``ShardedStateMixin``: sharded attributes of a LightningModule survive checkpoints."""

from __future__ import annotations

from typing import Any

from lightning_sharded.hooks import register_sharded_state_hooks
from lightning_sharded.tensors import gather_full_values


def writes_sharded_checkpoints(strategy: Any) -> bool:
    """Whether ``strategy`` saves a sharded (distributed) checkpoint directory rather than one file.

    Lightning's ``FSDPStrategy`` says so with ``state_dict_type="sharded"``, ``ModelParallelStrategy``
    with ``save_distributed_checkpoint=True``; this library's strategies inherit both attributes.
    """
    return getattr(strategy, "_state_dict_type", None) == "sharded" or bool(
        getattr(strategy, "_save_distributed_checkpoint", False)
    )


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

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Gather sharded attributes into full tensors when the checkpoint is written as one file."""
        parent = getattr(super(), "on_save_checkpoint", None)
        if parent is not None:
            parent(checkpoint)
        trainer = getattr(self, "_trainer", None)
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        if "state_dict" in checkpoint and not writes_sharded_checkpoints(strategy):
            gather_full_values(checkpoint["state_dict"])
