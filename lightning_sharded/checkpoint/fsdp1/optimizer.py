"""FSDP1 optimizer state as views of each parameter's local piece, to save and to load into (see
:mod:`lightning_sharded.checkpoint.fsdp1`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_sharded._fqn import parameter_names
from lightning_sharded.checkpoint import collective
from lightning_sharded.checkpoint.fsdp1.layout import (
    ParamLayout,
    layouts,
    param_index,
    sharded_tensor,
    state_tensor,
    supported,
)
from lightning_sharded.checkpoint.shard_pieces import PARAM_GROUPS, PARAMS, STATE

__all__ = ["optimizer_state_views", "optimizer_template"]


#: An original parameter, its ``FlatParamHandle``, its layout and the numel of its local piece.
_Piece = tuple[torch.Tensor, Any, ParamLayout, int]


def _pieces(model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, _Piece], list[dict[str, Any]]] | None:
    """The optimizer's parameters by clean name (group order) with their pieces of the flat shards, and its
    parameter groups keyed by name; ``None`` unless the model is :func:`supported` and every parameter is
    FSDP1's."""
    if not supported(model):
        return None
    names = parameter_names(model)
    where = param_index(model)
    pieces: dict[str, _Piece] = {}
    for group in optimizer.param_groups:
        for param in group[PARAMS]:
            if id(param) not in where or id(param) not in names:
                return None
            handle, index = where[id(param)]
            layout = layouts(handle)[index]
            numel = layout.local[1] if layout.local is not None else 0
            pieces[names[id(param)]] = (param, handle, layout, numel)
    groups = [
        {**{k: v for k, v in group.items() if k != PARAMS}, PARAMS: [names[id(p)] for p in group[PARAMS]]}
        for group in optimizer.param_groups
    ]
    return pieces, groups


def _state_views(optimizer: Optimizer, pieces: dict[str, _Piece]) -> dict[str, dict[str, Any]] | None:
    """Each parameter's optimizer state, its flat tensors as ``ShardedTensor`` views (no communication);
    ``None`` if a state tensor is not the parameter's local piece."""
    state: dict[str, dict[str, Any]] = {}
    for name, (param, handle, layout, numel) in pieces.items():
        entries = optimizer.state.get(param)
        if not entries:
            continue
        out: dict[str, Any] = {}
        for entry, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.dim() != 1 or value.numel() != numel or not value.is_contiguous():
                    return None
                out[entry] = state_tensor(value, layout, handle.process_group, handle.rank)
            else:
                out[entry] = value
        state[name] = out
    return state


def optimizer_state_views(model: nn.Module, optimizer: Optimizer) -> dict[str, Any] | None:
    """The optimizer's sharded state keyed by clean parameter name, as ``FSDP.optim_state_dict`` gives it,
    without communication; ``None`` where the fast form does not apply (on every rank alike).

    Collective (one all-reduce of a flag, on the :func:`~lightning_sharded.checkpoint.collective.scope`'s
    group: every rank must be able to take this path, or none takes it). Each state
    tensor of a parameter's local piece becomes a ``ShardedTensor`` of views of it; zero-dimensional
    states (Adam's ``step``) and non-tensors are kept as they are.
    """
    found = _pieces(model, optimizer)
    state = _state_views(optimizer, found[0]) if found is not None else None
    agreed = collective.all_true(state is not None, collective.ranks(), "agreeing on the optimizer's views")
    if not agreed or state is None or found is None:
        return None
    return {STATE: state, PARAM_GROUPS: found[1]}


def optimizer_template(
    model: nn.Module,
    optimizer: Optimizer,
    stored: dict[str, dict[str, tuple[tuple[int, ...] | None, torch.dtype | None]]],
    backing: dict[int, torch.Tensor],
) -> dict[str, Any] | None:
    """The name-keyed template to load an FSDP1 optimizer's state into, from the checkpoint's index
    (``stored``, as for :func:`~.load.checks.template_like`); or ``None``. A state of the parameter's
    global shape is a ``ShardedTensor`` over a new local flat tensor (``backing``: ``id(sharded) ->
    tensor``, what the optimizer then holds), other tensors plain, non-tensors ``None``. Depends on the
    model and the checkpoint only: every rank takes the same branch.
    """
    found = _pieces(model, optimizer)
    if found is None:
        return None
    pieces, groups = found
    template: dict[str, dict[str, Any]] = {}
    for name in sorted(stored.keys() & pieces.keys()):
        param, handle, layout, numel = pieces[name]
        for entry, (shape, dtype) in sorted(stored[name].items()):
            value: Any = None
            if shape is not None and dtype is not None:
                if len(shape) > 0 and tuple(shape) == layout.shape:
                    local = torch.empty(numel, dtype=dtype, device=param.device)
                    value = sharded_tensor(local, layout, handle.process_group, handle.rank)
                    backing[id(value)] = local
                else:
                    value = torch.empty(shape, dtype=dtype)
            template.setdefault(name, {})[entry] = value
    return {STATE: template, PARAM_GROUPS: groups}
