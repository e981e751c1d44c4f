"""Optimizer state of parameters that are this rank's piece of a sharded value of the model's state.

Some modules keep a sharded tensor as plain per-rank parameters: TorchRec's sharded embedding tables
are ``ShardedTensor`` values in ``state_dict()`` (its own hooks), while each rank's parameter is a view
of its local shard(s) (a table of another rank is an empty ``(0,)`` parameter here; column-wise shards of
one table on one rank are one parameter over both). Their local shapes differ from rank to rank, and
so do the optimizer states torch creates for them (Adam's ``exp_avg``, Adagrad's ``sum``), which torch's
``get_optimizer_state_dict`` returns as plain tensors: DCP would keep one rank's copy.

A parameter is such a *piece* when the model's state value under its name is sharded (``ShardedTensor``
or ``DTensor``) while the parameter is not, and every local tensor of that value lies in the
parameter's memory (an empty parameter holds none). Its optimizer state tensors of the parameter's
shape (and strides) are then saved as sharded values laid out like the model's value, each local piece
a view of the state at the place the value's local tensor has in the parameter: DCP writes every
rank's piece, and a load reads them back at any plan and world size (DCP reshards). Zero-dimensional
states (``step``) stay as they are. Saving is collective where pieces exist (:func:`agreed_entries`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_sharded.checkpoint import collective
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.tensors import ShardedAdapter, adapter_for

__all__ = [
    "PARAMS",
    "PARAM_GROUPS",
    "STATE",
    "Piece",
    "agreed_entries",
    "candidates",
    "find_pieces",
    "set_agreed_values",
    "unwrap_state",
    "wrap_state",
]

#: The keys of a torch optimizer state dict.
STATE = "state"
PARAM_GROUPS = "param_groups"
PARAMS = "params"


@dataclass(frozen=True)
class Piece:
    """A parameter that is this rank's piece of the sharded model value ``layout``.

    Attributes:
        param: The parameter (a plain tensor, contiguous).
        layout: The model's sharded state value the parameter holds a piece of.
        offsets: For each local tensor of ``layout`` (in the adapter's order), its storage offset
            relative to the parameter's first element.
        adapter: The adapter of ``layout``'s kind.
    """

    param: torch.Tensor
    layout: Any
    offsets: tuple[int, ...]
    adapter: ShardedAdapter

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(self.adapter.global_shape(self.layout))

    def fits(self, value: Any) -> bool:
        """Whether ``value`` is a plain state tensor laid out like the parameter (its views are valid)."""
        return (
            isinstance(value, torch.Tensor)
            and adapter_for(value) is None
            and value.shape == self.param.shape
            and (value.numel() == 0 or value.stride() == self.param.stride())
        )

    def views(self, value: torch.Tensor) -> Any:
        """The sharded value laid out like :attr:`layout` whose local tensors are views of ``value``."""
        locals_ = self.adapter.local_tensors(self.layout)
        base = value.detach()
        pieces = [
            base.as_strided(local.shape, local.stride(), base.storage_offset() + offset)
            for local, offset in zip(locals_, self.offsets, strict=True)
        ]
        return self.adapter.views_like(self.layout, pieces, value.dtype)


def _offsets(param: torch.Tensor, locals_: list[torch.Tensor]) -> tuple[int, ...] | None:
    """Each local tensor's storage offset relative to ``param``, or ``None`` if one is not inside it."""
    if not locals_:
        return () if param.numel() == 0 else None
    if not param.is_contiguous() or param.numel() == 0:
        return None
    storage = param.untyped_storage().data_ptr()
    start, end = param.storage_offset(), param.storage_offset() + param.numel()
    offsets = []
    for local in locals_:
        if type(local) is not torch.Tensor and not isinstance(local, torch.nn.Parameter):
            return None  # a tensor subclass (TorchRec's LocalShardsWrapper): not a view to follow
        if local.numel() == 0:
            offsets.append(0)
            continue
        if local.untyped_storage().data_ptr() != storage:
            return None
        last = local.storage_offset() + sum(
            (n - 1) * s for n, s in zip(local.shape, local.stride(), strict=True)
        )
        if local.storage_offset() < start or last >= end:
            return None
        offsets.append(int(local.storage_offset()) - int(start))
    return tuple(offsets)


def find_pieces(
    params: Mapping[str, torch.Tensor], model_state: Mapping[str, Any], exclude: frozenset[int] = frozenset()
) -> tuple[dict[str, Piece], list[str]]:
    """The parameters of ``params`` (clean name -> parameter) that are pieces of a sharded value of
    ``model_state`` (the model's sharded state dict, clean keys); ``exclude``: ids of parameters another
    path handles (FSDP1's original parameters).

    Returns the pieces, and the names of plain parameters whose state value is sharded (by type alone,
    so the same names on every rank of a model built alike): a save agrees on them with the others.
    """
    pieces: dict[str, Piece] = {}
    over_plain: list[str] = []
    for name in sorted(params):
        param = params[name]
        if id(param) in exclude or adapter_for(param) is not None:
            continue
        value = model_state.get(name)
        adapter = adapter_for(value)
        if adapter is None:
            continue
        over_plain.append(name)
        offsets = _offsets(param, adapter.local_tensors(value))
        if offsets is not None:
            pieces[name] = Piece(param, value, offsets, adapter)
    return pieces, over_plain


def candidates(params: Mapping[str, torch.Tensor], exclude: frozenset[int] = frozenset()) -> bool:
    """Whether any parameter could be a piece (a plain tensor no other path handles): if none, the model's
    state need not be computed to look for pieces."""
    return any(id(p) not in exclude and adapter_for(p) is None for p in params.values())


def wrap_state(state: dict[str, Any], pieces: Mapping[str, Piece]) -> dict[int, torch.Tensor]:
    """Each piece's state tensors in the name-keyed optimizer state dict ``state`` made sharded views;
    returns ``id(view) -> the plain tensor it views`` (for :func:`unwrap_state`). ``state`` gets new
    per-parameter dicts: torch's state dicts share them with the optimizer, whose state stays as it is."""
    backing: dict[int, torch.Tensor] = {}
    entries_by_name = state.get(STATE, {})
    for name in sorted(pieces):
        if not entries_by_name.get(name):
            continue
        entries = entries_by_name[name] = dict(entries_by_name[name])
        piece = pieces[name]
        for entry in sorted(entries):
            plain = entries[entry]
            if piece.fits(plain):
                entries[entry] = piece.views(plain)
                backing[id(entries[entry])] = plain
    return backing


def unwrap_state(state: dict[str, Any], backing: Mapping[int, torch.Tensor]) -> None:
    """Replace, in the name-keyed optimizer state dict ``state``, each sharded view of ``backing`` (from
    :func:`wrap_state` or a load's template) by the plain tensor it views."""
    if backing:
        for entries in state.get(STATE, {}).values():
            for entry, value in list(entries.items()):
                entries[entry] = backing.get(id(value), value)


Described = dict[str, dict[str, Any]]


def _describe(state: dict[str, Any], pieces: Mapping[str, Piece]) -> tuple[Described, dict[str, bool]]:
    """Each piece's state entries (a sharded entry: ``("sharded", global shape, dtype)``; any other
    value as it is, it is small: ``step``, a hyperparameter), and whether this rank holds a non-empty
    piece of it."""
    described: Described = {}
    holds: dict[str, bool] = {}
    for name in sorted(pieces):
        piece = pieces[name]
        holds[name] = any(t.numel() > 0 for t in piece.adapter.local_tensors(piece.layout))
        for entry, value in sorted((state.get(STATE, {}).get(name) or {}).items()):
            of = adapter_for(value)
            info = ("sharded", tuple(of.global_shape(value)), of.dtype(value)) if of else ("value", value)
            described.setdefault(name, {})[entry] = info
    return described, holds


def agreed_entries(state: dict[str, Any], pieces: Mapping[str, Piece]) -> Described:
    """Every rank's entries of each piece's state, merged (a non-sharded entry: the lowest rank's value).

    Collective over :func:`~lightning_sharded.checkpoint.collective.ranks` (one all-gather of a few
    bytes per entry): every rank that found a sharded state value over a plain parameter calls it;
    every rank returns the same or raises the same error.

    Raises:
        CheckpointError: ranks disagree on which parameters are pieces or on a state's global shape, or
            a rank holding part of a piece's value has no state for it while another rank has (the
            saved tensor would have a hole there).
    """
    described, holds = _describe(state, pieces)
    gathered = collective.all_gather(
        (described, holds), collective.ranks(), "agreeing on the optimizer state of sharded pieces"
    )
    names = sorted({name for _, held in gathered for name in held})
    merged: Described = {}
    for name in names:
        without = [rank for rank, (_, held) in enumerate(gathered) if name not in held]
        if without:
            raise CheckpointError(
                f"Cannot save the optimizer state of {name!r}: its parameter is a piece of the model's"
                f" sharded value on some ranks but not on rank(s) {without} (the value's local tensors"
                " are not views of the parameter there), so its state cannot be saved as one sharded tensor."
            )
        # Ranks holding part of the value first: a plain entry (``step``) is taken from them, since a
        # rank with an empty piece may hold a state its optimizer never stepped (Adagrad's eager state).
        order = sorted(range(len(gathered)), key=lambda r: (not gathered[r][1][name], r))
        for rank in order:
            entries, held = gathered[rank]
            for entry, info in sorted(entries.get(name, {}).items()):
                known = merged.setdefault(name, {}).get(entry)
                if known is None:
                    merged[name][entry] = (*info, held[name])
                elif known[0] == "value" and held[name] and not _same(known[1], info[1]):
                    raise CheckpointError(
                        f"Cannot save the optimizer state of {name!r}: its {entry!r} is {known[1]!r} on one"
                        f" rank and {info[1]!r} on rank {rank}, both holding part of the parameter; it is"
                        " saved once for the whole sharded value."
                    )
                elif known[0] == "sharded" and known[:2] != info[:2]:
                    raise CheckpointError(
                        f"Cannot save the optimizer state of {name!r}: its {entry!r} has the global shape"
                        f" {list(known[1])} on one rank and {_shape_text(info)} on rank {rank}."
                    )
        for rank, (entries, held) in enumerate(gathered):
            have = entries.get(name, {})
            lacking = sorted(
                e for e, info in merged.get(name, {}).items() if info[0] == "sharded" and e not in have
            )
            if held[name] and lacking:
                raise CheckpointError(
                    f"Cannot save the optimizer state of {name!r}: rank {rank} holds part of the parameter"
                    f" but has no {', '.join(repr(e) for e in lacking)} while other ranks"
                    " have: the checkpoint would hold that part uninitialized. Save after an optimizer step"
                    " that reached every rank's part of the parameter (each needs a gradient)."
                )
    return merged


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b) if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) else False


def set_agreed_values(state: dict[str, Any], merged: Described) -> None:
    """Each piece's plain entries (``step``) in ``state`` set to the agreed value (:func:`agreed_entries`),
    on every rank that has the entry: DCP writes one rank's copy of a plain value, any of them."""
    entries_by_name = state.get(STATE, {})
    for name in sorted(merged):
        entries = entries_by_name.get(name)
        if not entries:
            continue
        entries = entries_by_name[name] = dict(entries)
        for entry, info in merged[name].items():
            if info[0] == "value" and entry in entries:
                entries[entry] = info[1]


def _shape_text(info: Any) -> str:
    return str(list(info[1])) if info[0] == "sharded" else f"a {type(info[1]).__name__}"
