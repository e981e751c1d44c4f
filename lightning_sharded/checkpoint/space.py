"""How many bytes a save needs on its filesystem, and the refusal of one that cannot fit there.

Each rank estimates its share (:func:`sharded_share`), rank 0 compares the sum and its margin
(:func:`required`) with the space free on the target's filesystem once the leftovers of crashed saves
are removed, and refuses a save that does not fit (:func:`refusal`). The estimate, the margin and why
an existing checkpoint needs no room of its own: ``docs/troubleshooting.md``, "Refused before writing".
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from lightning_sharded.checkpoint.errors import StorageError
from lightning_sharded.checkpoint.failures import Space, label
from lightning_sharded.checkpoint.progress import MIB, format_size

__all__ = [
    "BLOCK",
    "ITEM_BYTES",
    "MARGIN_BYTES",
    "MARGIN_FRACTION",
    "full_size",
    "refusal",
    "required",
    "sharded_share",
]

#: Bytes of a save's file format per item (a tensor or a value) besides its data.
ITEM_BYTES = 2048
#: Files take whole blocks (4 KiB on most filesystems): each file of the estimate is rounded up to it.
BLOCK = 4096
#: The margin over the estimate: a fraction of it, plus a fixed amount (the filesystem's own metadata,
#: the manifest, the estimate's error).
MARGIN_FRACTION = 0.02
MARGIN_BYTES = MIB // 4


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict | list | tuple):
        for value in obj.values() if isinstance(obj, dict) else obj:
            yield from _leaves(value)
    else:
        yield obj


def _blocks(n: int) -> int:
    return math.ceil(n / BLOCK) * BLOCK


def _replicas(value: Any) -> int:
    """How many ranks hold the same data as this rank for a sharded ``value`` (DCP writes it once)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        mesh = value.device_mesh
        return math.prod(mesh.size(d) for d, p in enumerate(value.placements) if not p.is_shard())
    import torch.distributed as dist

    group = getattr(value, "_process_group", None)  # a ShardedTensor's shards span its group
    return max(1, dist.get_world_size() // dist.get_world_size(group)) if dist.is_initialized() else 1


def sharded_share(state: Any, world_size: int, own_files: list[int]) -> int:
    """This rank's estimated bytes of a sharded save: its share of DCP's files for ``state`` (this
    rank's state dict) in a world of ``world_size`` ranks, plus the files of ``own_files`` (sizes)."""
    import torch
    from torch.distributed.tensor import DTensor

    share = 0.0
    for leaf in _leaves(state):
        if isinstance(leaf, DTensor):
            local = leaf.to_local()
            share += (local.numel() * local.element_size() + ITEM_BYTES) / _replicas(leaf)
        elif isinstance(leaf, torch.Tensor) and type(leaf).__name__ == "ShardedTensor":
            shards = leaf.local_shards()  # type: ignore[attr-defined]
            local_bytes = sum(s.tensor.numel() * s.tensor.element_size() for s in shards)
            share += (local_bytes + ITEM_BYTES * len(shards)) / _replicas(leaf)
        elif isinstance(leaf, torch.Tensor):
            share += (leaf.numel() * leaf.element_size() + ITEM_BYTES) / world_size
        else:
            share += ITEM_BYTES / world_size
    # its shard file and .metadata's share, in whole blocks; then its own files
    return _blocks(math.ceil(share)) + BLOCK + sum(_blocks(n) for n in own_files)


def full_size(checkpoint: Any) -> int:
    """The estimated size of ``torch.save(checkpoint)``: every distinct storage once, plus the format."""
    import torch

    storages: dict[tuple[str, int], int] = {}
    items = 0
    for leaf in _leaves(checkpoint):
        items += 1
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
            storage = leaf.untyped_storage()
            storages[(str(leaf.device), storage.data_ptr())] = storage.nbytes()
    return _blocks(sum(storages.values()) + items * ITEM_BYTES // 4 + 64 * 1024)


def required(needed: int) -> int:
    """The free bytes a save of ``needed`` bytes asks for: the estimate and its margin."""
    return math.ceil(needed * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


def refusal(target: object, space: Space, needs: list[int], place: str = "path") -> StorageError | None:
    """The error of a save that does not fit (``space.free`` below :func:`required`), else ``None``;
    ``needs``: every rank's estimate, in rank order (their sum is ``space.needed``)."""
    import errno

    if space.free is None or space.free >= required(space.needed):
        return None
    per_rank = (
        f"{len(needs)} ranks' estimates, {format_size(max(needs))} at most each"
        if len(needs) > 1
        else "its estimate"
    )
    return StorageError(
        f"{label(errno.ENOSPC)} for the checkpoint {str(target)!r}, refused before writing: this save needs"
        f" about {format_size(space.needed)} ({per_rank}; with the margin of {MARGIN_FRACTION:.0%} and"
        f" {format_size(MARGIN_BYTES)}, {format_size(required(space.needed))}), and the filesystem of"
        f" {space.where!r} has {format_size(space.free)} free (statvfs). Nothing was written; the previous"
        f" checkpoint at that {place}, if any, is unchanged. Free space there (keep fewer checkpoints:"
        " `ModelCheckpoint(save_top_k=...)`), or save to another filesystem; if the estimate is wrong, turn"
        " the check off with the strategy's `check_space=False`.",
        errno.ENOSPC,
        space.where,
    )
