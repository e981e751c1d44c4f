"""Adapter for :class:`torch.distributed.tensor.DTensor`."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, distribute_tensor

from lightning_sharded.tensors.base import full_if_sharded


class DTensorAdapter:
    """Answers the :class:`~lightning_sharded.tensors.base.ShardedAdapter` questions for ``DTensor``."""

    name = "DTensor"

    def types(self) -> tuple[type, ...]:
        return (DTensor,)

    def is_sharded(self, value: Any) -> bool:
        return isinstance(value, DTensor)

    def global_shape(self, value: Any) -> torch.Size:
        return value.shape  # type: ignore[no-any-return]

    def dtype(self, value: Any) -> torch.dtype:
        return value.dtype  # type: ignore[no-any-return]

    def detach(self, value: Any) -> Any:
        # Without grad there is no history to drop, and DTensor.detach() costs a dispatch (~15 us).
        return value.detach() if value.requires_grad else value

    def same_layout(self, target: Any, source: Any) -> bool:
        return (
            isinstance(source, DTensor)
            and source.device_mesh == target.device_mesh
            and tuple(source.placements) == tuple(target.placements)
            and source.to_local().shape == target.to_local().shape
        )

    def copy_into(self, target: Any, source: Any) -> None:
        if any(isinstance(p, Partial) for p in target.placements):
            raise ValueError(
                f"Cannot load into a DTensor with a Partial placement {tuple(target.placements)}: its"
                " value is a pending reduction. Redistribute it to Shard or Replicate before loading."
            )
        local = target.to_local()
        with torch.no_grad():
            if self.same_layout(target, source):
                local.copy_(source.to_local())
                return
            if isinstance(source, DTensor) and source.device_mesh == target.device_mesh:
                # Same ranks, another placement: let DTensor move only what each rank needs.
                local.copy_(source.redistribute(target.device_mesh, target.placements).to_local())
                return
            source = full_if_sharded(source)
            full = source.detach().to(device=local.device)
            # Every rank holds the same global value: cut this rank's part locally, no communication.
            part = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            local.copy_(part.to_local())

    def to_full(self, value: Any) -> torch.Tensor:
        return value.full_tensor()  # type: ignore[no-any-return]

    def groups(self, value: Any) -> list[Any]:
        mesh = value.device_mesh
        # Reducing along each mesh dimension in turn reaches the whole mesh.
        return [mesh.get_group(dim) for dim in range(mesh.ndim) if mesh.size(dim) > 1]
