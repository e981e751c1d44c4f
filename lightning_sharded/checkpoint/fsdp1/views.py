"""FSDP1's ``SHARDED_STATE_DICT`` hooks without gathers, for the duration of a block (see
:mod:`lightning_sharded.checkpoint.fsdp1`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from lightning_sharded.checkpoint.fsdp1.layout import HOOK_NAMES, copy_into_shard, param_tensor

__all__ = ["views"]


@contextlib.contextmanager
def views() -> Iterator[None]:
    """Inside the block, FSDP1's ``SHARDED_STATE_DICT`` hooks neither gather nor scatter.

    ``model.state_dict()`` gives each parameter as a ``ShardedTensor`` of views of the local flat shard
    (no communication, no copy); ``model.load_state_dict()`` copies each parameter's value (sharded in
    any layout, or full) into those views, skipping a value that is those very views (what the
    sharded load read into), and loads the rest (buffers, sharded attributes, extra state) as usual.
    Only for models :func:`supported` accepts.
    """
    hooks = _Hooks()
    originals = {name: getattr(hooks.sdu, name) for name in HOOK_NAMES}
    mine = (hooks.pre_save, hooks.post_save, hooks.pre_load, hooks.post_load)
    for name, hook in zip(HOOK_NAMES, mine, strict=True):
        setattr(hooks.sdu, name, hook)
    try:
        yield
    finally:
        for name, hook in originals.items():
            setattr(hooks.sdu, name, hook)
        for state in hooks.quiet:
            state._is_root = True


class _Hooks:
    """torch's four ``SHARDED_STATE_DICT`` hooks (:data:`~.layout.HOOK_NAMES`), with views for the
    parameters of the flat shards."""

    def __init__(self) -> None:
        from lightning_sharded._compat import fsdp1_names, fsdp1_state_dict_utils

        self.sdu = fsdp1_state_dict_utils()
        self.fsdp_prefix, self.flat_param = fsdp1_names()
        # The roots whose ``_is_root`` reads False from their post hook until their next pre hook or the
        # block's end: torch's post hook, at the root, logs every entry's shape and dtype whatever the log
        # level, two ShardedTensor dispatches per parameter (1.2 ms of a 50 MB model's 9 ms async save).
        self.quiet: list[Any] = []

    def pre_save(self, fsdp_state: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        if any(state is fsdp_state for state in self.quiet):
            fsdp_state._is_root = True
            self.quiet[:] = [state for state in self.quiet if state is not fsdp_state]
        self.sdu._common_pre_state_dict_hook(module, fsdp_state)
        if self.sdu._should_unshard_params(fsdp_state):
            # torch's post hook leaves this context; nothing was gathered, so there is nothing to undo.
            fsdp_state._unshard_params_ctx[module] = contextlib.nullcontext()

    def post_save(
        self, module: nn.Module, fsdp_state: Any, state_dict: dict[str, Any], prefix: str
    ) -> dict[str, Any]:
        sdu, param_hook = self.sdu, None
        if sdu._has_fsdp_params(fsdp_state, module):
            handle = sdu._module_handle(fsdp_state, module)
            index = {fqn: i for i, (fqn, _, _) in enumerate(sdu._param_name_infos(module, fsdp_state))}

            def param_hook(state_dict: dict[str, Any], prefix: str, fqn: str) -> None:
                state_dict[fqn] = param_tensor(handle, index[fqn[len(prefix) :]])

        # torch's own post hook (prefixes, buffers and their dtypes), with views for the parameters.
        state_dict = sdu._common_unshard_post_state_dict_hook(
            module, fsdp_state, state_dict, prefix, param_hook
        )
        if param_hook is not None:
            state_dict.pop(prefix + self.flat_param, None)
        if fsdp_state._is_root is True:  # read next by torch's logging only (see `quiet`); after torch's
            fsdp_state._is_root = False  # hook, as before: a torch that reads it there sees the truth
            self.quiet.append(fsdp_state)
        return state_dict

    def pre_load(self, module: nn.Module, fsdp_state: Any, state_dict: dict[str, Any], prefix: str) -> None:
        sdu, fsdp_prefix = self.sdu, self.fsdp_prefix
        sdu._lazy_init(fsdp_state, module)
        sdu._replace_by_prefix(state_dict, prefix, prefix + fsdp_prefix)
        if not sdu._has_fsdp_params(fsdp_state, module):
            return
        handle = sdu._module_handle(fsdp_state, module)
        for index, (fqn, _, _) in enumerate(sdu._param_name_infos(module, fsdp_state)):
            value = state_dict.pop(f"{prefix}{fsdp_prefix}{fqn}", None)
            if value is not None:
                copy_into_shard(param_tensor(handle, index), value)

    def post_load(self, module: nn.Module, fsdp_state: Any, *args: Any, **kwargs: Any) -> None:
        return None
