"""This library's strategy names in Lightning's ``StrategyRegistry``, without importing Lightning.

Importing ``lightning.pytorch.strategies`` (whose ``StrategyRegistry`` the Trainer reads) imports all
of ``lightning.pytorch``, about 2 s: :func:`install` registers the names at once when it is already
imported, else right after it is, through a ``sys.meta_path`` finder (as wrapt's post-import hooks
do; ``docs/architecture.md``). Each entry is a factory that imports the strategy class at
``Trainer(...)``. The names stay out of ``FSDPStrategy.get_registered_strategies()``: that list is what
the Trainer refuses on CPU, and these strategies run on CPU.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec

__all__ = ["STRATEGIES", "install", "register"]

#: The module whose ``StrategyRegistry`` the Trainer reads.
REGISTRY_MODULE = "lightning.pytorch.strategies"

_FSDP = "lightning_sharded.strategies.fsdp"
_MP = "lightning_sharded.strategies.model_parallel"

#: Every name this library registers: its strategy's module and class, description and init arguments.
STRATEGIES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "sharded_fsdp": (
        _FSDP,
        "ShardedFSDPStrategy",
        "FSDP1 with sharded attributes and sharded checkpoints (lightning_sharded)",
        {},
    ),
    "sharded_fsdp_cpu_offload": (
        _FSDP,
        "ShardedFSDPStrategy",
        "FSDP1 with CPU offloading, sharded attributes and sharded checkpoints (lightning_sharded)",
        {"cpu_offload": True},
    ),
    "sharded_model_parallel": (
        _MP,
        "ShardedModelParallelStrategy",
        "FSDP2 / tensor parallelism with sharded attributes and sharded checkpoints (lightning_sharded)",
        {},
    ),
}


def _factory(module: str, cls: str) -> Callable[..., Any]:
    """A callable that imports ``module.cls`` and instantiates it with the registry's init arguments."""

    def make(**init_params: Any) -> Any:
        return getattr(importlib.import_module(module), cls)(**init_params)

    make.__name__ = make.__qualname__ = cls
    make.__doc__ = f"``{module}.{cls}(**init_params)``, imported on first use."
    return make


def register(registry: Any, names: Sequence[str] | None = None, strategy: Any = None) -> None:
    """Register ``names`` (default: all of :data:`STRATEGIES`) in ``registry`` (a ``_StrategyRegistry``).

    Each entry gets ``strategy`` (the class itself, from a strategy's ``register_strategies``) or a
    factory that imports the class on first use. A name already registered is replaced.
    """
    for name in names if names is not None else sorted(STRATEGIES):
        module, cls, description, init_params = STRATEGIES[name]
        registry.register(
            name,
            strategy if strategy is not None else _factory(module, cls),
            description=description,
            override=True,
            **init_params,
        )


def _register_into(module: ModuleType) -> None:
    registry = getattr(module, "StrategyRegistry", None)
    if registry is not None and not all(name in registry for name in STRATEGIES):
        register(registry)


class _RegisterAfterImport:
    """A ``sys.meta_path`` finder that finds nothing itself: it lets the other finders find
    :data:`REGISTRY_MODULE` and hands the import system their spec with the loader wrapped
    (:class:`_Registering`). (Not an ``importlib.abc.MetaPathFinder``: importing that module costs more
    than all of this one.)"""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != REGISTRY_MODULE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = cast("Loader", _Registering(spec.loader))  # this import's spec, made for it now
        return spec


class _Registering:
    """The found loader of :data:`REGISTRY_MODULE`, wrapped as ``importlib.util.LazyLoader`` wraps one:
    the module gets its own loader back, runs, then this library's names are registered in it."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader  # as LazyLoader does: the module keeps the loader that found it
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)  # an error leaves the hook in place: the next import tries again
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterAfterImport)]
        _register_into(module)


def install() -> None:
    """Register the names now if ``lightning.pytorch.strategies`` is imported, else right after it is."""
    module = sys.modules.get(REGISTRY_MODULE)
    if module is not None and getattr(module, "StrategyRegistry", None) is not None:
        _register_into(module)
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
