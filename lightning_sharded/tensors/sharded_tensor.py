"""Adapter for the legacy ``torch.distributed._shard.sharded_tensor.ShardedTensor``.

The module is imported lazily: importing it emits a deprecation ``FutureWarning`` and a future torch may
remove it. A ``ShardedTensor`` cannot exist before its module was imported, so until then this adapter
reports no types and matches nothing, without importing anything.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from lightning_sharded._compat import SHARDED_TENSOR_MODULE, sharded_tensor_api
from lightning_sharded.tensors.base import to_full


class ShardedTensorAdapter:
    """Answers the :class:`~lightning_sharded.tensors.base.ShardedAdapter` questions for ``ShardedTensor``."""

    def is_sharded(self, value: Any) -> bool:
        cls = getattr(sys.modules.get(SHARDED_TENSOR_MODULE), "ShardedTensor", None)
        return cls is not None and isinstance(value, cls)

    def global_shape(self, value: Any) -> torch.Size:
        return value.size()  # type: ignore[no-any-return]

    def dtype(self, value: Any) -> torch.dtype:
        return value.metadata().tensor_properties.dtype  # type: ignore[no-any-return]

    def detach(self, value: Any) -> Any:
        # ShardedTensor has no autograd support, so there is no history to drop; torch's own
        # state-dict hook stores it as it is.
        return value

    def copy_into(self, target: Any, source: Any) -> None:
        with torch.no_grad():
            if self.is_sharded(source) and _layout(target) == _layout(source):
                for dst, src in zip(target.local_shards(), source.local_shards(), strict=True):
                    dst.tensor.copy_(src.tensor)
                return
            source = to_full(source)
            for shard in target.local_shards():
                index = _index(shard.metadata)
                shard.tensor.copy_(source[index].to(device=shard.tensor.device))

    def local_tensors(self, value: Any) -> list[torch.Tensor]:
        return [shard.tensor for shard in value.local_shards()]

    def to_full(self, value: Any) -> torch.Tensor:
        meta = value.metadata()
        full = torch.zeros(value.size(), dtype=meta.tensor_properties.dtype, device=rank_device(value))
        for shard in value.local_shards():
            full[_index(shard.metadata)] = shard.tensor
        group = value._process_group
        if dist.is_initialized() and dist.get_world_size(group) > 1 and full.numel() > 0:
            # Chunk shards never overlap: every byte is written by exactly one rank and is zero
            # elsewhere, so a byte-wise sum is exact for every dtype (gloo has no bf16 sum).
            flat = full.reshape(-1).view(torch.uint8)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        return full

    def views_like(self, value: Any, pieces: list[torch.Tensor], dtype: torch.dtype) -> Any:
        Shard = sharded_tensor_api()[1]
        shards = [
            Shard(piece, shard.metadata) for piece, shard in zip(pieces, value.local_shards(), strict=True)
        ]
        meta = value.metadata()
        return from_local_shards(shards, meta.shards_metadata, meta.size, dtype, value._process_group)

    def groups(self, value: Any) -> list[Any]:
        group = value._process_group
        if not dist.is_initialized() or dist.get_world_size(group) <= 1:
            return []
        return [group]


def from_local_shards(
    shards: list[Any], shards_metadata: Any, size: Any, dtype: torch.dtype, group: Any
) -> Any:
    """A ``ShardedTensor`` of ``size`` and ``dtype`` laid out as ``shards_metadata`` (every rank's) with
    this rank's ``shards``; no communication (each rank knows the whole layout)."""
    ShardedTensor, _, _, ShardedTensorMetadata, TensorProperties = sharded_tensor_api()
    properties = TensorProperties(
        dtype=dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    metadata = ShardedTensorMetadata(list(shards_metadata), torch.Size(size), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata, process_group=group)


def rank_device(value: Any) -> torch.device:
    """The device of this rank's part of the ``ShardedTensor`` ``value``, also on a rank with no shard.

    A rank without a local shard still takes part in the gathers, with a tensor on the device its
    peers use (NCCL refuses a CPU tensor on that rank alone): the placements' accelerator, this
    process's current device of that type; CPU when every placement is on CPU.
    """
    shards = value.local_shards()
    if shards:
        return shards[0].tensor.device  # type: ignore[no-any-return]
    kinds = {m.placement.device().type for m in value.metadata().shards_metadata if m.placement is not None}
    accelerators = sorted(kinds - {"cpu"})
    if accelerators:
        return torch.device(accelerators[0], torch.accelerator.current_device_index())
    return torch.device("cpu")


def _index(shard_metadata: Any) -> tuple[slice, ...]:
    return tuple(
        slice(offset, offset + size)
        for offset, size in zip(shard_metadata.shard_offsets, shard_metadata.shard_sizes, strict=True)
    )


def _layout(value: Any) -> list[tuple[tuple[int, ...], tuple[int, ...], int | None]]:
    """Each shard's offsets, sizes and the rank that holds it: where the values are, whatever the
    device (a CPU copy of a CUDA ``ShardedTensor`` has its layout, and copies shard by shard)."""
    return [
        (tuple(m.shard_offsets), tuple(m.shard_sizes), m.placement.rank() if m.placement else None)
        for m in value.metadata().shards_metadata
    ]
