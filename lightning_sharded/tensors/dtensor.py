"""Adapter for :class:`torch.distributed.tensor.DTensor`."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_sharded._compat import strided_shard
from lightning_sharded.tensors.base import to_full

_StridedShard: Any = strided_shard()


class DTensorAdapter:
    """Answers the :class:`~lightning_sharded.tensors.base.ShardedAdapter` questions for ``DTensor``."""

    def is_sharded(self, value: Any) -> bool:
        return isinstance(value, DTensor)

    def global_shape(self, value: Any) -> torch.Size:
        return value.shape  # type: ignore[no-any-return]

    def dtype(self, value: Any) -> torch.dtype:
        return value.dtype  # type: ignore[no-any-return]

    def detach(self, value: Any) -> Any:
        # Without grad there is no history to drop, and DTensor.detach() costs a dispatch (~15 us).
        return value.detach() if value.requires_grad else value

    def copy_into(self, target: Any, source: Any) -> None:
        if any(isinstance(p, Partial) for p in target.placements):
            raise ValueError(
                f"Cannot load into a DTensor with a Partial placement {tuple(target.placements)}: its"
                " value is a pending reduction. Redistribute it to Shard or Replicate before loading."
            )
        local = target.to_local()
        with torch.no_grad():
            if isinstance(source, DTensor) and source.device_mesh == target.device_mesh:
                same = tuple(source.placements) == tuple(target.placements)
                if same and source.to_local().shape == local.shape:
                    local.copy_(source.to_local())
                else:  # same ranks, another placement: let DTensor move only what each rank needs
                    local.copy_(source.redistribute(target.device_mesh, target.placements).to_local())
                return
            # Every rank holds the same global value: cut this rank's part where the value is (a
            # full file's tensors are on CPU), then copy only that part to the device.
            full = to_full(source).detach()
            local.copy_(local_part(full, target.device_mesh, target.placements))

    def to_full(self, value: Any) -> torch.Tensor:
        return value.full_tensor()  # type: ignore[no-any-return]

    def local_tensors(self, value: Any) -> list[torch.Tensor]:
        return [value._local_tensor]

    def views_like(self, value: Any, pieces: list[torch.Tensor], dtype: torch.dtype) -> Any:
        (piece,) = pieces
        return DTensor.from_local(
            piece,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )

    def groups(self, value: Any) -> list[Any]:
        mesh = value.device_mesh
        # Reducing along each mesh dimension in turn reaches the whole mesh.
        return [mesh.get_group(dim) for dim in range(mesh.ndim) if mesh.size(dim) > 1]


def local_part(full: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    """This rank's local tensor of ``full`` under ``mesh`` and ``placements``, cut where ``full`` is.

    What ``distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()`` returns, without
    its first step, which moves the whole of ``full`` to the mesh's device: a large full tensor read
    from a file would take the device memory of the whole tensor on every rank, for a moment. The
    same local split as torch's (``torch/distributed/tensor/_api.py``, ``distribute_tensor``: Shard and
    _StridedShard cut one mesh dimension after the other; Replicate keeps the value); no communication.
    """
    part = full
    for index, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            dim = placement.dim % full.ndim
            part = _StridedShard._make_shard_tensor(
                dim, part, mesh, index, None, split_factor=placement.split_factor
            )
        elif isinstance(placement, Shard):
            part = Shard._make_shard_tensor(placement.dim % full.ndim, part, mesh, index, None)
        elif not isinstance(placement, Replicate):
            raise ValueError(f"Cannot cut a full tensor for the placement {placement!r}")
    return part
