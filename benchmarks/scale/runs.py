"""What each simulated rank runs: the tiny model, and the save and load of each implementation.

- ``ours``: ``write_sharded_checkpoint`` then ``restore_checkpoint`` (manifest, commit, checks,
  decisions, DCP underneath; each loading rank reads its part of the per-rank index);
- ``ours-whole``: the same without the per-rank index (a checkpoint of an earlier version): rank 0
  reads DCP's whole ``.metadata`` and broadcasts it;
- ``stock``: what stock Lightning does: ``dcp.save`` plus ``meta.pt`` from rank 0; ``dcp.load`` of the
  model and the optimizer and ``torch.load`` of ``meta.pt`` on every rank.

:data:`RUNS` holds them by (implementation, phase).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.scale.simworld import SimWorld
from benchmarks.scale.stores import Store
from benchmarks.timing import patched

#: Rows of each parameter per rank, and columns: the shards are tiny, the layers around them are not.
ROWS, COLS = 2, 4


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[Any]:
    """A fake process group of ``world_size`` with this process at ``rank``, and a 1-D device mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _forget_sharding_cache()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
        _forget_sharding_cache()


def _forget_sharding_cache() -> None:
    """DTensor's sharding propagation caches its output specs by the inputs' (meshes compare equal across
    worlds of the same shape), and a cached spec keeps the mesh it was made with: a rank played after
    another would see DTensors on the earlier rank's mesh (its coordinate), and read that rank's shards."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's own cache


def build(mesh: Any, seed: int, *, step: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The tiny model (two sharded parameters, one sharded attribute) and Adam, stepped once if ``step``."""
    from torch.distributed.tensor import DTensor, Shard

    from lightning_sharded import register_sharded_state_hooks

    gen = torch.Generator().manual_seed(seed)

    def sharded(requires_grad: bool = False) -> Any:
        value = DTensor.from_local(torch.randn(ROWS, COLS, generator=gen), mesh, [Shard(0)], run_check=False)
        return nn.Parameter(value) if requires_grad else value

    model = nn.Module()
    model.w1 = sharded(True)
    model.w2 = sharded(True)
    model.table = sharded()  # a sharded attribute: saved and loaded by our hooks
    register_sharded_state_hooks(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    if step:
        for p in model.parameters():
            p.grad = DTensor.from_local(torch.ones(ROWS, COLS), mesh, [Shard(0)], run_check=False)
        optimizer.step()
    return model, optimizer


LIGHTNING_REST = {"epoch": 0, "global_step": 3, "loops": {"fit_loop": {"epoch_progress": {"current": 1}}}}


@contextlib.contextmanager
def spy_writers(world: SimWorld, store: Store) -> Iterator[None]:
    """Inside the block, tell ``world`` where rank 0's shard files go, so the other ranks' can be put
    beside them (each backend's ``dcp_writer`` patched)."""
    from lightning_sharded.checkpoint.backends.local import LocalBackend
    from lightning_sharded.checkpoint.backends.objstore import ObjectStoreBackend

    moved: dict[str, str] = {}  # on S3: the staged version -> where a replayed rank writes instead

    def spy(real: Any) -> Any:
        def dcp_writer(self: Any, staging: Any, **kwargs: Any) -> Any:
            if world.rank == 0:
                world.replicate = store.replicate(staging)
            elif isinstance(staging, str):  # on S3 the staged version is the published one: not over it
                moved[staging] = f"{staging}-rank{world.rank}"
                staging = moved[staging]
            return real(self, staging, **kwargs)

        return dcp_writer

    def beside(real: Any) -> Any:
        def write_bytes(self: Any, loc: Any, data: bytes) -> None:  # a replayed rank's own small files
            for staged, instead in moved.items():
                if isinstance(loc, str) and loc.startswith(staged + "/"):
                    loc = instead + loc[len(staged) :]
            real(self, loc, data)

        return write_bytes

    with contextlib.ExitStack() as stack:
        for cls in (LocalBackend, ObjectStoreBackend):
            stack.enter_context(patched(cls, "dcp_writer", spy(cls.dcp_writer)))
        real_write = ObjectStoreBackend.write_bytes
        stack.enter_context(patched(ObjectStoreBackend, "write_bytes", beside(real_write)))
        yield


def save_ours(target: Any, mesh: Any, rank: int, world: SimWorld, store: Store) -> None:
    from lightning_sharded.checkpoint.save import write_sharded_checkpoint
    from lightning_sharded.checkpoint.state_dicts import model_state_dict, optimizer_state_dict

    model, optimizer = build(mesh, 0, step=True)
    state = {
        "model": model_state_dict(model, full=False),
        "optimizer_0": optimizer_state_dict(model, optimizer, full=False),
    }
    write_sharded_checkpoint(target, state, dict(LIGHTNING_REST), rank=rank)


def save_ours_whole(target: Any, mesh: Any, rank: int, world: SimWorld, store: Store) -> None:
    """Our save, then the per-rank index taken out (as a checkpoint of a version before it): its load
    is the whole-index path, rank 0 reading ``.metadata`` and broadcasting it (not counted: rank 0
    rewrites the manifest after the save)."""
    save_ours(target, mesh, rank, world, store)
    if rank == 0:
        store.drop_index(target)


def load_ours(target: Any, mesh: Any, rank: int, world: SimWorld, store: Store) -> None:
    from lightning_sharded.checkpoint.load import restore_checkpoint

    model, optimizer = build(mesh, 1, step=False)
    restored = restore_checkpoint(str(target), model, [optimizer], weights_only=False)
    assert restored.metadata["global_step"] == 3, restored.metadata


def save_stock(target: Any, mesh: Any, rank: int, world: SimWorld, store: Store) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model, optimizer = build(mesh, 0, step=True)
    state = {"model": get_model_state_dict(model), "optimizer_0": get_optimizer_state_dict(model, optimizer)}
    if rank == 0:
        world.replicate = store.replicate(target)
    else:  # the replayed rank writes beside the checkpoint rank 0 completed, not over its copies
        target = f"{target}-rank{rank}"
    save(state, checkpoint_id=str(target))
    if rank == 0:
        import fsspec

        with fsspec.open(f"{target}/meta.pt", "wb") as f:
            torch.save(dict(LIGHTNING_REST), f)


def load_stock(target: Any, mesh: Any, rank: int, world: SimWorld, store: Store) -> None:
    import fsspec
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load

    model, optimizer = build(mesh, 1, step=False)
    state = {"model": get_model_state_dict(model)}
    load(state, checkpoint_id=str(target))
    set_model_state_dict(model, state["model"])
    optim = {"optimizer_0": get_optimizer_state_dict(model, optimizer)}
    load(optim, checkpoint_id=str(target))
    set_optimizer_state_dict(model, optimizer, optim["optimizer_0"])
    with fsspec.open(f"{target}/meta.pt", "rb") as f:
        meta = torch.load(f, weights_only=False)
    assert meta["global_step"] == 3


#: A run of one rank: ``(target, mesh, rank, world, store)``, save or load.
Run = Callable[[Any, Any, int, SimWorld, Store], None]
#: The runs by (implementation, phase): a new implementation is its save and its load here.
RUNS: dict[tuple[str, str], Run] = {
    ("ours", "save"): save_ours,
    ("ours", "load"): load_ours,
    ("ours-whole", "save"): save_ours_whole,
    ("ours-whole", "load"): load_ours,
    ("stock", "save"): save_stock,
    ("stock", "load"): load_stock,
}
