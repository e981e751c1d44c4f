"""Finding the sharded attributes of a module tree, fast when nothing changed since the last call.

A *site* is one sharded attribute: a ``DTensor`` or ``ShardedTensor`` held in a module's ``__dict__``
(not in ``_parameters``, ``_buffers`` or ``_modules``). The hooks need the sites of the whole tree at
every call; :class:`SiteIndex` keeps the last walk and proves it still holds with a few C-level passes
(``docs/hooks.md``, "Finding the attributes cheaply"). A module's ``__dict__`` and ``_modules`` dict
are assumed to stay the same objects, as ``nn.Module`` keeps them (the check reads the dicts it saw,
not the modules). The walk stops at a submodule that carries its own registration (:data:`MARKER`):
that submodule's hooks report its sites. Paths go through wrappers by module identity
(:mod:`lightning_sharded._fqn`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

from torch import nn

from lightning_sharded._fqn import walk
from lightning_sharded.tensors import adapter_for

#: Set in the ``__dict__`` of every module whose hooks this library registered.
MARKER = "_lightning_sharded_hooks"

# Every nn.Module has these entries in its __dict__; none of them can hold a sharded attribute.
STANDARD_KEYS = frozenset(nn.Module().__dict__) | {MARKER}

_modules_of = operator.itemgetter("_modules")
_call: Callable[..., Any] = getattr(operator, "call", lambda fn, arg: fn(arg))  # operator.call: 3.11+
# A getter for a module without extra entries: returns a constant-typed tuple, keeps the pass uniform.
_NO_EXTRAS = operator.itemgetter("training", "training")


@dataclass(frozen=True)
class Site:
    """One sharded attribute ``module.<name>`` of the tree, with its two keys relative to the root."""

    module: nn.Module
    name: str
    #: As ``state_dict()`` gives a parameter at this place (its path through wrappers spelled so).
    key: str
    #: The clean FQN, as ``get_model_state_dict`` gives it.
    clean_key: str

    @property
    def value(self) -> Any:
        return self.module.__dict__[self.name]


@dataclass
class _Snapshot:
    modules: list[nn.Module]
    dicts: list[dict[str, Any]]  # each module's __dict__
    lengths: list[int]  # of each module's __dict__
    child_dicts: list[dict[str, Any]]  # each module's _modules
    child_counts: list[int]
    parents: list[dict[str, Any]]  # the non-empty _modules among them
    children: list[Any]
    getters: list[Callable[[dict[str, Any]], tuple[Any, ...]]]
    types: list[type]
    sites: tuple[Site, ...]
    owners: dict[str, nn.Module]  # module path ("" or "a.b.") in either spelling -> module


class SiteIndex:
    """Finds the :class:`Site` s of a tree rooted at one module; cached between calls.

    The cache holds references to modules; the hooks that own an index never copy or pickle it.
    """

    def __init__(self) -> None:
        self._snapshot: _Snapshot | None = None

    def find(self, root: nn.Module) -> tuple[Site, ...]:
        """The sites of ``root``'s tree, in a deterministic depth-first order (the same on every rank)."""
        snap = self._snapshot
        if snap is not None and snap.modules[0] is root and self._still_valid(snap):
            return snap.sites
        snap = self._walk(root)
        self._snapshot = snap
        return snap.sites

    def owner(self, root: nn.Module, relative_key: str) -> tuple[nn.Module, str] | None:
        """The module and attribute name that ``relative_key`` ("a.b.name") denotes under ``root``.

        Either spelling of the path works (raw or clean); the module is the one the walk found at that
        place, so a key through ``torch.compile`` names the compiled module's original, not the wrapper.
        ``None`` if no walked module has that path (outside the tree, or in a submodule with its own
        registration).
        """
        self.find(root)
        assert self._snapshot is not None
        path, _, name = relative_key.rpartition(".")
        module = self._snapshot.owners.get(path + "." if path else "")
        return (module, name) if module is not None else None

    @staticmethod
    def _still_valid(snap: _Snapshot) -> bool:
        dicts = snap.dicts
        if list(map(len, dicts)) != snap.lengths:
            return False
        # A child added or removed anywhere changes a count; a child replaced can only be in a
        # module that had children. `==` on lists of modules compares identities first.
        if list(map(len, snap.child_dicts)) != snap.child_counts:
            return False
        if list(chain.from_iterable(map(dict.values, snap.parents))) != snap.children:
            return False
        try:
            types = list(map(type, chain.from_iterable(map(_call, snap.getters, dicts))))
        except KeyError:  # an extra entry was deleted (and another added: the length is the same)
            return False
        return types == snap.types

    @staticmethod
    def _walk(root: nn.Module) -> _Snapshot:
        modules: list[nn.Module] = []
        getters: list[Callable[[dict[str, Any]], tuple[Any, ...]]] = []
        sites: list[Site] = []
        owners: dict[str, nn.Module] = {}
        # Registered submodules are not entered: their own hooks report their sites.
        for path, clean, module in walk(root, enter=lambda child: MARKER not in vars(child)):
            modules.append(module)
            owners.setdefault(path, module)
            owners.setdefault(clean, module)
            extras = [k for k in vars(module) if k not in STANDARD_KEYS]
            getters.append(operator.itemgetter(*extras, extras[0]) if extras else _NO_EXTRAS)
            for name in extras:
                if adapter_for(module.__dict__[name]) is not None:
                    sites.append(Site(module, name, path + name, clean + name))
        dicts = list(map(vars, modules))
        child_dicts = list(map(_modules_of, dicts))
        parents = [d for d in child_dicts if d]
        return _Snapshot(
            modules=modules,
            dicts=dicts,
            lengths=list(map(len, dicts)),
            child_dicts=child_dicts,
            child_counts=list(map(len, child_dicts)),
            parents=parents,
            children=list(chain.from_iterable(map(dict.values, parents))),
            getters=getters,
            types=list(map(type, chain.from_iterable(map(_call, getters, dicts)))),
            sites=tuple(sites),
            owners=owners,
        )
