"""``ShardedStateMixin``: sharded attributes of a LightningModule survive checkpoints."""

from __future__ import annotations

from typing import Any

from lightning_sharded.hooks import register_sharded_state_hooks


class ShardedStateMixin:
    """Registers the sharded-state hooks on every instance; put it first in the bases.

    Every ``DTensor`` or ``ShardedTensor`` held as a plain attribute anywhere in the module tree (set in
    ``__init__`` or later, in ``configure_model``) is saved by ``state_dict()`` under the key a
    parameter at that place would have, and restored by ``load_state_dict()``, strict loading
    included, resharded into the attribute's layout.

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
