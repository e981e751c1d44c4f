"""Optimizer state to load into, made from the checkpoint's index instead of a fake optimizer step.

torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` need the optimizer's state to
exist; for an optimizer that has not stepped yet (every resume) they create it by running
``optimizer.step()`` with zero gradients: for Adam, zero-filled moments plus a full step over every
parameter, all overwritten by the load right after (stock Lightning spends 2.0 s of a 3.5 s resume
there). :func:`preallocate_optimizer_state` instead creates each state entry the checkpoint holds as
an *uninitialized* tensor laid out like its parameter (``torch.empty_like``, so a ``DTensor``
parameter gets a ``DTensor`` entry with the same placements), and scalars such as Adam's ``step`` as
0-dim tensors; DCP then reads the checkpoint straight into them.

It only handles what it can do exactly: parameters whose names match the checkpoint's, entries shaped
like their parameter or scalar. Anything else (FSDP1's flat parameters, an entry of another shape)
makes it change nothing and return ``False``, and the caller falls back to torch's way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = ["preallocate_from_full_state", "preallocate_optimizer_state"]


def _global_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param.shape)  # a DTensor's shape is its global shape


@torch.no_grad()
def preallocate_optimizer_state(
    model: nn.Module,
    optimizer: Optimizer,
    entries: Mapping[str, tuple[int, ...] | None],
    prefix: str,
) -> bool:
    """Create ``optimizer``'s state, uninitialized, from the entries a checkpoint holds for it.

    Args:
        model: the model whose parameters the optimizer holds (named as in the checkpoint).
        optimizer: an optimizer without state yet.
        entries: flattened checkpoint keys to global shapes (``None`` for non-tensor entries), e.g.
            ``"optimizer_0.state.layer.weight.exp_avg" -> (64, 32)``.
        prefix: the optimizer's state prefix in ``entries``, e.g. ``"optimizer_0.state."``.

    Returns:
        ``True`` if the state was created, ``False`` if nothing was changed (the caller must then let
        torch initialize it).
    """
    if optimizer.state:
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        return False  # FSDP1: the optimizer holds flat parameters, named differently
    names = {id(param): name for name, param in model.named_parameters()}
    by_param: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in entries.items():
        if key.startswith(prefix) and shape is not None:
            rest = key[len(prefix) :]
            name, _, entry = rest.rpartition(".")
            by_param.setdefault(name, {})[entry] = shape
    planned: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            param_name = names.get(id(param))
            if param_name is None:
                return False
            state: dict[str, torch.Tensor] = {}
            for entry, shape in sorted(by_param.get(param_name, {}).items()):
                if shape == _global_shape(param):
                    state[entry] = torch.empty_like(param, memory_format=torch.preserve_format)
                elif shape == ():
                    state[entry] = torch.zeros((), dtype=torch.float32)
                else:
                    return False
            if state:
                planned.append((param, state))
    if not planned:
        return False
    for param, state in planned:
        optimizer.state[param] = state
    return True


def preallocate_from_full_state(model: nn.Module, optimizer: Optimizer, source: Mapping[str, Any]) -> bool:
    """:func:`preallocate_optimizer_state` for the optimizer state of a full checkpoint file.

    ``source`` is one entry of Lightning's ``optimizer_states``: ``{"state": ..., "param_groups": ...}``
    keyed by parameter index (``Optimizer.state_dict()``) or by parameter name.
    """
    names = {id(param): name for name, param in model.named_parameters()}
    ordered = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    if any(name is None for name in ordered):
        return False
    state: Mapping[Any, Any] = source.get("state", {})
    if any(isinstance(key, int) for key in state):
        positions = [p for group in source.get("param_groups", []) for p in group.get("params", [])]
        if len(positions) != len(ordered):
            return False
        by_position = dict(zip(positions, ordered, strict=True))
        state = {by_position.get(key, key): value for key, value in state.items()}
    entries = {
        f"{name}.{entry}": tuple(value.shape) if isinstance(value, torch.Tensor) else None
        for name, values in state.items()
        if isinstance(values, Mapping)
        for entry, value in values.items()
    }
    return preallocate_optimizer_state(model, optimizer, entries, prefix="")
