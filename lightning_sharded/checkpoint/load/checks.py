"""Checks and helpers every load uses: keys, shapes, optimizer counts, copying into shards."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_sharded._fqn import parameter_names
from lightning_sharded.checkpoint import collective, shard_pieces
from lightning_sharded.checkpoint.backends import Location
from lightning_sharded.checkpoint.errors import CheckpointError, OptimizerCountError
from lightning_sharded.checkpoint.manifest import FrozenPart
from lightning_sharded.checkpoint.names import FROZEN_KEY
from lightning_sharded.checkpoint.state_dicts import PARAM_GROUPS, PARAMS, STATE, has_fsdp1
from lightning_sharded.tensors import adapter_for

__all__ = [
    "KeyReport",
    "Stored",
    "check_optimizer_count",
    "check_shapes",
    "copy_full_into",
    "fit_model",
    "frozen_of",
    "global_shape",
    "named_optimizer_params",
    "set_model_state",
    "set_optimizer_state",
    "summarize_keys",
    "template_like",
]


#: An optimizer's stored state: parameter name -> entry -> (global shape, dtype); ``(None, None)`` for a
#: non-tensor entry.
Stored = dict[str, dict[str, tuple[tuple[int, ...] | None, torch.dtype | None]]]


def summarize_keys(keys: list[str], limit: int = 10) -> str:
    """``keys`` sorted and quoted, cut after ``limit`` with a count of the rest."""
    keys = sorted(keys)
    shown = ", ".join(f'"{k}"' for k in keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


class KeyReport:
    """Keys of the model (or an optimizer) compared with those of a checkpoint."""

    def __init__(self, expected: Sequence[str], found: Sequence[str]) -> None:
        expected_set, found_set = set(expected), set(found)
        self.missing = sorted(expected_set - found_set)
        self.unexpected = sorted(found_set - expected_set)
        self.common = sorted(expected_set & found_set)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected)

    def describe(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"Missing key(s) in the checkpoint: {summarize_keys(self.missing)}.")
        if self.unexpected:
            parts.append(f"Unexpected key(s) in the checkpoint: {summarize_keys(self.unexpected)}.")
        return " ".join(parts)


def frozen_of(checkpoint: Any, path: Location) -> FrozenPart | None:
    """The frozen part a trainable-only checkpoint dict names (:data:`~.names.FROZEN_KEY`), or ``None``.

    Raises:
        CheckpointError: the entry is there but is not a frozen part.
    """
    value = checkpoint.get(FROZEN_KEY) if isinstance(checkpoint, dict) else None
    if value is None:
        return None
    try:
        return FrozenPart.from_dict(value)
    except (TypeError, KeyError) as err:
        raise CheckpointError(
            f"The checkpoint {str(path)!r} has a damaged {FROZEN_KEY!r} entry ({err}): it cannot tell which"
            " frozen weights it left out. Use another checkpoint."
        ) from None


def check_optimizer_count(path: Location, configured: int, saved: int) -> None:
    if configured == saved:
        return
    if saved == 0:
        raise CheckpointError(
            f"The checkpoint {str(path)!r} has no optimizer state but {configured} optimizer(s) are"
            " configured: it was probably saved with `ModelCheckpoint(save_weights_only=True)`. Resume"
            " from a full training checkpoint, or leave the optimizer states out of the load"
            " (`exclude_from_loading=['optimizer_states', 'lr_schedulers']` on the strategy), or start a new"
            " run from its weights (`warm_start=PATH`)."
        )
    raise OptimizerCountError(  # stock FSDPStrategy's type and words first
        f"You have configured {configured} optimizers but the checkpoint contains {saved} optimizers to load."
        " Please resume training with the same number of optimizers or edit the checkpoint manually to"
        f" remove states. (The checkpoint: {str(path)!r}; to resume its model alone, leave its optimizer"
        " states out: `exclude_from_loading=['optimizer_states', 'lr_schedulers']` on the strategy.)"
    )


def fit_model(
    path: Location,
    stored: dict[str, tuple[int, ...] | None],
    target: dict[str, Any],
    frozen: FrozenPart | None,
    *,
    strict: bool,
) -> tuple[KeyReport, dict[str, Any], FrozenPart | None]:
    """The model's state ``target`` checked against the checkpoint's entries ``stored`` (key -> global
    shape, ``None`` for a non-tensor) and the keys a trainable-only checkpoint left out (``frozen``);
    collective. Returns the comparison, the values to load and ``frozen`` limited to the model's keys."""
    elsewhere = sorted(set(frozen.keys if frozen else ()) - set(stored))
    report = KeyReport(list(target), [*stored, *elsewhere])
    if report and strict:
        raise CheckpointError(
            f"Error(s) in loading the checkpoint {str(path)!r} into the model (strict loading). "
            f"{report.describe()} Make the model match the checkpoint, or set `self.strict_loading = False`"
            " in the LightningModule to load only the keys both have."
        )
    if report.missing and not report.common:
        raise CheckpointError(
            f"The checkpoint {str(path)!r} holds none of the model's {len(report.missing)} key(s): it is not"
            f" a checkpoint of this model, or holds no model state. {report.describe()} Load a checkpoint"
            " saved from this model."
        )
    to_load = {key: target[key] for key in report.common if key in stored}
    # Agreed: a plain tensor's shape may differ per rank (a per-rank parameter), and one rank alone must
    # not raise while the others go on to read.
    collective.agree(lambda: check_shapes(path, to_load, stored), step="checking the shapes")
    if frozen is not None:
        frozen = FrozenPart(frozen.source, tuple(k for k in report.common if k not in stored), frozen.prefix)
    return report, to_load, frozen


def global_shape(value: Any) -> tuple[int, ...] | None:
    adapter = adapter_for(value)
    if adapter is not None:
        return tuple(adapter.global_shape(value))
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return None


def check_shapes(path: Location, targets: dict[str, Any], shapes: dict[str, tuple[int, ...] | None]) -> None:
    bad = []
    for key in sorted(targets):
        expected = global_shape(targets[key])
        stored = shapes.get(key)
        if expected is not None and stored is not None and tuple(stored) != expected:
            bad.append(_mismatch(key, stored, expected, None))
    if bad:
        raise CheckpointError(
            f"The checkpoint {str(path)!r} does not fit the model: {'; '.join(bad)}. Resume with the model"
            " configuration that saved it."
        )


def copy_full_into(target: Any, full: Any) -> Any:
    """Put the global value ``full`` into ``target`` (a sharded or plain tensor); returns what to load."""
    adapter = adapter_for(target)
    if adapter is not None:
        adapter.copy_into(target, full)
        return target
    if isinstance(target, torch.Tensor) and isinstance(full, torch.Tensor):
        with torch.no_grad():
            target.copy_(full)
        return target
    return full


def set_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from lightning_sharded.checkpoint import fsdp1

    # Keys were checked against the checkpoint already; `state` holds exactly the keys to load.
    with fsdp1.views() if fsdp1.supported(model) else contextlib.nullcontext():
        set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def set_optimizer_state(model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state)


def named_optimizer_params(model: nn.Module, optimizer: Optimizer) -> list[tuple[str, torch.Tensor]]:
    """``(clean FQN, parameter)`` in the optimizer's order; a ``KeyError`` for a parameter not in ``model``.

    Names are those of ``get_optimizer_state_dict`` (no ``_orig_mod.``, ``_checkpoint_wrapped_module.``...),
    so a checkpoint saved through one wrapping loads into another.
    """
    names = parameter_names(model)
    return [(names[id(param)], param) for group in optimizer.param_groups for param in group[PARAMS]]


def template_like(
    model: nn.Module,
    optimizer: Optimizer,
    stored: Stored,
    pieces: Mapping[str, shard_pieces.Piece],
    backing: dict[int, torch.Tensor],
    where: str,
    source: str,
) -> dict[str, Any] | None:
    """An empty, name-keyed optimizer state with the entries ``stored`` describes, to load into; ``None``
    for FSDP1 (flat parameters) or a parameter the model does not name. Runs no optimizer step (unlike
    ``get_optimizer_state_dict``).

    A state tensor of its parameter's global shape is made like the parameter (a ``DTensor`` stays
    sharded alike: each rank holds its piece). For a parameter in ``pieces`` (:mod:`~.shard_pieces`), a
    state of the value's global shape is a sharded value of its layout over a new tensor of the
    parameter's shape (``backing``: ``id(sharded) -> tensor``, what the optimizer then holds). A
    zero-dimensional state (``step``) is a plain tensor; so is any other state of a plain parameter (the
    model's own shape check vouches for the parameter).

    Raises:
        CheckpointError: a state tensor that fits neither its parameter nor the sharded value it is a
            piece of, naming each key (``where`` + name + entry), both shapes and ``source``.
    """
    if has_fsdp1(model):
        return None
    try:
        named = named_optimizer_params(model, optimizer)
    except KeyError:
        return None
    params = dict(named)
    state: dict[str, dict[str, Any]] = {}
    bad: list[str] = []
    for name in sorted(stored.keys() & params.keys()):  # the state of other parameters is not loaded
        param, piece = params[name], pieces.get(name)
        for entry, (shape, dtype) in sorted(stored[name].items()):
            key = f"{where}{name}.{entry}"
            value: Any = None  # a non-tensor entry: the loader puts the stored object here
            if shape is not None and dtype is not None:
                if piece is not None and len(shape) > 0:
                    if tuple(shape) != piece.global_shape:
                        bad.append(_mismatch(key, shape, piece.global_shape, piece.param))
                        continue
                    local = torch.empty_like(piece.param, dtype=dtype, requires_grad=False)
                    value = piece.views(local)
                    backing[id(value)] = local
                elif len(shape) > 0 and tuple(shape) == tuple(param.shape):
                    value = torch.empty_like(param, dtype=dtype, requires_grad=False)
                elif len(shape) > 0 and adapter_for(param) is not None:
                    # A sharded parameter's state of another shape would be one rank's copy, read by all.
                    bad.append(_mismatch(key, shape, tuple(param.shape), None))
                    continue
                else:
                    value = torch.empty(shape, dtype=dtype)
            state.setdefault(name, {})[entry] = value
    if bad:
        raise CheckpointError(
            f"The optimizer state in {source} does not fit the optimizer: {'; '.join(bad)}. Resume with the"
            " model and optimizer configuration that saved the checkpoint."
        )
    names = {id(param): name for name, param in named}
    groups = [{**group, PARAMS: [names[id(p)] for p in group[PARAMS]]} for group in optimizer.param_groups]
    return {STATE: state, PARAM_GROUPS: groups}


def _mismatch(key: str, stored: Sequence[int], expected: Sequence[int], piece: torch.Tensor | None) -> str:
    local = f" (this rank holds a piece of shape {list(piece.shape)})" if piece is not None else ""
    return (
        f"size mismatch for {key}: the checkpoint has shape {list(stored)}, the model {list(expected)}{local}"
    )
