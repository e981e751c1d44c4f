"""Names through the wrappers torch and Lightning put around modules: raw state-dict keys and clean FQNs.

A wrapper holds the module it wraps as a child; each such edge, recognised by the parent's class and
the child's identity (never by the name alone), has two spellings of its path part: *raw*, as
``nn.Module.state_dict()`` spells a parameter's key through it, and *clean*, as
``torch.distributed.checkpoint.state_dict`` names it (no wrapper part). The wrappers and what each
keeps: ``docs/hooks.md``, "How keys are named through wrappers".

Every class is looked up in ``sys.modules``: an instance cannot exist before its module was imported,
so nothing is imported here (``torch._dynamo`` and FSDP are slow to import).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lightning_sharded._compat import CHECKPOINT_WRAPPER_MODULE, DYNAMO_EVAL_FRAME_MODULE

__all__ = ["WRAPPER_PARTS", "clean_keys", "clean_prefix", "edges", "parameter_names", "walk"]


@dataclass(frozen=True)
class _Wrapper:
    module: str  # where the class lives (looked up in sys.modules)
    cls: str
    inner: str  # the child that is the wrapped module
    keeps_part: bool  # whether state_dict() keeps the part in parameter keys
    skip: tuple[str, ...] = ()  # children that are other views of the wrapped module


_WRAPPERS = (
    _Wrapper("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel",
             "_fsdp_wrapped_module", keeps_part=False),
    _Wrapper(CHECKPOINT_WRAPPER_MODULE, "ActivationWrapper",
             "_checkpoint_wrapped_module", keeps_part=False),
    _Wrapper(DYNAMO_EVAL_FRAME_MODULE, "OptimizedModule", "_orig_mod", keeps_part=True),
    _Wrapper("torch.nn.parallel.distributed", "DistributedDataParallel", "module", keeps_part=True),
    _Wrapper("lightning.fabric.wrappers", "_FabricModule", "_original_module", keeps_part=False,
             skip=("_forward_module",)),
)  # fmt: skip

#: Path parts that only wrappers add; a prefix handed to a hook may contain them (see :func:`clean_prefix`).
WRAPPER_PARTS = frozenset({w.inner for w in _WRAPPERS} | {part for w in _WRAPPERS for part in w.skip})


def edges(parent: nn.Module) -> Iterator[tuple[str, str, nn.Module]]:
    """``(raw part, clean part, child)`` for the children of ``parent`` to walk, in registration order
    (a part is ``"name."`` or ``""``).

    A wrapper's wrapped module comes with its part removed from the clean spelling (and from the raw one
    where ``state_dict()`` removes it); other views of the wrapped module (Fabric's ``_forward_module``)
    are not walked, since ``state_dict()`` does not visit them either.
    """
    present = ((getattr(sys.modules.get(w.module), w.cls, None), w) for w in _WRAPPERS)
    wrapper = next((w for cls, w in present if isinstance(cls, type) and isinstance(parent, cls)), None)
    for name, child in parent._modules.items():
        if child is None or (wrapper is not None and name in wrapper.skip):
            continue
        if wrapper is not None and name == wrapper.inner:
            yield (name + "." if wrapper.keeps_part else ""), "", child
        else:
            yield name + ".", name + ".", child


def walk(
    root: nn.Module, *, once: bool = False, enter: Callable[[nn.Module], bool] | None = None
) -> Iterator[tuple[str, str, nn.Module]]:
    """``(raw path, clean path, module)`` depth-first from ``root``, children in registration order.

    Like ``state_dict()``, a module reachable by two paths is visited under both; with ``once``, under its
    first only, as ``named_parameters()`` does. ``enter`` says which children to walk into.
    """
    seen: set[int] = set()
    stack: list[tuple[str, str, nn.Module]] = [("", "", root)]
    while stack:
        raw, clean, module = stack.pop()
        if once:  # the only use of `seen`: state_dict's walks (not once) add nothing per module
            if id(module) in seen:
                continue
            seen.add(id(module))
        yield raw, clean, module
        children = [
            (raw + raw_part, clean + clean_part, child)
            for raw_part, clean_part, child in edges(module)
            if enter is None or enter(child)
        ]
        stack.extend(reversed(children))


def clean_prefix(prefix: str) -> str:
    """``prefix`` without the wrapper parts an enclosing module may have put in it (``"_orig_mod."``...).

    Only a fallback spelling: the hooks see their root's prefix as a string, not the modules above it.
    """
    parts = [part for part in prefix.split(".")[:-1] if part not in WRAPPER_PARTS]
    return "".join(part + "." for part in parts)


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> clean FQN`` for every parameter of ``model``, as torch's state-dict helpers name it.

    Visits modules and parameters in ``named_parameters()`` order and keeps the first name of a shared
    parameter, as ``named_parameters()`` does.
    """
    names: dict[int, str] = {}
    for _, path, module in walk(model, once=True):
        for name, param in module._parameters.items():
            if isinstance(param, torch.Tensor):
                names.setdefault(id(param), path + name)
    return names


def clean_keys(model: nn.Module, state: dict[str, object]) -> dict[str, object]:
    """``state`` (``model.state_dict()``, raw keys) with every key spelled cleanly, values untouched.

    A key is its module's raw path and a local name; the module's clean path replaces the raw one
    (``body._orig_mod.0.weight`` -> ``body.0.weight`` for a compiled ``body``). A key whose module is not
    found stays as it is.
    """
    # Every path, as state_dict() writes a module reachable by two paths under both.
    prefixes = {raw: clean for raw, clean, _ in walk(model) if raw != clean}
    if not prefixes:
        return state
    renamed: dict[str, object] = {}
    for key, value in state.items():
        head, dot, name = key.rpartition(".")
        spelled = prefixes.get(head + dot) if dot else None
        renamed[spelled + name if spelled is not None else key] = value
    return renamed
