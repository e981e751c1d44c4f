"""What a sharded checkpoint's DCP index (``.metadata``) says, read without a process group:
:func:`index_problems` is the one check of the shard files against it (for loads without a manifest,
and ``verify``), :func:`model_key` the one answer to where the model state is (loads, tools, exports).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_sharded.checkpoint import names, rank_index, unpickling
from lightning_sharded.checkpoint.backends import Location, join
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.problems import Problem
from lightning_sharded.checkpoint.unpickling import without_torch

if TYPE_CHECKING:
    import torch

    from lightning_sharded.checkpoint.backends import Backend

__all__ = [
    "ShardedLayout",
    "index_problems",
    "model_key",
    "object_archives",
    "read_index",
    "read_indexed_layout",
    "read_sharded_layout",
    "tensor_entries",
    "tiling_problem",
    "top_level_keys",
]

_METADATA = "torch.distributed.checkpoint.metadata.Metadata"


def read_index(
    backend: Backend, data: Location, *, weights_only: bool | None = False, standins: bool = False
) -> Any:
    """The DCP ``Metadata`` of the sharded checkpoint under ``data``; a ``CheckpointError`` when it is
    missing, damaged or not DCP's ``Metadata``.

    ``weights_only=False`` (a resume with ``weights_only=False``) reads it by DCP's own reader, with plain
    ``pickle``; ``True`` or ``None`` (the offline tools, a resume by default) with the restricted
    unpickler of :func:`~.unpickling.load_pickle`, which builds DCP's metadata classes only, so no code
    from the file runs (a :class:`~.unpickling.RefusedPickleError` for any other type). ``standins``
    (with ``weights_only``): stand-ins for torch's classes where torch is not needed to read it
    (:func:`~.unpickling.without_torch.read_dcp_metadata`), for callers that only read attributes.
    """
    file = join(data, names.DCP_METADATA)
    if standins and unpickling.resolve_weights_only(weights_only):
        try:
            with backend.open_file(file) as f:
                found = without_torch.read_dcp_metadata(f)
        except OSError:
            found = None  # read again below, which says what is wrong
        if found is not None and without_torch.type_name(found) == _METADATA:
            return _tiled(found, file)
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    try:
        if unpickling.resolve_weights_only(weights_only):
            with backend.open_file(file) as f:
                metadata = unpickling.load_pickle(f, what=f"The DCP metadata {str(file)!r}")
            if isinstance(metadata, Metadata) and getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()  # as DCP's reader leaves it
        else:
            metadata = backend.dcp_reader(data).read_metadata()
    except CheckpointError:
        raise
    except Exception as ex:
        raise CheckpointError(
            f"Could not read the DCP index {str(file)!r}: the file `.metadata` of"
            f" the sharded checkpoint {str(data)!r} cannot be read ({type(ex).__name__}: {ex}). The file is"
            " truncated or corrupt; restore the directory from a copy, or load an earlier checkpoint."
        ) from ex
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"The DCP metadata {str(file)!r} holds a {type(metadata).__name__}, not DCP's Metadata: this is"
            " not a sharded checkpoint. Restore the directory from a copy, or load an earlier checkpoint."
        )
    return _tiled(metadata, file)


def _tiled(metadata: Any, file: Location) -> Any:
    """``metadata``, once every tensor entry's chunks tile it (:func:`tiling_problem`): else a load would
    leave a tensor's uncovered elements as they were, silently (DCP reads what the index lists)."""
    for key, item in (getattr(metadata, "state_dict_metadata", None) or {}).items():
        chunks = getattr(item, "chunks", None)
        if chunks is not None and (problem := tiling_problem(item.size, chunks)):
            raise CheckpointError(
                f"The DCP index {str(file)!r} is damaged: for the tensor {key!r}, {problem} (DCP writes every"
                " element of a tensor in exactly one chunk). Restore the directory from a copy, or load an"
                " earlier checkpoint."
            )
    return metadata


def tiling_problem(size: Iterable[int], chunks: Iterable[Any]) -> str | None:
    """Why the ``chunks`` (``offsets`` and ``sizes``, as DCP's ``ChunkStorageMetadata``) of a tensor of
    ``size`` do not hold each of its elements exactly once, or ``None``: each inside the tensor, with its
    number of dimensions, none over another, all of them together its number of elements. The check DCP's
    save planner makes before it writes an index (``torch/distributed/checkpoint/default_planner.py``,
    ``_validate_global_plan``), made again on the way in, for an index damaged or written otherwise."""
    shape = tuple(int(n) for n in size)
    if not shape:
        return None  # a scalar: nothing to place
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in chunks:
        offsets, sizes = tuple(int(n) for n in chunk.offsets), tuple(int(n) for n in chunk.sizes)
        if not len(offsets) == len(sizes) == len(shape) or any(
            o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)
        ):
            return f"a chunk at {list(offsets)} of size {list(sizes)} lies outside its size {list(shape)}"
        if math.prod(sizes):
            boxes.append((offsets, sizes))
    # Overlaps, by a sweep along the dimension the chunks are cut most along (FSDP's rows, TP's columns).
    dim = max(range(len(shape)), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    open_: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offsets, sizes in sorted(boxes, key=lambda box: box[0][dim]):
        open_ = [box for box in open_ if box[0][dim] + box[1][dim] > offsets[dim]]
        for other, other_sizes in open_:
            if all(
                a < c + t and c < a + s for a, s, c, t in zip(offsets, sizes, other, other_sizes, strict=True)
            ):
                return f"the chunks at {list(other)} and {list(offsets)} overlap"
        open_.append((offsets, sizes))
    held, elements = sum(math.prod(sizes) for _, sizes in boxes), math.prod(shape)
    if held != elements:
        return f"its chunks hold {held} of its {elements} elements"
    return None


def index_problems(backend: Backend, data: Location, metadata: Any) -> list[Problem]:
    """Every shard file the DCP index names that is missing under ``data`` or too short for its pieces."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is None:
            continue
        needed[str(relative)] = max(needed.get(str(relative), 0), int(info.offset) + int(info.length))
    problems: list[Problem] = []
    sizes = backend.list_files(data)
    for relative in sorted(needed):
        size = sizes.get(relative)
        rank = names.shard_rank(relative)
        if size is None:
            problems.append(Problem(relative, "is missing (`.metadata` references it)", rank))
        elif size < needed[relative]:
            what = f"is truncated: {size} bytes, `.metadata` needs {needed[relative]}"
            problems.append(Problem(relative, what, rank, size, needed[relative]))
    return problems


_BYTES = "torch.distributed.checkpoint.metadata.BytesStorageMetadata"
_TENSOR = "torch.distributed.checkpoint.metadata.TensorStorageMetadata"


def tensor_entries(metadata: Any) -> dict[str, Any]:
    """The tensor entries of a DCP index (DCP's or stand-ins), by key, sorted."""
    entries = metadata.state_dict_metadata
    return {k: v for k, v in sorted(entries.items()) if without_torch.type_name(v) == _TENSOR}


def object_archives(backend: Backend, data: Location, metadata: Any) -> Iterator[tuple[str, str, int, bytes]]:
    """Each non-tensor entry of the DCP index ``metadata`` (DCP's or stand-ins) as ``(key, file, offset,
    bytes of its torch.save archive)``, read from the shard files under ``data`` in file and offset
    order, each file opened once. An entry stored transformed (compressed...) is left out: only DCP's
    load reads it (safely)."""
    objects = {k for k, v in metadata.state_dict_metadata.items() if without_torch.type_name(v) == _BYTES}
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn in objects and not info.transform_descriptors:
            by_file.setdefault(str(info.relative_path), []).append(
                (int(info.offset), int(info.length), index.fqn)
            )
    for rel in sorted(by_file):
        with backend.open_file(join(data, rel)) as f:
            for offset, length, fqn in sorted(by_file[rel]):
                f.seek(offset)
                yield fqn, rel, offset, f.read(length)


def top_level_keys(metadata: Any) -> set[str]:
    """The top-level keys of the state a DCP index describes (``"model"``, ``"optimizer_0"``...)."""
    return _tops(metadata.state_dict_metadata, getattr(metadata, "planner_data", None) or {})


def _tops(keys: Iterable[str], planner_data: Mapping[str, Sequence[Any]]) -> set[str]:
    """The top-level keys of flattened DCP ``keys``: each one's first step in DCP's ``planner_data``."""
    return {str(planner_data[key][0]) if key in planner_data else key.split(".", 1)[0] for key in keys}


def model_key(tops: Iterable[str], data: Location) -> str:
    """The top-level key (of ``tops``) under which the sharded checkpoint at ``data`` keeps its model state.

    The one rule, for every load, tool and export: the model state is under :data:`~.names.MODEL`
    (``FSDPStrategy``'s key) or :data:`~.names.STATE_DICT` (``ModelParallelStrategy``'s); neither, or
    both (no Lightning strategy writes both), is a ``CheckpointError``.
    """
    tops = set(tops)
    found = sorted(k for k in names.MODEL_KEYS if k in tops)
    if not found:
        raise CheckpointError(
            f"The sharded checkpoint {str(data)!r} has no model state: none of the keys"
            f" {list(names.MODEL_KEYS)} among its top-level keys {sorted(tops)}, so it holds no model state"
            f" a Lightning strategy wrote ({names.MODEL!r} is FSDPStrategy's key, {names.STATE_DICT!r}"
            " ModelParallelStrategy's)."
        )
    if len(found) > 1:
        raise CheckpointError(
            f"The sharded checkpoint {str(data)!r} holds model state under both {names.MODEL!r} and"
            f" {names.STATE_DICT!r}: no Lightning strategy writes both, so which one is the model's is not"
            " known. Load it with the code that wrote it, or save it again under one of them."
        )
    return found[0]


@dataclass(frozen=True)
class ShardedLayout:
    """What a sharded directory's DCP index says it holds.

    Attributes:
        model_entries: model state key (relative, ``"layer.weight"``) to its global shape, or ``None``
            for an entry stored as bytes; ``entries`` the same for every flattened DCP key.
        optimizer_count: how many ``optimizer_N`` keys there are (``0..N-1`` without gaps).
        metadata: the DCP ``Metadata`` (read once, shared with every rank by a load, and given to the DCP
            readers so that they do not read ``.metadata`` again); ``None`` when read from the per-rank
            index's layout (``index``).
    """

    path: Location
    model_key: str
    model_entries: dict[str, tuple[int, ...] | None]
    optimizer_count: int
    entries: dict[str, tuple[int, ...] | None] = field(repr=False)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict, repr=False)
    metadata: Any = field(default=None, repr=False, compare=False)
    index: rank_index.IndexLayout | None = field(default=None, repr=False, compare=False)


def read_sharded_layout(
    path: Any, backend: Backend | None = None, *, weights_only: bool | None = False
) -> ShardedLayout:
    """Read the DCP index of a sharded directory (found by the detector without a ``backend``), check its
    shard files, find the model key and optimizers; a ``CheckpointError`` for the index unread, a shard
    file missing or short, no model state, or optimizer keys with gaps."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if backend is None:
        from lightning_sharded.checkpoint.detect import detect

        found = detect(path)
        backend, data = found.backend, found.data
    else:
        data = path
    metadata = read_index(backend, data, weights_only=weights_only)
    problems = index_problems(backend, data, metadata)
    if problems:
        listed = [
            f"{p.path!r} is missing"
            if p.size is None
            else f"{p.path!r} has {p.size} bytes, its index needs at least {p.needed}"
            for p in problems
        ]
        raise CheckpointError(
            f"The sharded checkpoint {str(data)!r} is incomplete: " + "; ".join(listed) + ". The files were"
            " truncated or removed after the save; resume from an earlier checkpoint."
        )
    items = metadata.state_dict_metadata
    tensors = {key: item for key, item in items.items() if isinstance(item, TensorStorageMetadata)}
    entries = {key: tuple(tensors[key].size) if key in tensors else None for key in items}
    dtypes = {key: item.properties.dtype for key, item in tensors.items()}
    return _layout(data, entries, dtypes, top_level_keys(metadata), metadata=metadata)


def read_indexed_layout(backend: Backend, data: Location) -> ShardedLayout:
    """What a sharded checkpoint with a per-rank index holds, from its layout file alone (no ``.metadata``):
    each loading rank then reads its part of the index (:func:`~.rank_index.ranks_to_read`). The shard
    files are checked against the manifest, not here."""
    file = join(data, names.INDEX_LAYOUT)
    try:
        raw = backend.read_bytes(file)
    except OSError as ex:
        raise CheckpointError(
            f"Could not read the index layout {str(file)!r} of the sharded checkpoint {str(data)!r}"
            f" ({type(ex).__name__}: {ex}); restore the directory from a copy, or load an earlier checkpoint."
        ) from ex
    index = rank_index.parse_layout(raw, str(file))
    entries: dict[str, tuple[int, ...] | None] = {k: size for k, (_, size, _) in index.tensors.items()}
    entries.update(dict.fromkeys(index.byte_items))
    dtypes = {k: dtype for k, (dtype, _, _) in index.tensors.items()}
    return _layout(data, entries, dtypes, _tops(entries, index.planner_data), index=index)


def _layout(
    data: Location,
    entries: dict[str, tuple[int, ...] | None],
    dtypes: dict[str, torch.dtype],
    tops: set[str],
    *,
    metadata: Any = None,
    index: rank_index.IndexLayout | None = None,
) -> ShardedLayout:
    key = model_key(tops, data)
    prefix = key + "."
    model_entries = {key[len(prefix) :]: shape for key, shape in entries.items() if key.startswith(prefix)}
    indices = sorted(int(m.group(1)) for top in tops if (m := names.OPTIMIZER_KEY.match(top)))
    if indices != list(range(len(indices))):
        raise CheckpointError(
            f"The sharded checkpoint {str(data)!r} has optimizer keys"
            f" {[names.optimizer_key(i) for i in indices]} with gaps; expected optimizer_0 ... optimizer_N-1."
        )
    return ShardedLayout(data, key, model_entries, len(indices), entries, dtypes, metadata, index)
