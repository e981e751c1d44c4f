"""Per-rank state of the user's own objects: registered on the module, saved and restored on each rank.

What the strategies cannot see (a curriculum sampler, a NumPy ``default_rng``, a data-mixing schedule, a
``torch.Generator`` of one's own) is registered once, under a name, on the LightningModule::

    from lightning_sharded import register_rank_state

    register_rank_state(module, "mixing", schedule)  # anything with state_dict() / load_state_dict()
    register_rank_state(module, "noise", np.random.default_rng(seed + rank))

Each save then keeps ``{name: obj.state_dict()}`` in every rank's own state (see
``docs/checkpoint-format.md#per-rank-state-exact-resume``), and a resume gives each rank its own back
before the first resumed batch. ``torch.Generator``, ``numpy.random.Generator``,
``numpy.random.RandomState`` and ``random.Random`` are accepted as they are (their states are kept as
tensors and plain data, which a ``weights_only`` load reads); any other object needs ``state_dict()``
returning tensors and plain Python data, and ``load_state_dict(state)``.

The same adapters (:func:`stateful`) keep the process-wide ``random`` and ``np.random`` generators in
the per-rank state. This module imports torch only (NumPy when an object of it is registered).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Mapping
from operator import methodcaller
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # DCP imports ShardedTensor, which importing the library must not
    from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["register_rank_state", "registered_rank_state", "stateful"]

#: Where the registry lives in the module's ``__dict__`` (a plain dict: no state_dict key, no submodule).
_REGISTRY = "_lightning_sharded_rank_state"


class _Adapter:
    """A generator as DCP's ``Stateful``: ``{"state": get(obj)}``, set back with ``put(obj, state)``."""

    def __init__(self, obj: Any, get: Callable[[Any], Any], put: Callable[[Any, Any], object]) -> None:
        self.obj, self._get, self._put = obj, get, put

    def state_dict(self) -> dict[str, Any]:
        return {"state": self._get(self.obj)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._put(self.obj, state["state"])


def _set_torch(rng: torch.Generator, state: Any) -> None:
    rng.set_state(state)


def _set_python(rng: random.Random, state: Any) -> None:
    version, internal, gauss = state  # kept as a tuple of ints, as the per-rank state keeps random's
    rng.setstate((version, tuple(internal), gauss))


def _plain(value: Any) -> Any:
    """NumPy arrays and scalars in a (nested) state as Python lists and numbers."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value.tolist() if hasattr(value, "tolist") else value


def _like(value: Any, template: Any) -> Any:
    """``value`` (from :func:`_plain`) with NumPy arrays where ``template`` has them, of their dtype."""
    import numpy

    if isinstance(template, Mapping) and isinstance(value, Mapping):
        return {k: _like(v, template.get(k)) for k, v in value.items()}
    if isinstance(template, numpy.ndarray):
        return numpy.asarray(value, dtype=template.dtype)
    return value


def _numpy_bits(rng: Any) -> Any:
    """``numpy.random.Generator`` (``default_rng``): its bit generator's state."""
    return _plain(rng.bit_generator.state)


def _set_numpy_bits(rng: Any, state: Any) -> None:
    rng.bit_generator.state = _like(state, rng.bit_generator.state)


def _numpy_legacy(rng: Any) -> Any:
    """``numpy.random.RandomState``: its legacy state tuple, as lists."""
    return _plain(rng.get_state(legacy=True))


def _set_numpy_legacy(rng: Any, state: Any) -> None:
    import numpy

    name, keys, pos, has_gauss, cached = state
    rng.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached))


def stateful(obj: Any) -> Stateful | None:
    """``obj`` as DCP's ``Stateful``: itself if it has ``state_dict``/``load_state_dict``, an adapter for a
    ``torch.Generator``, ``random.Random``, ``numpy.random.Generator`` or ``RandomState``, else ``None``."""
    if isinstance(obj, torch.Generator):
        return _Adapter(obj, methodcaller("get_state"), _set_torch)
    if isinstance(obj, random.Random):
        return _Adapter(obj, methodcaller("getstate"), _set_python)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.random.Generator):
        return _Adapter(obj, _numpy_bits, _set_numpy_bits)
    if numpy is not None and isinstance(obj, numpy.random.RandomState):
        return _Adapter(obj, _numpy_legacy, _set_numpy_legacy)
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return obj  # type: ignore[no-any-return]
    return None


def _target(entry: Any) -> Any:
    """The registered object itself (an adapter's wrapped object)."""
    return entry.obj if isinstance(entry, _Adapter) else entry


def register_rank_state(module: Any, name: str, obj: Any, *, replace: bool = False) -> None:
    """Keep ``obj``'s state in every checkpoint, per rank, and restore it on each rank at a resume.

    ``obj.state_dict()`` is taken at every save on every rank (with the RNG and train dataloader
    states, see ``save_rank_state``), and ``obj.load_state_dict(state)`` is called with the rank's own
    state when ``trainer.fit(ckpt_path=...)`` resumes, before the first resumed batch: once the train
    dataloader exists and before its first iterator is created, so a sampler or dataset registered in
    ``train_dataloader()`` is restored before it yields. Works with :class:`ShardedFSDPStrategy` and
    :class:`ShardedModelParallelStrategy` for any LightningModule (the mixin's
    :meth:`~lightning_sharded.ShardedStateMixin.register_rank_state` calls this).

    Args:
        module: The LightningModule the strategy trains (the registry lives on it, under a private
            attribute; nothing is added to its ``state_dict``).
        name: The key of the state in the checkpoint: a non-empty string, one object per name.
        obj: Anything with ``state_dict()`` (returning tensors and plain Python data, so that a
            ``weights_only`` load reads it) and ``load_state_dict(state)``; or a ``torch.Generator``,
            ``numpy.random.Generator`` (``default_rng``), ``numpy.random.RandomState`` or
            ``random.Random``, whose states are kept as they are.
        replace: Register ``obj`` under a name that holds another object (e.g. a sampler that
            ``train_dataloader()`` creates anew on a reload).

    Raises:
        TypeError: ``obj`` has no ``state_dict``/``load_state_dict`` and is not one of the generators
            above, or ``name`` is not a string.
        ValueError: ``name`` is empty, or already holds another object and ``replace`` is ``False``
            (registering the same object under the same name again does nothing).
    """
    if not isinstance(name, str):
        raise TypeError(f"The name of a per-rank state must be a string, got {type(name).__name__}.")
    if not name:
        raise ValueError("The name of a per-rank state must not be empty: it is its key in the checkpoint.")
    entry = stateful(obj)
    if entry is None:
        raise TypeError(
            f"Cannot register {type(obj).__name__} as the per-rank state {name!r}: it has no `state_dict()`"
            " and `load_state_dict(state)`. Register an object that has both (a small wrapper will do), or a"
            " torch.Generator, numpy.random.Generator, numpy.random.RandomState or random.Random."
        )
    registry: dict[str, Any] = module.__dict__.setdefault(_REGISTRY, {})
    current = registry.get(name)
    if current is not None and _target(current) is obj:
        return
    if current is not None and not replace:
        raise ValueError(
            f"The per-rank state {name!r} is already registered on {type(module).__name__}, for a"
            f" {type(_target(current)).__name__}. Choose another name, or pass `replace=True` to register"
            " this object in its place."
        )
    registry[name] = entry


def registered_rank_state(module: Any) -> dict[str, Stateful]:
    """The objects registered on ``module`` with :func:`register_rank_state`, by name, sorted by name.

    Each value has ``state_dict()`` and ``load_state_dict()`` (generators through a small adapter).
    """
    registry = getattr(module, "__dict__", {}).get(_REGISTRY) or {}
    return {name: registry[name] for name in sorted(registry)}
