"""Where sharded values are cut and staged, at 4 real ranks (``tests/test_devices.py`` starts it).

Usage: ``python devices_script.py OUT`` under 4 ranks; rank 0 writes ``OUT/devices.json``: one record
per check and rank, ``{"check", "rank", "ok", "detail"}``.

- ``local_part``: :func:`~lightning_sharded.tensors.dtensor.local_part` cuts, for every placement a
  checkpoint meets (Shard of any dim, uneven sizes, a 2-D mesh, Replicate, FSDP2-with-TP's
  _StridedShard), the same local tensor as ``distribute_tensor(..., src_data_rank=None)``.
- ``copy_into``: a full tensor loaded into a DTensor of each placement gives back the full tensor.
- ``empty_shard``: a ShardedTensor whose last rank holds no shard gathers on every rank (the rank
  without a shard takes part with a tensor on the peers' device).
- ``staging``: staged DTensors and ShardedTensors keep their layout (spec, global metadata), hold the
  staging buffers themselves as local data, and gather to the values they were staged from.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", category=FutureWarning)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from lightning_sharded.checkpoint.staging import StagingBuffers  # noqa: E402
from lightning_sharded.tensors import to_full  # noqa: E402
from lightning_sharded.tensors.dtensor import DTensorAdapter, local_part  # noqa: E402
from lightning_sharded.tensors.sharded_tensor import rank_device  # noqa: E402


def cases() -> list[tuple[str, Any, tuple[int, ...], list[Any]]]:
    """(name, mesh, global shape, placements); the meshes are made once, on every rank alike."""
    flat = init_device_mesh("cpu", (4,))
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return [
        ("1d-shard0-even", flat, (8, 3), [Shard(0)]),
        ("1d-shard0-uneven", flat, (7, 3), [Shard(0)]),
        ("1d-shard1-uneven", flat, (2, 5, 3), [Shard(1)]),
        ("1d-shard-neg", flat, (3, 9), [Shard(-1)]),
        ("1d-fewer-rows-than-ranks", flat, (3, 2), [Shard(0)]),
        ("1d-replicate", flat, (5, 2), [Replicate()]),
        ("2d-shard0-shard1", square, (6, 5), [Shard(0), Shard(1)]),
        ("2d-shard0-shard0", square, (9, 2), [Shard(0), Shard(0)]),
        ("2d-replicate-shard1", square, (4, 7), [Replicate(), Shard(1)]),
        ("2d-strided-shard0", square, (8, 4), [_StridedShard(0, split_factor=2), Shard(0)]),
    ]


def check_local_part(record: Any) -> None:
    for name, mesh, shape, placements in cases():
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        expected = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
        got = local_part(full, mesh, placements)
        same = got.shape == expected.shape and torch.equal(got, expected)
        record("local_part", same, f"{name}: {tuple(got.shape)} vs {tuple(expected.shape)}")

        target = distribute_tensor(torch.zeros(shape), mesh, placements, src_data_rank=None)
        DTensorAdapter().copy_into(target, full)
        record("copy_into", torch.equal(target.full_tensor(), full), name)


def sharded_tensor_without_last_shard() -> Any:
    """A (3, 2) ShardedTensor with one row on each of ranks 0-2; rank 3 holds no shard at all."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    rank = dist.get_rank()
    shards = [ShardMetadata([r, 0], [1, 2], f"rank:{r}/cpu") for r in range(3)]
    metadata = ShardedTensorMetadata(shards, torch.Size([3, 2]), TensorProperties(dtype=torch.float32))
    local = (
        [Shard(torch.arange(6.0).reshape(3, 2)[rank : rank + 1].clone(), shards[rank])] if rank < 3 else []
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata)


def check_empty_shard(record: Any) -> None:
    value = sharded_tensor_without_last_shard()
    holds = bool(value.local_shards())
    record("empty_shard", holds == (dist.get_rank() < 3), f"holds a shard: {holds}")
    record("empty_shard", rank_device(value) == torch.device("cpu"), f"device {rank_device(value)}")
    full = to_full(value)
    record("empty_shard", torch.equal(full, torch.arange(6.0).reshape(3, 2)), "gathered value")


def check_staging(record: Any) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    table = distribute_tensor(
        torch.randn(6, 5, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0), Shard(1)]
    )
    legacy = sharded_tensor_without_last_shard()
    state = {"table": table, "legacy": legacy, "step": 3}
    buffers = StagingBuffers()
    for round_ in range(2):
        staged = buffers.stage(state)
        s_table, s_legacy = staged["table"], staged["legacy"]
        record(
            "staging",
            isinstance(s_table, DTensor) and s_table._spec is table._spec,
            f"{round_}: DTensor spec kept",
        )
        record(
            "staging",
            s_table._local_tensor is buffers._buffers[("table",)],
            f"{round_}: the DTensor's local data is the staging buffer itself",
        )
        own = [s.tensor.data_ptr() for s in s_legacy.local_shards()]
        kept = [b.data_ptr() for k, b in buffers._buffers.items() if k[0] == "legacy"]
        record(
            "staging", sorted(own) == sorted(kept), f"{round_}: the ShardedTensor's shards are the buffers"
        )
        record("staging", s_legacy.metadata() == legacy.metadata(), f"{round_}: ShardedTensor metadata kept")
        record(
            "staging", buffers.allocated_bytes == (0 if round_ else buffers.copied_bytes), f"{round_}: reuse"
        )
        record("staging", torch.equal(s_table.full_tensor(), table.full_tensor()), f"{round_}: DTensor value")
        record("staging", torch.equal(to_full(s_legacy), to_full(legacy)), f"{round_}: ShardedTensor value")
        record("staging", staged["step"] == 3, f"{round_}: plain value")


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    records: list[dict[str, Any]] = []

    def record(check: str, ok: bool, detail: str) -> None:
        records.append({"check": check, "rank": rank, "ok": bool(ok), "detail": detail})

    for check in (check_local_part, check_empty_shard, check_staging):
        try:
            check(record)
        except Exception:
            record(check.__name__, False, traceback.format_exc())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if rank == 0:
        (out / "devices.json").write_text(json.dumps([r for rs in gathered for r in rs], indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
