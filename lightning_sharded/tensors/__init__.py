"""One adapter per kind of sharded tensor, behind the :class:`ShardedAdapter` protocol.

``ADAPTERS`` lists them; :func:`adapter_for` finds the one for a value and :func:`sharded_types` gives
the classes that exist right now (the legacy ShardedTensor only once torch imported it).
"""

from __future__ import annotations

from typing import Any

from lightning_sharded.tensors.base import ShardedAdapter
from lightning_sharded.tensors.dtensor import DTensorAdapter
from lightning_sharded.tensors.sharded_tensor import ShardedTensorAdapter

ADAPTERS: tuple[ShardedAdapter, ...] = (DTensorAdapter(), ShardedTensorAdapter())


def adapter_for(value: Any) -> ShardedAdapter | None:
    """The adapter whose kind ``value`` is, or ``None`` for anything that is not sharded."""
    for adapter in ADAPTERS:
        if adapter.is_sharded(value):
            return adapter
    return None


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a sharded tensor of a kind this library knows."""
    return adapter_for(value) is not None


def sharded_types() -> tuple[type, ...]:
    """The sharded tensor classes that currently exist in this process."""
    return tuple(t for adapter in ADAPTERS for t in adapter.types())


def to_full(value: Any) -> Any:
    """The whole tensor for a sharded value (collective), or ``value`` itself for anything else."""
    adapter = adapter_for(value)
    return adapter.to_full(value) if adapter is not None else value


def gather_full_values(state: dict[str, Any]) -> dict[str, Any]:
    """Replace every sharded value of ``state`` by its whole tensor on CPU, in place; returns ``state``.

    Collective: every rank must call it with the same sharded keys; keys are visited in sorted order
    so the gathers line up on every rank.
    """
    for key in sorted(state):
        adapter = adapter_for(state[key])
        if adapter is not None:
            state[key] = adapter.to_full(state[key]).cpu()
    return state


__all__ = [
    "ADAPTERS",
    "ShardedAdapter",
    "adapter_for",
    "gather_full_values",
    "is_sharded",
    "sharded_types",
    "to_full",
]
