"""Per-rank state of the user's own objects: registered on the module, saved and restored on each rank
(``docs/checkpoint-format.md#per-rank-state-exact-resume``). :func:`stateful` keeps generators' states
(also the process-wide ``random`` and ``np.random``) as tensors and plain data, which a ``weights_only``
load reads. This module imports torch only (NumPy when an object of it is registered).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # DCP imports ShardedTensor, which importing the library must not
    from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["register_rank_state", "registered_rank_state", "stateful"]

#: Where the registry lives in the module's ``__dict__`` (a plain dict: no state_dict key, no submodule).
_REGISTRY = "_lightning_sharded_rank_state"


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


#: Each kind of generator's ``(get, set)`` of its state; the state as tensors and plain Python data
#: (``random``'s as a tuple of ints, NumPy's without arrays). By name, so that an adapter pickles.
_KINDS: dict[str, tuple[Callable[[Any], Any], Callable[[Any, Any], object]]] = {
    "torch": (lambda rng: rng.get_state(), lambda rng, state: rng.set_state(state)),
    "random": (lambda rng: rng.getstate(), lambda rng, s: rng.setstate((s[0], tuple(s[1]), s[2]))),
    "numpy": (  # numpy.random.Generator (default_rng): its bit generator's state
        lambda rng: _plain(rng.bit_generator.state),
        lambda rng, state: setattr(rng.bit_generator, "state", _like(state, rng.bit_generator.state)),
    ),
    "legacy": (  # numpy.random.RandomState: its legacy state tuple
        lambda rng: _plain(rng.get_state(legacy=True)),
        lambda rng, s: rng.set_state((s[0], sys.modules["numpy"].asarray(s[1], dtype="uint32"), *s[2:])),
    ),
}


class _Adapter:
    """A generator as DCP's ``Stateful``: ``{"state": its state}``, through its kind's :data:`_KINDS`."""

    def __init__(self, obj: Any, kind: str) -> None:
        self.obj, self.kind = obj, kind

    def state_dict(self) -> dict[str, Any]:
        return {"state": _KINDS[self.kind][0](self.obj)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _KINDS[self.kind][1](self.obj, state["state"])


def stateful(obj: Any) -> Stateful | None:
    """``obj`` as DCP's ``Stateful``: itself if it has ``state_dict``/``load_state_dict``, an adapter for a
    ``torch.Generator``, ``random.Random``, ``numpy.random.Generator`` or ``RandomState``, else ``None``."""
    if isinstance(obj, torch.Generator):
        return _Adapter(obj, "torch")
    if isinstance(obj, random.Random):
        return _Adapter(obj, "random")
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.random.Generator):
        return _Adapter(obj, "numpy")
    if numpy is not None and isinstance(obj, numpy.random.RandomState):
        return _Adapter(obj, "legacy")
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return obj  # type: ignore[no-any-return]
    return None


def _target(entry: Any) -> Any:
    """The registered object itself (an adapter's wrapped object)."""
    return entry.obj if isinstance(entry, _Adapter) else entry


def register_rank_state(module: Any, name: str, obj: Any, *, replace: bool = False) -> None:
    """Keep ``obj``'s state in every checkpoint, per rank, and restore it on each rank at a resume.

    ``obj.state_dict()`` is taken at every save on every rank; ``obj.load_state_dict(state)`` gets the
    rank's own state when ``trainer.fit(ckpt_path=...)`` resumes, once the train dataloader exists and
    before its first iterator (an object made in ``train_dataloader()`` is restored before it yields).
    For any LightningModule trained with ``ShardedFSDPStrategy`` or ``ShardedModelParallelStrategy``.

    Args:
        module: The LightningModule; the registry lives on it (nothing is added to its ``state_dict``).
        name: The state's key in the checkpoint: a non-empty string, one object per name.
        obj: Anything with ``state_dict()`` (tensors and plain Python data, so that a ``weights_only``
            load reads it) and ``load_state_dict(state)``, or a generator :func:`stateful` takes.
        replace: Register ``obj`` under a name that holds another object (e.g. a sampler that
            ``train_dataloader()`` creates anew on a reload).

    Raises:
        TypeError: ``obj`` is neither of those, or ``name`` is not a string.
        ValueError: ``name`` is empty, or holds another object and ``replace`` is ``False`` (the same
            object under the same name again does nothing).

    Example::

        register_rank_state(module, "mixing", schedule)  # anything with state_dict() / load_state_dict()
        register_rank_state(module, "noise", np.random.default_rng(seed + rank))
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
    """The objects registered on ``module``, sorted by name, as ``Stateful`` (generators adapted)."""
    registry = getattr(module, "__dict__", {}).get(_REGISTRY) or {}
    return {name: registry[name] for name in sorted(registry)}
