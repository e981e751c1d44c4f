"""The model's and optimizers' state dicts, sharded or full, through torch's ``get_*_state_dict``.

Everything here works the same for FSDP1 (``FullyShardedDataParallel``; parameters come out as
``ShardedTensor``), FSDP2 (``fully_shard``; ``DTensor``) and plain modules. Sharded attributes
(``DTensor`` or ``ShardedTensor`` held outside parameters) are part of ``model.state_dict()`` through
the hooks of :mod:`lightning_sharded.hooks`, so they travel with the model.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

__all__ = [
    "PARAMS",
    "PARAM_GROUPS",
    "STATE",
    "key_by_index",
    "model_state_dict",
    "optimizer_state_dict",
    "param_names",
]

STATE = "state"
PARAM_GROUPS = "param_groups"
PARAMS = "params"


def model_state_dict(model: nn.Module, *, full: bool) -> dict[str, Any]:
    """The model's state, sharded (each rank its shards, no copy) or full (gathered on rank 0, on CPU).

    Sharded attributes are included under their parameter-like keys. With ``full=True`` only rank 0 gets
    a non-empty dict, except for an FSDP1 model on CPU (see :func:`_options`).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(model, full))


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer, *, full: bool) -> dict[str, Any]:
    """An optimizer's state keyed by parameter name, sharded like the parameters; or full.

    With ``full=True`` the state is gathered (on rank 0 only, as for the model) and keyed by parameter
    index, the form ``torch.optim.Optimizer.state_dict()`` and stock Lightning use, so a plain
    single-device Trainer can resume from it.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_options(model, full))
    if full and state:
        state = key_by_index(state)
    return state


def has_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(module, FullyShardedDataParallel) for module in model.modules())


def _options(model: nn.Module, full: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # `cpu_offload` makes a full state dict rank-0 only (the other ranks get an empty dict), as stock
    # Lightning's full saves do. FSDP1 crashes (SIGSEGV, torch 2.13) offloading CPU parameters: for an
    # FSDP1 model on CPU every rank gets the full dict.
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    return StateDictOptions(full_state_dict=full, cpu_offload=full and not (on_cpu and has_fsdp1(model)))


def key_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """Name-keyed optimizer state to the index-keyed form of ``Optimizer.state_dict()``."""
    order = {name: index for index, name in enumerate(param_names(state))}
    groups = [{**group, PARAMS: [order[name] for name in group[PARAMS]]} for group in state[PARAM_GROUPS]]
    return {STATE: {order[name]: value for name, value in state[STATE].items()}, PARAM_GROUPS: groups}


def param_names(state: dict[str, Any]) -> list[str]:
    """The parameter names of a name-keyed optimizer state, in the order of its groups."""
    return [name for group in state[PARAM_GROUPS] for name in group[PARAMS]]
