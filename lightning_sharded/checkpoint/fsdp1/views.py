"""FSDP1's ``SHARDED_STATE_DICT`` hooks without gathers, for the duration of a block (see
:mod:`lightning_sharded.checkpoint.fsdp1`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from lightning_sharded.checkpoint.fsdp1.layout import copy_into_shard, param_tensor

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
    from lightning_sharded._compat import fsdp1_names, fsdp1_state_dict_utils

    sdu = fsdp1_state_dict_utils()
    FSDP_PREFIX, FLAT_PARAM = fsdp1_names()

    # The roots whose ``_is_root`` reads False from their post hook until their next pre hook or the
    # block's end: torch's post hook, at the root, logs every entry's shape and dtype whatever the log
    # level, two ShardedTensor dispatches per parameter (1.2 ms of a 50 MB model's 9 ms async save).
    quiet: list[Any] = []

    def speak(fsdp_state: Any) -> None:
        if any(state is fsdp_state for state in quiet):
            fsdp_state._is_root = True
            quiet[:] = [state for state in quiet if state is not fsdp_state]

    def pre_save(fsdp_state: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        speak(fsdp_state)
        sdu._common_pre_state_dict_hook(module, fsdp_state)
        if sdu._should_unshard_params(fsdp_state):
            # torch's post hook leaves this context; nothing was gathered, so there is nothing to undo.
            fsdp_state._unshard_params_ctx[module] = contextlib.nullcontext()

    def post_save(
        module: nn.Module, fsdp_state: Any, state_dict: dict[str, Any], prefix: str
    ) -> dict[str, Any]:
        param_hook = None
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
            state_dict.pop(prefix + FLAT_PARAM, None)
        if fsdp_state._is_root is True:  # read next by torch's logging only (see `quiet`); after torch's
            fsdp_state._is_root = False  # hook, as before: a torch that reads it there sees the truth
            quiet.append(fsdp_state)
        return state_dict

    def pre_load(module: nn.Module, fsdp_state: Any, state_dict: dict[str, Any], prefix: str) -> None:
        sdu._lazy_init(fsdp_state, module)
        sdu._replace_by_prefix(state_dict, prefix, prefix + FSDP_PREFIX)
        if not sdu._has_fsdp_params(fsdp_state, module):
            return
        handle = sdu._module_handle(fsdp_state, module)
        for index, (fqn, _, _) in enumerate(sdu._param_name_infos(module, fsdp_state)):
            value = state_dict.pop(f"{prefix}{FSDP_PREFIX}{fqn}", None)
            if value is not None:
                copy_into_shard(param_tensor(handle, index), value)

    def post_load(module: nn.Module, fsdp_state: Any, *args: Any, **kwargs: Any) -> None:
        return None

    names = (
        "_sharded_pre_state_dict_hook",
        "_sharded_post_state_dict_hook",
        "_sharded_pre_load_state_dict_hook",
        "_sharded_post_load_state_dict_hook",
    )
    originals = {name: getattr(sdu, name) for name in names}
    for name, hook in zip(names, (pre_save, post_save, pre_load, post_load), strict=True):
        setattr(sdu, name, hook)
    try:
        yield
    finally:
        for name, hook in originals.items():
            setattr(sdu, name, hook)
        for state in quiet:
            state._is_root = True
