"""The protocol every sharded-tensor adapter implements.

An adapter knows one kind of sharded value (``DTensor``, the legacy ``ShardedTensor``) and answers the
few questions the hooks and the checkpoint code ask about it. Adding a kind is adding a module with an
adapter and listing it in :mod:`lightning_sharded.tensors`; nothing else switches on the kind.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class ShardedAdapter(Protocol):
    """What the library needs to know about one kind of sharded tensor."""

    def is_sharded(self, value: Any) -> bool:
        """Whether ``value`` is of this kind."""

    def global_shape(self, value: Any) -> torch.Size:
        """The shape of the whole (unsharded) tensor."""

    def dtype(self, value: Any) -> torch.dtype:
        """The element type."""

    def detach(self, value: Any) -> Any:
        """``value`` without autograd history, as ``state_dict(keep_vars=False)`` returns tensors."""

    def copy_into(self, target: Any, source: Any) -> None:
        """Copy ``source`` into ``target`` in place, resharding as needed.

        ``source`` is a value of any sharded kind or a full ``torch.Tensor`` holding the global value
        (identical on every rank). The global shape and dtype must already have been checked.
        Collective when ``source`` is sharded with another layout: every rank of ``target``'s group
        must call it, in the same order.
        """

    def to_full(self, value: Any) -> torch.Tensor:
        """Gather the whole tensor on every rank (collective for distributed values)."""

    def local_tensors(self, value: Any) -> list[torch.Tensor]:
        """The tensors holding this rank's part of ``value`` (its memory; not copies)."""

    def views_like(self, value: Any, pieces: list[torch.Tensor], dtype: torch.dtype) -> Any:
        """A value of this kind laid out like ``value`` (global shape, shards, ranks) whose local tensors
        are ``pieces`` (one per :meth:`local_tensors` of ``value``, of the same shapes) of ``dtype``,
        which may differ from ``value``'s. No communication."""

    def groups(self, value: Any) -> list[Any]:
        """Process groups whose all-reduces, one after the other, reach every rank that holds ``value``.

        Empty when ``value`` lives on one rank only (or no process group exists): nothing to agree with.
        """


#: The adapters of every kind, in the order they are asked: the one registry. The package fills it
#: (:mod:`lightning_sharded.tensors`), so an adapter finds another kind's without importing it.
KINDS: list[ShardedAdapter] = []


def adapter_for(value: Any) -> ShardedAdapter | None:
    """The adapter whose kind ``value`` is, or ``None`` for anything that is not sharded."""
    for adapter in KINDS:
        if adapter.is_sharded(value):
            return adapter
    return None


def to_full(value: Any) -> Any:
    """The whole tensor for a sharded value of any kind (collective), or ``value`` itself otherwise."""
    adapter = adapter_for(value)
    return adapter.to_full(value) if adapter is not None else value
