"""Host copies of a state dict's tensors, in CPU buffers reused from one stage to the next.

:class:`StagingBuffers` serves a background save (:mod:`~lightning_sharded.checkpoint.async_save`: the
state copied into host memory before the write, the same buffers every save while the shapes stay) and
a load that checks before it changes the model (``verify=True``: the values are read into twins of the
model's tensors laid out as its shards, and copied in once the checksums matched). Torch only.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["StagingBuffers"]


class StagingBuffers:
    """CPU copies of a state dict's tensors, in buffers reused from one :meth:`stage` to the next.

    A buffer is kept per position in the state (the path of keys and list indices that leads to the
    tensor) and reused while its shape and dtype stay the same; buffers of positions a stage no
    longer has are dropped. The buffer of a CUDA tensor is pinned (page-locked), so the copy runs as a
    device-to-host DMA; the copies of one :meth:`stage` are issued without blocking and waited for
    once at its end.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        # The staged ShardedTensor of each position: (its source, the staged one), reused while the source
        # is the same object over the same buffers (FSDP1's views are made once: see fsdp1.layout).
        self._sharded: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self._used: set[tuple[Any, ...]] = set()
        self._devices: set[torch.device] = set()
        self._copy = True
        self._defer: tuple[tuple[Any, ...], ...] = ()
        #: ``(buffer, source)`` of the host copies the last :meth:`stage` deferred (see ``defer``).
        self.deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: Bytes the last :meth:`stage` copied itself, how many bytes it put into new buffers, and how
        #: many it left to :meth:`copy_deferred`.
        self.copied_bytes = 0
        self.allocated_bytes = 0
        self.deferred_bytes = 0

    @torch.no_grad()
    def stage(self, state: Any, *, copy: bool = True, defer: Sequence[tuple[Any, ...]] = ()) -> Any:
        """A copy of ``state`` whose tensors live in this object's CPU buffers; the structure is rebuilt.

        With ``copy=False`` the buffers are laid out as ``state``'s tensors but not filled (a load's
        place to read into before the values may reach the model). ``defer``: key paths (the keys and
        indices that lead into ``state``) whose host tensors are not copied now; their
        ``(buffer, source)`` pairs are left in :attr:`deferred` for :meth:`copy_deferred` (the staged
        structure already holds the buffers). Device tensors are always copied now.

        ``DTensor`` and ``ShardedTensor`` values stay sharded like the original: a ``DTensor`` keeps its
        spec (mesh, placements, global shape) with the CPU buffer as its local tensor, as torch's own
        staging does (``torch/distributed/_state_dict_utils.py``, ``_create_cpu_state_dict``), so no
        device memory is taken; a ``ShardedTensor`` keeps its global metadata with the placements moved
        to CPU, as ``ShardedTensor.cpu()`` does. Values other than tensors, dicts, lists and tuples are
        deep-copied. Returns once every copy is complete.
        """
        self._used = set()
        self._devices = set()
        self._copy = copy
        self._defer = tuple(tuple(prefix) for prefix in defer)
        self.deferred = []
        self.copied_bytes = self.allocated_bytes = self.deferred_bytes = 0
        staged = self._stage(state, ())
        for device in self._devices:  # the non-blocking device-to-host copies
            torch.cuda.synchronize(device)
        for stale in set(self._buffers) - self._used:
            del self._buffers[stale]
        self._sharded = {key: made for key, made in self._sharded.items() if (*key, "shard", 0) in self._used}
        return staged

    def _buffer(self, key: tuple[Any, ...], source: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        pin = source.is_cuda
        # A pinned buffer serves a CPU source as well; only a CUDA source needs one (asked only then).
        if (
            buffer is None
            or buffer.shape != source.shape
            or buffer.dtype != source.dtype
            or (pin and not buffer.is_pinned())
        ):
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buffer
            self.allocated_bytes += buffer.numel() * buffer.element_size()
        self._used.add(key)
        if not self._copy:
            return buffer
        if pin:
            buffer.copy_(source, non_blocking=True)
            self._devices.add(source.device)
        elif any(key[: len(prefix)] == prefix for prefix in self._defer):
            self.deferred.append((buffer, source))
            self.deferred_bytes += buffer.numel() * buffer.element_size()
            return buffer
        else:
            buffer.copy_(source)
        self.copied_bytes += buffer.numel() * buffer.element_size()
        return buffer

    @torch.no_grad()
    def copy_deferred(self) -> None:
        """Make the copies the last :meth:`stage` deferred (any thread; the sources must not change)."""
        deferred, self.deferred = self.deferred, []
        for buffer, source in deferred:
            buffer.copy_(source)

    def _stage(self, obj: Any, key: tuple[Any, ...]) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            # Not DTensor.from_local: for a CUDA mesh it moves the local tensor back to the device.
            return DTensor(self._buffer(key, obj._local_tensor), obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor) and type(obj).__name__ == "ShardedTensor":
            return self._stage_sharded_tensor(obj, key)
        if isinstance(obj, torch.Tensor):
            return self._buffer(key, obj.detach())
        if isinstance(obj, dict):
            return {k: self._stage(v, (*key, k)) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            items = [self._stage(v, (*key, i)) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else type(obj)(items)
        return copy.deepcopy(obj)

    def _stage_sharded_tensor(self, obj: Any, key: tuple[Any, ...]) -> Any:
        from lightning_sharded._compat import sharded_tensor_api

        ShardedTensor, Shard = sharded_tensor_api()[:2]

        # torch checks each local shard's device against its placement: the copies are on CPU, so
        # every placement says CPU (what ShardedTensor.cpu() does); offsets, sizes and ranks stay.
        buffers = [
            self._buffer((*key, "shard", i), shard.tensor) for i, shard in enumerate(obj.local_shards())
        ]
        source, staged = self._sharded.get(key, (None, None))
        if source is obj and [id(b) for b in buffers] == [id(s.tensor) for s in staged.local_shards()]:
            return staged
        metadata = _on_cpu(obj.metadata())
        shards = [
            Shard(buffer, _on_cpu(shard.metadata))
            for buffer, shard in zip(buffers, obj.local_shards(), strict=True)
        ]
        staged = ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, metadata, process_group=obj._process_group
        )
        self._sharded[key] = (obj, staged)
        return staged


def _on_cpu(metadata: Any) -> Any:
    """A ``ShardedTensorMetadata`` or ``ShardMetadata`` whose placements name the CPU of the same ranks:
    ``metadata`` itself when they already do, else a copy."""
    shards = getattr(metadata, "shards_metadata", [metadata])
    if all(m.placement is None or m.placement.device().type == "cpu" for m in shards):
        return metadata
    metadata = copy.deepcopy(metadata)
    for m in getattr(metadata, "shards_metadata", [metadata]):
        if m.placement is not None:
            m.placement._device = torch.device("cpu")
    return metadata
