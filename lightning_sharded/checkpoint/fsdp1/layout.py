"""Where each original parameter of an FSDP1 flat parameter lives on every rank, as boxes and
``ShardedTensor`` views; which models the views serve (see :mod:`lightning_sharded.checkpoint.fsdp1`)."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_sharded.checkpoint.flat_ranges import Box, boxes
from lightning_sharded.tensors.sharded_tensor import ShardedTensorAdapter, from_local_shards

__all__ = [
    "HOOK_NAMES",
    "TORCH_NAMES",
    "ParamLayout",
    "copy_into_shard",
    "layouts",
    "param_index",
    "param_tensor",
    "sharded_tensor",
    "supported",
]


@dataclass(frozen=True)
class ParamLayout:
    """Where one original parameter of a flat parameter lives on every rank of its group."""

    shape: tuple[int, ...]
    #: This rank's piece: (offset in the local flat shard, numel, first intra-parameter index).
    local: tuple[int, int, int] | None
    #: Every rank's boxes (group rank order), with flat starts relative to the parameter.
    per_rank: tuple[tuple[Box, ...], ...]


_LAYOUTS: weakref.WeakKeyDictionary[Any, list[ParamLayout]] = weakref.WeakKeyDictionary()


def layouts(handle: Any) -> list[ParamLayout]:
    """Each original parameter's layout in ``handle`` (an FSDP1 ``FlatParamHandle``), computed once."""
    flat = handle.flat_param
    cached = _LAYOUTS.get(handle)
    if cached is not None:
        return cached
    shard_numel = flat._sharded_size.numel()
    ranges = [
        handle._get_shard_metadata(shard_numel * r, shard_numel * (r + 1) - 1)
        for r in range(handle.world_size)
    ]
    layouts = []
    for index, (size, info) in enumerate(zip(flat._shapes, flat._shard_param_infos, strict=True)):
        shape = tuple(size)
        per_rank = tuple(
            tuple(boxes(p.intra_param_start_idx, p.intra_param_end_idx + 1, shape)) if p.in_shard else ()
            for p in (rank_infos[index] for rank_infos in ranges)
        )
        local = (
            (info.offset_in_shard, info.numel_in_shard, info.intra_param_start_idx) if info.in_shard else None
        )
        layouts.append(ParamLayout(shape, local, per_rank))
    _LAYOUTS[handle] = layouts
    return layouts


#: torch's ``SHARDED_STATE_DICT`` hooks that :func:`views` replaces: pre and post save, pre and post load.
HOOK_NAMES = (
    "_sharded_pre_state_dict_hook",
    "_sharded_post_state_dict_hook",
    "_sharded_pre_load_state_dict_hook",
    "_sharded_post_load_state_dict_hook",
)
#: What :func:`views` uses of torch's private FSDP1 hook module; without any of them, torch's path runs.
TORCH_NAMES = (
    "_common_pre_state_dict_hook",
    "_common_unshard_post_state_dict_hook",
    "_should_unshard_params",
    "_replace_by_prefix",
    "_has_fsdp_params",
    "_module_handle",
    "_param_name_infos",
    "_lazy_init",
    *HOOK_NAMES,
)


def supported(model: nn.Module) -> bool:
    """Whether every FSDP1 unit of ``model`` can use the views (:mod:`~lightning_sharded.checkpoint.fsdp1`);
    depends on the model's configuration only, the same on every rank."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    from lightning_sharded._compat import fsdp1_state_dict_utils

    try:
        sdu = fsdp1_state_dict_utils()  # torch's private hook module: the names views() uses checked
    except ImportError:
        return False
    if not all(hasattr(sdu, name) for name in TORCH_NAMES):
        return False
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    if not units:
        return False
    for unit in units:
        if not getattr(unit, "_use_orig_params", False) or getattr(unit, "_device_mesh", None) is not None:
            return False
        if unit.sharding_strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            return False
        if unit._state_dict_config.offload_to_cpu:
            return False
        handle = unit._handle
        if handle is None:
            continue
        flat = handle.flat_param
        if flat._shared_params or not hasattr(flat, "_shard_param_infos") or flat.dim() != 1:
            return False
    return True


def _placement(group: Any, rank: int, device: torch.device) -> str:
    global_rank = dist.get_global_rank(group, rank) if dist.is_initialized() else rank
    if device.type == "cpu":
        return f"rank:{global_rank}/cpu"
    count = getattr(torch, device.type).device_count()
    return f"rank:{global_rank}/{device.type}:{global_rank % max(count, 1)}"


def _own_storage(flat: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    """``flat[start:start+numel]`` as a tensor with a storage of its own size over the same memory.

    DCP's writer clones any tensor whose storage is larger than itself (``torch.save`` writes whole
    storages); a tensor made over just these bytes is written as it is, and loads land in ``flat``.
    """
    view = flat[start : start + numel]
    if view.device.type != "cpu" or numel == 0:
        return view
    size = view.element_size()
    raw = flat.detach().view(torch.uint8).numpy()
    piece: Any = raw[start * size : (start + numel) * size]
    return torch.frombuffer(memoryview(piece), dtype=flat.dtype)


def sharded_tensor(local: torch.Tensor, layout: ParamLayout, group: Any, rank: int) -> Any:
    """A ``ShardedTensor`` of the parameter's global shape whose local shards are views of ``local``, the
    rank's flat piece of the parameter (or of a state of the same shape)."""
    from lightning_sharded._compat import sharded_tensor_api

    _, Shard, ShardMetadata, _, _ = sharded_tensor_api()

    device = local.device
    shards_metadata = []
    local_shards = []
    first = layout.local[2] if layout.local is not None else 0
    for r, rank_boxes in enumerate(layout.per_rank):
        placement = _placement(group, r, device)
        for offsets, sizes, flat_start in rank_boxes:
            meta = ShardMetadata(list(offsets), list(sizes), placement)
            shards_metadata.append(meta)
            if r == rank:
                numel = math.prod(sizes)
                piece = _own_storage(local, flat_start - first, numel).view(sizes)
                local_shards.append(Shard(piece, meta))
    return from_local_shards(local_shards, shards_metadata, layout.shape, local.dtype, group)


#: Each handle's parameter views already made: index -> (where its memory is, the ``ShardedTensor``).
_PARAM_VIEWS: weakref.WeakKeyDictionary[Any, dict[int, tuple[tuple[int, int], Any]]] = (
    weakref.WeakKeyDictionary()
)
#: Views of optimizer state tensors already made, keyed by the state tensor (by identity: a tensor's
#: ``==`` is elementwise), dropped with it: (where its memory is, layout, ``ShardedTensor``).
_STATE_VIEWS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def param_tensor(handle: Any, index: int) -> Any:
    """The ``ShardedTensor`` of views of original parameter ``index`` of ``handle``'s flat shard.

    Made once per memory: a save's state dict asks for it each time (building one takes about 0.2 ms of
    Python, 16 of them 3-6 ms of an FSDP1 async save's stall); the views hold the memory they view, so
    the same address means the same memory."""
    layout = layouts(handle)[index]
    offset, numel, _ = layout.local or (0, 0, 0)
    local = handle.flat_param.detach()[offset : offset + numel]
    where = (local.data_ptr(), local.numel())
    made = _PARAM_VIEWS.setdefault(handle, {})
    known = made.get(index)
    if known is None or known[0] != where:
        known = made[index] = (where, sharded_tensor(local, layout, handle.process_group, handle.rank))
    return known[1]


def state_tensor(value: torch.Tensor, layout: ParamLayout, group: Any, rank: int) -> Any:
    """:func:`sharded_tensor` of an optimizer state tensor (the piece of a parameter), made once per
    tensor, memory and layout (see :func:`param_tensor`)."""
    where = (value.data_ptr(), value.numel())
    known = _STATE_VIEWS.get(value)
    if known is None or known[0] != where or known[1] is not layout:
        known = _STATE_VIEWS[value] = (where, layout, sharded_tensor(value.detach(), layout, group, rank))
    return known[2]


def copy_into_shard(target: Any, value: Any) -> None:
    """Put ``value`` (a sharded or full tensor) into ``target``'s views, unless it already is them."""
    if type(value) is type(target):  # the pointers first: the metadata compares every rank's shards
        mine = [shard.tensor.data_ptr() for shard in target.local_shards()]
        theirs = [shard.tensor.data_ptr() for shard in value.local_shards()]
        if mine == theirs and target.metadata() == value.metadata():
            return  # read in place already (the sharded load reads into these very views)
    ShardedTensorAdapter().copy_into(target, value)


def param_index(model: nn.Module) -> dict[int, tuple[Any, int]]:
    """``id(original parameter) -> (handle, index)`` for every FSDP1 unit of ``model``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    handles: list[Any] = [m._handle for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    return {id(p): (h, i) for h in handles if h is not None for i, p in enumerate(h.flat_param._params)}
