"""The model's and optimizers' state dicts, sharded or full, through torch's ``get_*_state_dict``.

Everything here works the same for FSDP1 (``FullyShardedDataParallel``; parameters come out as
``ShardedTensor``), FSDP2 (``fully_shard``; ``DTensor``) and plain modules. Sharded attributes
(``DTensor`` or ``ShardedTensor`` held outside parameters) are part of ``model.state_dict()`` through
the hooks of :mod:`lightning_sharded.hooks`, so they travel with the model.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_sharded._fqn import clean_keys, parameter_names
from lightning_sharded.checkpoint import fsdp1, shard_pieces
from lightning_sharded.checkpoint.fsdp1.layout import param_index
from lightning_sharded.checkpoint.shard_pieces import PARAM_GROUPS, PARAMS, STATE
from lightning_sharded.foreign import foreign_modules
from lightning_sharded.tensors import gather_full_values, to_full

__all__ = [
    "PARAMS",
    "PARAM_GROUPS",
    "STATE",
    "key_by_index",
    "model_state_dict",
    "optimizer_pieces",
    "optimizer_state_dict",
    "param_names",
    "plain_optimizer",
    "torch_optimizer_template",
]


def model_state_dict(model: nn.Module, *, full: bool) -> dict[str, Any]:
    """The model's state, sharded (each rank its shards, no copy) or full (gathered on rank 0, on CPU).

    Sharded attributes are included under their parameter-like keys. With ``full=True`` only rank 0 gets
    a non-empty dict (stock Lightning's full saves do the same), for FSDP1, FSDP2 and plain modules.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if full and foreign_modules(model):
        # TorchRec's tables are ShardedTensors of uneven shards (a row-wise table's last shard is
        # smaller, a table-wise table lives on one rank): torch's full gathers assume even chunks
        # ("allgather: invalid tensor size"). Gathered by our adapters instead, in sorted key order.
        import torch.distributed as dist

        state = gather_full_values(dict(model_state_dict(model, full=False)))
        if dist.is_initialized() and dist.get_rank() != 0:
            return {}
        return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    if full and _fsdp1_on_cpu(model):
        with _fsdp1_type(model, full=True):
            from lightning_sharded._compat import gather_state_dict

            # FSDP1 gathers its parameters on rank 0 only; the sharded attributes (DTensor or
            # ShardedTensor values the hooks add) are gathered onto rank 0 here, as torch's helper does.
            # FSDP's own keys keep the parts of other wrappers (`_orig_mod.` of a compiled submodule):
            # the clean names are the ones every other save and every load use.
            state = gather_state_dict(model.state_dict(), ranks_only=(0,))
            return clean_keys(model, state)
    if not full and fsdp1.supported(model):
        # What get_model_state_dict does for a sharded FSDP1 state dict (the sharded state-dict type,
        # `state_dict()`, clean keys), without its checks of every parameter's names, 0.8 ms of a 50 MB
        # model's save: no gather, nothing offloaded, no submodule or frozen-parameter options here.
        with torch.no_grad(), _fsdp1_type(model, full=False), fsdp1.views():
            return clean_keys(model, model.state_dict())
    return get_model_state_dict(model, options=_options(full))


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer, *, full: bool) -> dict[str, Any]:
    """An optimizer's state keyed by parameter name, sharded like the parameters; or full: gathered (on
    rank 0 only, as for the model) and keyed by parameter index, the form of ``Optimizer.state_dict()``
    and stock Lightning, so a plain single-device Trainer can resume from it. The state of a piece of a
    sharded model value (TorchRec's tables, :mod:`~.shard_pieces`) is laid out like that value: every
    rank's piece is saved, or gathered for a full state (collective).
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = plain_optimizer(optimizer)
    pieces, over_plain = optimizer_pieces(model, optimizer)
    if not full and fsdp1.supported(model):
        fast = fsdp1.optimizer_state_views(model, optimizer)
        if fast is not None:
            return _sharded_pieces(fast, pieces, over_plain)
    if full and _fsdp1_on_cpu(model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with _fsdp1_type(model, full=True):
            state = FullyShardedDataParallel.optim_state_dict(model, optimizer)
    else:
        state = get_optimizer_state_dict(model, optimizer, options=_options(full))
        if not full:
            return _sharded_pieces(state, pieces, over_plain)
    state = _full_pieces(optimizer, state, pieces, over_plain)
    return key_by_index(state) if state else {}


def plain_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer a wrapper steps, whose ``state_dict()`` has torch's form: TorchRec's
    ``KeyedOptimizerWrapper`` keeps its state and parameter groups in the optimizer it wraps
    (``_optimizer``), and its own ``state_dict()`` keys them differently; else ``optimizer`` itself.

    TorchRec's ``CombinedOptimizer`` (one keyed optimizer per part of the model) gives a
    :class:`CombinedView` of the torch optimizers inside it.
    """
    inner = getattr(optimizer, "_optimizer", None)
    if isinstance(inner, Optimizer) and inner.param_groups is optimizer.param_groups:
        return inner
    inners = getattr(optimizer, "optimizers", None)
    if type(optimizer).__name__ == "CombinedOptimizer" and isinstance(inners, list):
        return CombinedView([inner for _, inner in inners])
    return optimizer


class CombinedView(Optimizer):
    """TorchRec's ``CombinedOptimizer`` as one torch optimizer: its optimizers' parameter groups in order
    and their state, the same objects (its own ``state_dict()`` keys every entry by its optimizer's name
    too, which no state-dict API of torch maps back to the model's parameters). Never stepped; after a
    load into it, :meth:`give_back` hands each optimizer its part of the loaded groups and state."""

    def __init__(self, optimizers: list[Optimizer]) -> None:
        self.inners = [plain_optimizer(inner) for inner in optimizers]
        self.outers = optimizers
        groups = [group for inner in self.inners for group in inner.param_groups]
        super().__init__([{**group} for group in groups], {})
        self.param_groups = groups
        for inner in self.inners:
            self.state.update(inner.state)

    def give_back(self) -> None:
        """Each optimizer's groups and state made the loaded ones (``load_state_dict`` replaced both)."""
        position = 0
        for outer, inner in zip(self.outers, self.inners, strict=True):
            count = len(inner.param_groups)
            inner.param_groups = self.param_groups[position : position + count]
            position += count
            mine = {id(p) for group in inner.param_groups for p in group[PARAMS]}
            state: defaultdict[Any, Any] = defaultdict(dict)
            state.update({p: v for p, v in self.state.items() if id(p) in mine})
            inner.state = state
            if outer is not inner:
                outer.state = inner.state
                outer.param_groups = inner.param_groups


def optimizer_pieces(
    model: nn.Module, optimizer: Optimizer, model_state: dict[str, Any] | None = None
) -> tuple[dict[str, shard_pieces.Piece], list[str]]:
    """The optimizer's parameters that are pieces of a sharded model value, by clean name, and the names
    of its plain parameters whose model value is sharded (see :func:`~.shard_pieces.find_pieces`).

    The model's state dict is made only when the optimizer has a plain parameter that no other path
    handles (none under FSDP2 alone: every parameter is a ``DTensor``); ``model_state``: the model's
    sharded state dict where the caller has it."""
    names = parameter_names(model)
    params = {names[id(p)]: p for group in optimizer.param_groups for p in group[PARAMS] if id(p) in names}
    exclude = frozenset(param_index(model))  # FSDP1's original parameters
    if not shard_pieces.candidates(params, exclude):
        return {}, []
    if model_state is None:
        model_state = model_state_dict(model, full=False)
    return shard_pieces.find_pieces(params, model_state, exclude)


def _sharded_pieces(
    state: dict[str, Any], pieces: dict[str, shard_pieces.Piece], over_plain: list[str]
) -> dict[str, Any]:
    """``state`` with the pieces' state tensors as sharded views, once every rank agreed (collective)."""
    if not over_plain:
        return state
    shard_pieces.wrap_state(state, pieces)
    shard_pieces.set_agreed_values(state, shard_pieces.agreed_entries(state, pieces))
    return state


def _full_pieces(
    optimizer: Optimizer, full: dict[str, Any], pieces: dict[str, shard_pieces.Piece], over_plain: list[str]
) -> dict[str, Any]:
    """The full (rank 0) name-keyed state ``full`` with every piece's state gathered whole (collective:
    torch's full state holds rank 0's piece, or nothing where rank 0 has no state for it)."""
    if not over_plain:
        return full
    local: dict[str, Any] = {
        STATE: {name: dict(optimizer.state.get(piece.param) or {}) for name, piece in pieces.items()}
    }
    shard_pieces.wrap_state(local, pieces)
    merged = shard_pieces.agreed_entries(local, pieces)
    for name in sorted(merged):
        entries = local[STATE].get(name) or {}
        for entry, info in sorted(merged[name].items()):
            if info[0] == "sharded":
                value = entries.get(entry)
                if value is None:  # this rank holds an empty piece (checked): it takes part with nothing
                    empty = torch.empty_like(pieces[name].param, dtype=info[2], requires_grad=False)
                    value = pieces[name].views(empty)
                whole = to_full(value).cpu()
            else:
                whole = info[1]
            if full:
                full[STATE].setdefault(name, {})[entry] = whole
    return full


def torch_optimizer_template(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """torch's sharded optimizer state dict to load into, its state created first (one zero-lr step): for
    FSDP1 outside :func:`~.fsdp1.supported`, whose state is empty before the first step."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(False))


def has_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(module, FullyShardedDataParallel) for module in model.modules())


def _fsdp1_on_cpu(model: nn.Module) -> bool:
    return has_fsdp1(model) and all(p.device.type == "cpu" for p in model.parameters())


@contextlib.contextmanager
def _fsdp1_type(model: nn.Module, *, full: bool) -> Iterator[None]:
    """FSDP1's state dicts never offloaded: full on rank 0 only (an FSDP1 model on CPU), or sharded
    (what get_model_state_dict sets for the views)."""
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        FullyShardedDataParallel,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )

    configs: tuple[Any, Any, Any] = (
        (
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        )
        if full
        else (
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload_to_cpu=False),
            ShardedOptimStateDictConfig(offload_to_cpu=False),
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "FSDP.state_dict_type() ... deprecated"
        with FullyShardedDataParallel.state_dict_type(model, *configs):
            yield


def _options(full: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # `cpu_offload` makes a full state dict rank-0 only (the other ranks get an empty dict), as stock
    # Lightning's full saves do. (FSDP1 crashes offloading CPU parameters, SIGSEGV in torch 2.13: an
    # FSDP1 model on CPU goes through `_fsdp1_type` instead.)
    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def key_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """Name-keyed optimizer state to the index-keyed form of ``Optimizer.state_dict()``."""
    order = {name: index for index, name in enumerate(param_names(state))}
    groups = [{**group, PARAMS: [order[name] for name in group[PARAMS]]} for group in state[PARAM_GROUPS]]
    return {STATE: {order[name]: value for name, value in state[STATE].items()}, PARAM_GROUPS: groups}


def param_names(state: dict[str, Any]) -> list[str]:
    """The parameter names of a name-keyed optimizer state, in the order of its groups."""
    return [name for group in state[PARAM_GROUPS] for name in group[PARAMS]]
