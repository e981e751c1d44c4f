"""Modules that another library has sharded itself: TorchRec's ``ShardedModule`` s (``docs/torchrec.md``).

They move their values between ranks themselves, so data-parallel wrappers must leave them alone; this
module finds them (by class, from ``torchrec.distributed.types``, looked up only when TorchRec was
imported: nothing is imported here) and exposes the state a TorchRec fused kernel keeps outside the
model, its ``fused_optimizer``, as sharded attributes (``fused_optimizer__<table>__<state>``, views of
the kernel's own state: loading into them writes it) that the state-dict hooks save and restore.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import torch.distributed as dist
from torch import nn

from lightning_sharded._compat import sharded_tensor_api

#: Prefix of the attributes that carry a fused optimizer's state.
FUSED_PREFIX = "fused_optimizer__"
#: Where a module keeps the exchanged layouts of its fused state (not a tensor: never a site).
_LAYOUTS = "_lightning_sharded_fused_layouts"


def foreign_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of each outermost module under ``root`` (itself included) that TorchRec sharded."""
    types = getattr(sys.modules.get("torchrec.distributed.types"), "ShardedModule", None)  # if imported
    if not isinstance(types, type):
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if isinstance(module, types) and not any(name.startswith(p + ".") for p, _ in found):
            found.append((name, cast(nn.Module, module)))
    return found


def foreign_parameters(root: nn.Module) -> set[nn.Parameter]:
    """Every parameter of the modules :func:`foreign_modules` finds."""
    return {p for _, module in foreign_modules(root) for p in module.parameters()}


def is_inside_foreign(root: nn.Module) -> set[int]:
    """``id`` of every module within (or equal to) a foreign-sharded module under ``root``."""
    return {id(m) for _, module in foreign_modules(root) for m in module.modules()}


def ddp_ignored_names(root: nn.Module) -> list[str]:
    """Names (as ``root.named_parameters()`` / ``named_buffers()`` give them) DDP must not touch."""
    modules = foreign_modules(root)
    if not modules:
        return []
    owned = {id(p) for _, module in modules for p in module.parameters()}
    owned |= {id(b) for _, module in modules for b in module.buffers()}
    names = [n for n, p in root.named_parameters() if id(p) in owned]
    names += [n for n, b in root.named_buffers() if id(b) in owned]
    return sorted(set(names))


def attach_fused_state(root: nn.Module) -> None:
    """Set the fused optimizer state of every TorchRec module under ``root`` as sharded attributes.

    Collective the first time a module's state is seen (its layouts are exchanged over the tables'
    process group); afterwards it only re-reads this rank's state. Nothing happens without TorchRec.
    """
    for _, module in foreign_modules(root):
        optimizer = getattr(module, "fused_optimizer", None)
        if optimizer is None or not hasattr(optimizer, "state_dict"):
            continue
        ShardedTensor = sharded_tensor_api()[0]
        state = optimizer.state_dict().get("state", {})
        local = {
            FUSED_PREFIX + state_key.replace(".", "__"): value
            for param_key in sorted(state)
            for state_key, value in sorted(state[param_key].items())
            if isinstance(value, ShardedTensor)
        }
        cached = module.__dict__.get(_LAYOUTS)
        # Exchanged again only for another optimizer object (the module was sharded anew), which every
        # rank sees alike: a decision one rank took alone would leave the others out of the collective.
        if cached is None or cached[0] is not optimizer:
            cached = (optimizer, _exchange_layouts(local))
            object.__setattr__(module, _LAYOUTS, cached)
        layouts = cached[1]
        for name in sorted(layouts):
            value = local.get(name)
            if value is None:  # no shard here: an empty ShardedTensor with the table's global layout
                metadata, group = layouts[name]
                value = ShardedTensor._init_from_local_shards_and_global_metadata(
                    [], metadata, process_group=group
                )
            if module.__dict__.get(name) is not value:
                object.__setattr__(module, name, value)


def _exchange_layouts(local: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every rank's ``{attribute: (ShardedTensorMetadata, process group)}``, merged (collective)."""
    mine = {name: value.metadata() for name, value in local.items()}
    groups = {name: value._process_group for name, value in local.items()}
    everyone: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    merged: dict[str, Any] = {}
    for metadata in everyone:
        for name, meta in metadata.items():
            merged.setdefault(name, meta)
    return {name: (merged[name], groups.get(name, dist.group.WORLD)) for name in sorted(merged)}


def skipped_log(what: str, modules: list[tuple[str, nn.Module]]) -> str:
    """The one log line that says which modules a wrapper left alone (``sparse (ShardedEBC), ...``)."""
    names = ", ".join(f"{name or '<root>'} ({type(module).__name__})" for name, module in modules)
    return f"{what} leaves the modules TorchRec sharded alone (it moves their values itself): {names}"


__all__ = [
    "FUSED_PREFIX",
    "attach_fused_state",
    "ddp_ignored_names",
    "foreign_modules",
    "foreign_parameters",
    "is_inside_foreign",
    "skipped_log",
]
