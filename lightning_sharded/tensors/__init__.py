"""One adapter per kind of sharded tensor, behind the :class:`ShardedAdapter` protocol.

The package registers them in :data:`~lightning_sharded.tensors.base.KINDS`; :func:`adapter_for` finds
the one for a value (the legacy ShardedTensor only once torch imported it), :func:`to_full` gathers one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_sharded.tensors.base import KINDS, ShardedAdapter, adapter_for, to_full
from lightning_sharded.tensors.dtensor import DTensorAdapter
from lightning_sharded.tensors.sharded_tensor import ShardedTensorAdapter

KINDS[:] = [DTensorAdapter(), ShardedTensorAdapter()]


def gather_full_values(state: dict[str, Any]) -> dict[str, Any]:
    """Replace every sharded value of ``state`` by its whole tensor on CPU, in place; returns ``state``.

    Collective: every rank must call it with the same sharded keys; keys are visited in sorted order
    so the gathers line up on every rank.
    """
    for key in sorted(state):
        if adapter_for(state[key]) is not None:
            state[key] = to_full(state[key]).cpu()
    return state


def exchange_codes(value: Any, code: int) -> dict[int, int]:
    """Every rank's ``code`` (a positive int) among the ranks that hold the sharded ``value``: a MAX
    all-reduce over the value's groups (collective; :func:`~.checkpoint.collective.agree` gathers errors).

    Returns ``{global rank: code}`` for each rank holding ``value``, the same dict on all of them; just
    ``{this rank: code}`` when ``value`` lives on one rank. Every rank holding ``value`` must call it,
    in the same order, so that a decision (load, skip, stop) is taken once for all of them.
    """
    adapter = adapter_for(value)
    assert adapter is not None
    rank = dist.get_rank() if dist.is_initialized() else 0
    groups = adapter.groups(value)
    if not groups:
        return {rank: code}
    device = torch.device("cpu")
    if any(dist.get_backend(group) == "nccl" for group in groups):
        device = torch.device("cuda", torch.cuda.current_device())
    codes = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    codes[rank] = code
    for group in groups:
        dist.all_reduce(codes, op=dist.ReduceOp.MAX, group=group)
    return {r: int(c) for r, c in enumerate(codes.tolist()) if c}


__all__ = ["ShardedAdapter", "adapter_for", "exchange_codes", "gather_full_values", "to_full"]
