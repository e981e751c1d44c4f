"""FSDP1's sharded state dicts without communication: views of the local flat shard, not gathered chunks.

For ``SHARDED_STATE_DICT`` torch's ``FullyShardedDataParallel`` all-gathers every flat parameter
(``model.state_dict()``: unshard, then clone each rank's dim-0 chunk into a ``ShardedTensor``) and every
optimizer state (``FSDP.optim_state_dict``: all-gather, then re-chunk), and loading reverses both with
further all-gathers. On a 2 GB model plus Adam that was most of a save and of a resume.

With ``use_orig_params=True`` (Lightning's default), each rank already holds, for every original
parameter, a contiguous piece of its flattened values (``FlatParameter._shard_param_infos``) and the
optimizer state of that piece. A contiguous range of a row-major tensor is a union of at most
``2 * ndim - 1`` boxes (a partial first row, full rows, a partial last row, recursively), so it is a
``ShardedTensor`` with several local shards, each a view of the local memory. Every rank computes every
other rank's boxes from the flat parameter's layout, so the ``ShardedTensor``'s global metadata needs no
collective. DCP writes those boxes as chunks (a checkpoint with the same keys, global shapes and dtypes
as torch's path: only the chunk boundaries differ, which every DCP reader reslices), and loads into
them in place: the bytes land in the flat parameter and in the optimizer state directly.

Used by :mod:`~lightning_sharded.checkpoint.state_dicts` and the sharded load when :func:`supported`
says the model fits (every FSDP unit ``FULL_SHARD`` or ``SHARD_GRAD_OP``, ``use_orig_params=True``, no
shared parameters, no device mesh); anything else takes torch's path.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_sharded._fqn import parameter_names
from lightning_sharded.tensors import adapter_for

__all__ = [
    "boxes",
    "load_optimizer_state",
    "optimizer_state_dict",
    "optimizer_template",
    "supported",
    "views",
]

STATE = "state"
PARAM_GROUPS = "param_groups"
PARAMS = "params"

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, flat start)


def boxes(start: int, stop: int, shape: Sequence[int]) -> list[Box]:
    """The flat range ``[start, stop)`` of a row-major tensor of ``shape`` as boxes, in flat order.

    Each box is ``(offsets, sizes, flat start)`` and covers a contiguous flat range; together they cover
    the range exactly once. A scalar (``shape == ()``) is one box when the range holds its element.
    """
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [((), (), start)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first_full = -(-start // inner)  # first row that starts inside the range
    last_full = stop // inner  # rows [first_full, last_full) are whole
    if first_full > last_full:  # inside one row
        row = start // inner
        return [
            ((row, *o), (1, *s), row * inner + f)
            for o, s, f in boxes(start - row * inner, stop - row * inner, shape[1:])
        ]
    out: list[Box] = []
    if start < first_full * inner:
        row = first_full - 1
        out += [
            ((row, *o), (1, *s), row * inner + f) for o, s, f in boxes(start - row * inner, inner, shape[1:])
        ]
    if first_full < last_full:
        out.append(
            ((first_full, *(0,) * (len(shape) - 1)), (last_full - first_full, *shape[1:]), first_full * inner)
        )
    if last_full * inner < stop:
        out += [
            ((last_full, *o), (1, *s), last_full * inner + f)
            for o, s, f in boxes(0, stop - last_full * inner, shape[1:])
        ]
    return out


@dataclass(frozen=True)
class _ParamLayout:
    """Where one original parameter of a flat parameter lives on every rank of its group."""

    shape: tuple[int, ...]
    #: This rank's piece: (offset in the local flat shard, numel, first intra-parameter index).
    local: tuple[int, int, int] | None
    #: Every rank's boxes (group rank order), with flat starts relative to the parameter.
    per_rank: tuple[tuple[Box, ...], ...]


_LAYOUTS: weakref.WeakKeyDictionary[Any, list[_ParamLayout]] = weakref.WeakKeyDictionary()


def _layouts(handle: Any) -> list[_ParamLayout]:
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
    for index, (shape, info) in enumerate(zip(flat._shapes, flat._shard_param_infos, strict=True)):
        shape = tuple(shape)
        per_rank = []
        for rank_infos in ranges:
            piece = rank_infos[index]
            if piece.in_shard:
                per_rank.append(
                    tuple(boxes(piece.intra_param_start_idx, piece.intra_param_end_idx + 1, shape))
                )
            else:
                per_rank.append(())
        local = (
            (info.offset_in_shard, info.numel_in_shard, info.intra_param_start_idx) if info.in_shard else None
        )
        layouts.append(_ParamLayout(shape, local, tuple(per_rank)))
    _LAYOUTS[handle] = layouts
    return layouts


#: What :func:`views` uses of torch's private FSDP1 hook module; without any of them, torch's path runs.
_TORCH_NAMES = (
    "_common_pre_state_dict_hook",
    "_common_unshard_post_state_dict_hook",
    "_should_unshard_params",
    "_replace_by_prefix",
    "_has_fsdp_params",
    "_module_handle",
    "_param_name_infos",
    "_lazy_init",
    "_sharded_pre_state_dict_hook",
    "_sharded_post_state_dict_hook",
    "_sharded_pre_load_state_dict_hook",
    "_sharded_post_load_state_dict_hook",
)


def _torch_hooks() -> Any:
    """torch's FSDP1 state-dict hook module (private: its names are checked by :func:`supported`)."""
    import importlib

    return importlib.import_module("torch.distributed.fsdp._state_dict_utils")


def _handles(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [
        module._handle
        for module in model.modules()
        if isinstance(module, FullyShardedDataParallel) and module._handle is not None
    ]


def supported(model: nn.Module) -> bool:
    """Whether every FSDP1 unit of ``model`` can use the views (see the module docstring).

    Depends on the model's configuration only, the same on every rank.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    try:
        sdu = _torch_hooks()
    except ImportError:
        return False
    if not all(hasattr(sdu, name) for name in _TORCH_NAMES):
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


def _sharded_tensor(local: torch.Tensor, layout: _ParamLayout, group: Any, rank: int) -> Any:
    """A ``ShardedTensor`` of the parameter's global shape whose local shards are views of ``local``.

    ``local`` is the rank's flat piece of the parameter (or of a state of the same shape).
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharded_tensor.shard import Shard

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
    properties = TensorProperties(
        dtype=local.dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    metadata = ShardedTensorMetadata(shards_metadata, torch.Size(layout.shape), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, metadata, process_group=group
    )


def _param_tensor(handle: Any, index: int) -> Any:
    layout = _layouts(handle)[index]
    flat = handle.flat_param.detach()
    if layout.local is None:
        local = flat[:0]
    else:
        offset, numel, _ = layout.local
        local = flat[offset : offset + numel]
    return _sharded_tensor(local, layout, handle.process_group, handle.rank)


def _copy_into_shard(target: Any, value: Any) -> None:
    """Put ``value`` (a sharded or full tensor) into ``target``'s views, unless it already is them."""
    mine = [shard.tensor.data_ptr() for shard in target.local_shards()]
    adapter = adapter_for(value)
    if adapter is not None and type(value) is type(target):
        theirs = [shard.tensor.data_ptr() for shard in value.local_shards()]
        if mine == theirs and target.metadata() == value.metadata():
            return  # read in place already (the sharded load reads into these very views)
    adapter_of_target = adapter_for(target)
    assert adapter_of_target is not None
    adapter_of_target.copy_into(target, value)


@contextlib.contextmanager
def views() -> Iterator[None]:
    """Inside the block, FSDP1's ``SHARDED_STATE_DICT`` hooks neither gather nor scatter.

    ``model.state_dict()`` gives each parameter as a ``ShardedTensor`` of views of the local flat shard
    (no communication, no copy); ``model.load_state_dict()`` copies each parameter's value (sharded in
    any layout, or full) into those views, skipping a value that is those very views (what the
    sharded load read into), and loads the rest (buffers, sharded attributes, extra state) as usual.
    Only for models :func:`supported` accepts.
    """
    sdu = _torch_hooks()
    from torch.distributed.fsdp._common_utils import FSDP_PREFIX
    from torch.distributed.fsdp._unshard_param_utils import FLAT_PARAM

    def pre_save(fsdp_state: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        sdu._common_pre_state_dict_hook(module, fsdp_state)
        if sdu._should_unshard_params(fsdp_state):
            # torch's post hook leaves this context; nothing was gathered, so there is nothing to undo.
            fsdp_state._unshard_params_ctx[module] = contextlib.nullcontext()

    def post_save(
        module: nn.Module, fsdp_state: Any, state_dict: dict[str, Any], prefix: str
    ) -> dict[str, Any]:
        if not sdu._has_fsdp_params(fsdp_state, module):
            done: dict[str, Any] = sdu._common_unshard_post_state_dict_hook(
                module, fsdp_state, state_dict, prefix, None
            )
            return done
        handle = sdu._module_handle(fsdp_state, module)
        index = {fqn: i for i, (fqn, _, _) in enumerate(sdu._param_name_infos(module, fsdp_state))}

        def param_hook(state_dict: dict[str, Any], prefix: str, fqn: str) -> None:
            state_dict[fqn] = _param_tensor(handle, index[fqn[len(prefix) :]])

        # torch's own post hook (prefixes, buffers and their dtypes), with views for the parameters.
        state_dict = sdu._common_unshard_post_state_dict_hook(
            module, fsdp_state, state_dict, prefix, param_hook
        )
        state_dict.pop(prefix + FLAT_PARAM, None)
        return state_dict

    def pre_load(module: nn.Module, fsdp_state: Any, state_dict: dict[str, Any], prefix: str) -> None:
        sdu._lazy_init(fsdp_state, module)
        sdu._replace_by_prefix(state_dict, prefix, prefix + FSDP_PREFIX)
        if not sdu._has_fsdp_params(fsdp_state, module):
            return
        handle = sdu._module_handle(fsdp_state, module)
        for index, (fqn, _, _) in enumerate(sdu._param_name_infos(module, fsdp_state)):
            value = state_dict.pop(f"{prefix}{FSDP_PREFIX}{fqn}", None)
            if value is not None:
                _copy_into_shard(_param_tensor(handle, index), value)

    def post_load(module: nn.Module, fsdp_state: Any, *args: Any, **kwargs: Any) -> None:
        return None

    names = (
        "_sharded_pre_state_dict_hook",
        "_sharded_post_state_dict_hook",
        "_sharded_pre_load_state_dict_hook",
        "_sharded_post_load_state_dict_hook",
    )
    originals = {name: getattr(sdu, name) for name in names}
    for name, hook in zip(names, (pre_save, post_save, pre_load, post_load), strict=True):
        setattr(sdu, name, hook)
    try:
        yield
    finally:
        for name, hook in originals.items():
            setattr(sdu, name, hook)


def _param_index(model: nn.Module) -> dict[int, tuple[Any, int]]:
    """``id(original parameter) -> (handle, index)`` for every FSDP1 unit of ``model``."""
    found = {}
    for handle in _handles(model):
        for index, param in enumerate(handle.flat_param._params):
            found[id(param)] = (handle, index)
    return found


def _all_ranks_agree(ok: bool) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _groups(model: nn.Module, optimizer: Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    return [
        {**{k: v for k, v in group.items() if k != PARAMS}, PARAMS: [names[id(p)] for p in group[PARAMS]]}
        for group in optimizer.param_groups
    ]


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer) -> dict[str, Any] | None:
    """The optimizer's sharded state keyed by clean parameter name, as ``FSDP.optim_state_dict`` gives it,
    without communication; ``None`` where the fast form does not apply (on every rank alike).

    Collective (one small all-reduce: every rank must be able to take this path). Each state tensor of a
    parameter's local piece becomes a ``ShardedTensor`` of views of it; zero-dimensional states (Adam's
    ``step``) and non-tensors are kept as they are.
    """
    names = parameter_names(model)
    where = _param_index(model)
    state: dict[str, dict[str, Any]] = {}
    ok = supported(model)
    if ok:
        for group in optimizer.param_groups:
            for param in group[PARAMS]:
                if id(param) not in where or id(param) not in names:
                    ok = False
                    break
                entries = optimizer.state.get(param)
                if not entries:
                    continue
                handle, index = where[id(param)]
                layout = _layouts(handle)[index]
                numel = layout.local[1] if layout.local is not None else 0
                out: dict[str, Any] = {}
                for entry, value in entries.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        if value.dim() != 1 or value.numel() != numel or not value.is_contiguous():
                            ok = False
                            break
                        out[entry] = _sharded_tensor(
                            value.detach(), layout, handle.process_group, handle.rank
                        )
                    else:
                        out[entry] = value
                state[names[id(param)]] = out
            if not ok:
                break
    if not _all_ranks_agree(ok):
        return None
    return {STATE: state, PARAM_GROUPS: _groups(model, optimizer, names)}


def optimizer_template(
    model: nn.Module,
    optimizer: Optimizer,
    stored: dict[str, dict[str, tuple[tuple[int, ...] | None, torch.dtype | None]]],
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]] | None:
    """What to load an FSDP1 optimizer's state into, from the checkpoint's index; or ``None``.

    Returns ``(template, local)``: the name-keyed template DCP loads into (a state with the parameter's
    global shape is a ``ShardedTensor`` over a new local flat tensor, other tensors plain, non-tensors
    ``None``) and the same state with those local flat tensors, for :func:`load_optimizer_state` once
    DCP has filled them. ``stored`` is as for :func:`~lightning_sharded.checkpoint.load.checks.template_like`.
    Depends on the model and the checkpoint only: every rank takes the same branch.
    """
    if not supported(model):
        return None
    names = parameter_names(model)
    where = _param_index(model)
    params: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for param in group[PARAMS]:
            if id(param) not in where or id(param) not in names:
                return None
            params[names[id(param)]] = param
    template: dict[str, dict[str, Any]] = {}
    local: dict[str, dict[str, Any]] = {}
    for name in sorted(stored):
        param = params.get(name)
        if param is None:
            continue
        handle, index = where[id(param)]
        layout = _layouts(handle)[index]
        numel = layout.local[1] if layout.local is not None else 0
        for entry, (shape, dtype) in sorted(stored[name].items()):
            value: Any = None
            piece: Any = None
            if shape is not None and dtype is not None:
                if len(shape) > 0 and tuple(shape) == layout.shape:
                    piece = torch.empty(numel, dtype=dtype, device=param.device)
                    value = _sharded_tensor(piece, layout, handle.process_group, handle.rank)
                else:
                    piece = value = torch.empty(shape, dtype=dtype)
            template.setdefault(name, {})[entry] = value
            local.setdefault(name, {})[entry] = piece
    return {STATE: template, PARAM_GROUPS: _groups(model, optimizer, names)}, local


def load_optimizer_state(
    optimizer: Optimizer, template: dict[str, Any], local: dict[str, dict[str, Any]]
) -> None:
    """Load what DCP read into ``template`` (from :func:`optimizer_template`) into ``optimizer``."""
    from lightning_sharded.checkpoint.state_dicts import key_by_index

    # A ShardedTensor entry was read into its local flat tensor; anything else DCP filled in place
    # (plain tensors) or put into the template (non-tensors).
    state = {
        name: {
            entry: local[name][entry] if adapter_for(value) is not None else value
            for entry, value in entries.items()
        }
        for name, entries in template[STATE].items()
    }
    optimizer.load_state_dict(key_by_index({STATE: state, PARAM_GROUPS: template[PARAM_GROUPS]}))
