"""Jobs of ``scenario_wrapping.py`` for the load hooks' agreement: one rank fails, every rank raises.

``agree`` runs, on every rank of the job, loads of a module with three sharded attributes (``a`` and
``b``: DTensors, ``c``: a ShardedTensor) where only the last rank has something wrong: its copy of ``a``
raises after the collective, its value for ``a`` (then for ``c``) has another shape, its state dict
lacks ``b``. Each
rank records what it raised and the values it holds afterwards; after each case a correct load must
work on every rank, which shows that no rank was left inside a collective. Rank 0 writes every rank's
record.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_sharded import register_sharded_state_hooks
from lightning_sharded.tensors import to_full
from lightning_sharded.tensors.dtensor import DTensorAdapter


def build() -> nn.Module:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    module = nn.Module()
    module.a = distribute_tensor(torch.zeros(4, 2), mesh, [Replicate()], src_data_rank=None)
    module.b = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)], src_data_rank=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
        module.c = sharded_tensor.zeros(spec, 4, 2)
    return register_sharded_state_hooks(module)


def source(value: float) -> dict[str, Any]:
    """A state dict whose ``a`` is sharded (Shard(0)): loading it into the replicated ``a`` all-gathers."""
    other = build()
    state = other.state_dict()
    from torch.distributed.tensor import Shard, distribute_tensor

    state["a"] = distribute_tensor(torch.full((4, 2), value), state["b"].device_mesh, [Shard(0)])
    state["b"] = torch.full((4, 2), value + 1)
    state["c"] = torch.full((4, 2), value + 2)
    return state


@contextmanager
def failing_copy_on(rank: int) -> Iterator[None]:
    """On ``rank``, the copy into a DTensor raises after its collective (an OOM or a bad local copy)."""
    original = DTensorAdapter.copy_into

    def copy_into(self: DTensorAdapter, target: Any, value: Any) -> None:
        original(self, target, value)
        if dist.get_rank() == rank:
            raise RuntimeError("injected failure")

    DTensorAdapter.copy_into = copy_into  # type: ignore[method-assign]
    try:
        yield
    finally:
        DTensorAdapter.copy_into = original  # type: ignore[method-assign]


def attempt(module: nn.Module, state: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    try:
        module.load_state_dict(state, **kwargs)
        error = None
    except RuntimeError as ex:
        error = str(ex)
    values = {name: to_full(getattr(module, name)).clone() for name in ("a", "b", "c")}
    return {"error": error, "values": values}


def recovered() -> bool:
    """A correct load works on every rank: nobody was left inside a collective."""
    follow_up = build()
    follow_up.load_state_dict(source(7.0))
    return all(
        torch.equal(to_full(getattr(follow_up, n)), torch.full((4, 2), 7.0 + i)) for i, n in enumerate("abc")
    )


def agree(job: dict[str, Any]) -> None:
    if not dist.is_initialized():  # first job of the launch: no Trainer made the group yet
        dist.init_process_group("gloo")
    last = dist.get_world_size() - 1
    record: dict[str, Any] = {}
    with failing_copy_on(last):
        record["copy-fails"] = attempt(build(), source(1.0))
    record["copy-fails"]["recovered"] = recovered()
    state = source(2.0)
    if dist.get_rank() == last:
        state["a"] = torch.zeros(5, 2)
    record["invalid"] = attempt(build(), state)
    record["invalid"]["recovered"] = recovered()
    state = source(5.0)
    if dist.get_rank() == last:  # the same for the ShardedTensor: its group's own agreement
        state["c"] = torch.zeros(5, 2)
    record["invalid-sharded"] = attempt(build(), state)
    record["invalid-sharded"]["recovered"] = recovered()
    state = source(3.0)
    if dist.get_rank() == last:
        del state["b"]
    record["missing"] = attempt(build(), state, strict=False)
    record["missing"]["recovered"] = recovered()
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        torch.save(records, job["out"])


JOBS = {"agree": agree}
