"""The per-rank index of a sharded checkpoint: each loading rank reads only the part it needs.

DCP's ``.metadata`` grows with the number of ranks and a load gives all of it to every rank (3.7 MB,
0.45 s of CPU to unpickle, per rank at 4,096 ranks). A save of this library writes beside it
:data:`~.names.INDEX_LAYOUT` (rank 0: per key its dtype, global shape and *grid*, :data:`EVEN`,
:data:`WHOLE`, :data:`FLAT` or :data:`CHUNKS`) and :func:`~.names.rank_index_file` ``(k)`` (rank k,
no collective); a loading rank reads the files of the ranks whose pieces its tensors overlap
(:func:`ranks_to_read`) and plans with a DCP ``Metadata`` of only those pieces (:func:`partial_metadata`).
The files, the grids, the compatibility rules: ``docs/checkpoint-format.md``, "The per-rank index". A
save the grids cannot describe (:func:`layout_bytes` returns ``None``) has no layout and loads from
``.metadata``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_sharded.checkpoint import names
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.flat_ranges import boxes as range_boxes

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT",
    "IndexLayout",
    "RankIndexRecorder",
    "flat_tensors",
    "layout_bytes",
    "parse_layout",
    "parse_rank_file",
    "partial_metadata",
    "ranks_to_read",
]

#: Version of the layout and per-rank files (their ``"format"`` field).
FORMAT = 1

EVEN, WHOLE, FLAT, CHUNKS = "even", "whole", "flat", "chunks"

_Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _place(info: Any) -> tuple[str, int, int]:
    """Where a DCP write result's bytes are: (relative path, offset, length)."""
    return str(info.relative_path), int(info.offset), int(info.length)


class RankIndexRecorder:
    """Keeps what a DCP storage writer wrote on this rank (its ``write_data``: this rank's results)
    and, on the coordinator, the layout of the global index (its ``finish``): both are hooks of an
    :class:`~lightning_sharded.checkpoint.backends.observed.Observed` writer (:attr:`hooks`).

    Once ``finish`` has written ``.metadata``, the global ``Metadata`` is emptied in place: DCP's save
    ends by sending the coordinator's ``finish`` result, that object, to every rank (3.7 MB at 4,096
    ranks, unpickled by each), and no rank needs it then (the layout is made before). Safe because no
    DCP plan caching is used (it would keep that object for the next save).
    """

    def __init__(self) -> None:
        self.items: list[list[Any]] = []
        #: The layout file (coordinator, after ``finish``); ``None`` elsewhere, or when the index cannot
        #: be described by grids (:func:`layout_bytes`).
        self.layout: bytes | None = None
        self.hooks = {"write_data": self._write_data, "finish": self._finish}

    def _finish(self, call: Any, metadata: Any, results: Any) -> None:
        call(metadata=metadata, results=results)
        self.layout = layout_bytes(metadata)
        metadata.state_dict_metadata = {}
        metadata.storage_data = {}
        metadata.planner_data = {}

    def _write_data(self, call: Any, plan: Any, planner: Any) -> Any:
        future = call(plan, planner)
        sizes = {
            item.index: list(item.tensor_data.chunk.sizes)
            for item in plan.items
            if getattr(item, "tensor_data", None) is not None
        }
        for result in future.wait():
            if result.index.offset is None or result.index not in sizes:  # a byte item: in the layout
                continue
            piece = [result.index.fqn, list(result.index.offset), sizes[result.index]]
            self.items.append(piece + list(_place(result.storage_data)))
        return future

    def rank_bytes(self, rank: int) -> bytes:
        """This rank's file (:func:`~.names.rank_index_file`): where each piece it wrote is."""
        return _dumps({"format": FORMAT, "rank": rank, "items": sorted(self.items)})


def _even_boxes(size: tuple[int, ...], rows: int, n: int) -> list[_Box]:
    """Piece k of ``n``: rows ``[k * rows, (k + 1) * rows)`` of every column, the last one cut at the size."""
    rest = tuple(size[1:])
    return [((k * rows,) + (0,) * len(rest), (min(rows, size[0] - k * rows), *rest)) for k in range(n)]


def _even_grid(size: tuple[int, ...], boxes: list[_Box], ranks: list[int]) -> list[Any] | None:
    """``["even", rows, n]`` when the pieces are :func:`_even_boxes`, piece k by rank k; else ``None``."""
    if not size or not boxes or boxes[0][1][0] <= 0:
        return None
    rows, n = boxes[0][1][0], len(boxes)
    if ranks != list(range(n)) or boxes != _even_boxes(size, rows, n) or n * rows < size[0]:
        return None
    return [EVEN, rows, n]


def _flat_start(offsets: tuple[int, ...], size: tuple[int, ...]) -> int:
    start, stride = 0, 1
    for o, n in zip(reversed(offsets), reversed(size), strict=True):
        start += o * stride
        stride *= n
    return start


def _flat_boxes(size: tuple[int, ...], at: int, every: int, rank: int) -> list[_Box]:
    """Rank ``rank``'s boxes of a tensor kept as a flat range: its flattening starts at element ``at``
    of a flat buffer cut every ``every`` elements, piece k to rank k (FSDP1's flat parameter)."""
    numel = math.prod(size)
    start, stop = max(0, rank * every - at), min(numel, (rank + 1) * every - at)
    return [(o, s) for o, s, _ in range_boxes(start, stop, size)]


def _flat_grid(size: tuple[int, ...], boxes_: list[_Box], ranks: list[int]) -> list[Any] | None:
    """``["flat", at, every]`` when the pieces are those of a flat range cut every ``every`` elements,
    piece k written by rank k (FSDP1's flat parameters, whose cuts fall inside rows); else ``None``."""
    numel = math.prod(size)
    if numel == 0 or not ranks:
        return None
    ends: dict[int, int] = {}
    for (offsets, sizes), rank in zip(boxes_, ranks, strict=True):
        end = _flat_start(offsets, size) + math.prod(sizes)
        ends[rank] = max(ends.get(rank, 0), end)
    first, last = min(ends), max(ends)
    if first == last or sorted(ends) != list(range(first, last + 1)):
        return None  # one rank, or ranks with no piece between others: not one flat range cut evenly
    # every piece but the last one ends at a cut: `every` apart
    every = ends[first + 1] - ends[first] if last - first >= 2 else max(ends[first], numel - ends[first])
    if every <= 0:
        return None
    at = (first + 1) * every - ends[first]
    expected = sorted(
        (box, rank) for rank in range(first, last + 1) for box in _flat_boxes(size, at, every, rank)
    )
    if expected != sorted(zip(boxes_, ranks, strict=True)):
        return None
    return [FLAT, at, every]


def layout_bytes(metadata: Any) -> bytes | None:
    """The layout file of a save, from the global DCP ``Metadata`` its ``save`` returned (rank 0).

    ``None`` when the index cannot be described by ranks (a shard file whose name does not say its rank,
    or bytes stored through a transform): the checkpoint is then loaded from ``.metadata`` alone.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    places: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for index, info in (metadata.storage_data or {}).items():
        if getattr(info, "transform_descriptors", None):
            return None
        offset = tuple(index.offset) if index.offset is not None else None
        places[(index.fqn, offset)] = _place(info)
    tensors: dict[str, Any] = {}
    byte_items: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            place = places.get((fqn, None))
            if place is None:
                return None
            byte_items[fqn] = list(place)
            continue
        if not isinstance(item, TensorStorageMetadata):
            return None
        size = tuple(item.size)
        boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in item.chunks)
        if any((fqn, offsets) not in places for offsets, _ in boxes):
            return None
        stored = [places[(fqn, offsets)] for offsets, _ in boxes]
        ranks = [rank for place in stored if (rank := names.shard_rank(place[0])) is not None]
        if len(ranks) < len(stored):
            return None
        dtype = str(item.properties.dtype).removeprefix("torch.")
        if len(boxes) == 1 and boxes[0] == ((0,) * len(size), size):
            grid = [WHOLE, *stored[0]]
        else:
            grid = (
                _even_grid(size, boxes, ranks)
                or _flat_grid(size, boxes, ranks)
                or [CHUNKS, [list(o) for o, _ in boxes], [list(s) for _, s in boxes], ranks]
            )
        tensors[fqn] = [dtype, list(size), grid]
    planner_data = {k: list(v) for k, v in (metadata.planner_data or {}).items()}
    return _dumps({"format": FORMAT, "tensors": tensors, "bytes": byte_items, "planner_data": planner_data})


@dataclass(frozen=True)
class IndexLayout:
    """A checkpoint's layout file, read (see the module doc).

    Attributes:
        tensors: key -> (dtype, global shape, grid).
        byte_items: key -> (relative path, offset, length).
        planner_data: key -> its path in the nested state (DCP's flattening).
    """

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], list[Any]]]
    byte_items: dict[str, tuple[str, int, int]]
    planner_data: dict[str, list[Any]]

    def boxes(self, fqn: str) -> list[tuple[_Box, int]]:
        """The pieces of ``fqn`` that a grid names, with the rank that wrote each (none for ``whole``)."""
        _, size, grid = self.tensors[fqn]
        if grid[0] == EVEN:
            return [(box, k) for k, box in enumerate(_even_boxes(size, grid[1], grid[2]))]
        if grid[0] == FLAT:
            at, every, numel = grid[1], grid[2], math.prod(size)
            return [
                (box, k)
                for k in range(at // every, (at + numel - 1) // every + 1)
                for box in _flat_boxes(size, at, every, k)
            ]
        if grid[0] == CHUNKS:
            return [((tuple(o), tuple(s)), int(r)) for o, s, r in zip(grid[1], grid[2], grid[3], strict=True)]
        return []


def parse_layout(data: bytes, where: str) -> IndexLayout:
    """The layout file's bytes, checked; ``where`` (its path) names it in errors.

    Raises:
        CheckpointError: it is not JSON, not of a known format, or a field is not what it must be.
    """
    import torch

    try:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise ValueError(f"format {found!r}, this version reads format {FORMAT}")
        tensors: dict[str, tuple[torch.dtype, tuple[int, ...], list[Any]]] = {}
        for fqn, (dtype_name, size, grid) in raw["tensors"].items():
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"key {fqn!r} has an unknown dtype {dtype_name!r}")
            if not isinstance(grid, list) or not grid or grid[0] not in (EVEN, WHOLE, FLAT, CHUNKS):
                raise ValueError(f"key {fqn!r} has an unknown grid {grid!r:.80}")
            tensors[str(fqn)] = (dtype, tuple(int(s) for s in size), grid)
        byte_items = {str(k): (str(p), int(o), int(n)) for k, (p, o, n) in raw["bytes"].items()}
        planner_data = {str(k): list(v) for k, v in raw.get("planner_data", {}).items()}
    except (ValueError, KeyError, TypeError) as ex:
        raise CheckpointError(
            f"The checkpoint's index layout {where!r} cannot be read ({type(ex).__name__}: {ex}). The file"
            " is corrupt or was written by a newer version of lightning_sharded; restore the directory from"
            " a copy, or upgrade lightning_sharded."
        ) from ex
    return IndexLayout(tensors, byte_items, planner_data)


def _local_boxes(value: Any) -> list[_Box]:
    from torch.distributed.tensor import DTensor

    from lightning_sharded._compat import create_chunk_list

    if isinstance(value, DTensor) and value.device_mesh.get_coordinate() is None:
        return []  # not on this rank's mesh: DCP reads nothing for it
    return [(tuple(c.offsets), tuple(c.sizes)) for c in create_chunk_list(value)]


def _overlap(a: _Box, b: _Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True))


def flat_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` flattened as DCP's load planner flattens it: tensor-like values by DCP key."""
    import torch

    from lightning_sharded._compat import flatten_sharded_tensors, flatten_state_dict

    flat, _ = flatten_state_dict(flatten_sharded_tensors(state))
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def ranks_to_read(
    layout: IndexLayout, flat: Mapping[str, Any]
) -> dict[int, set[tuple[str, tuple[int, ...]]]]:
    """The ranks whose files hold a piece this rank's tensors (``flat``: :func:`flat_tensors`) overlap,
    each with the pieces needed from it (key, offsets)."""
    wanted: dict[int, set[tuple[str, tuple[int, ...]]]] = {}
    for fqn, value in flat.items():
        entry = layout.tensors.get(fqn)
        if entry is None or entry[2][0] == WHOLE:
            continue
        mine = _local_boxes(value)
        if not mine:
            continue
        grid = entry[2]
        if grid[0] == EVEN and len(entry[1]) and all(len(box[0]) == len(entry[1]) for box in mine):
            rows, n, rest = grid[1], grid[2], len(entry[1]) - 1
            for offsets, sizes in mine:
                if any(s <= 0 for s in sizes):
                    continue
                for k in range(offsets[0] // rows, min(n - 1, (offsets[0] + sizes[0] - 1) // rows) + 1):
                    wanted.setdefault(k, set()).add((fqn, (k * rows,) + (0,) * rest))
            continue
        size = entry[1]
        if grid[0] == FLAT:  # the ranks whose flat ranges meet the flat extent of a local box
            at, every = grid[1], grid[2]
            for box in mine:
                if any(n <= 0 for n in box[1]):
                    continue
                lo = _flat_start(box[0], size)
                hi = _flat_start(tuple(o + n - 1 for o, n in zip(*box, strict=True)), size) + 1
                for k in range((lo + at) // every, (hi - 1 + at) // every + 1):
                    for piece in _flat_boxes(size, at, every, k):
                        if _overlap(piece, box):
                            wanted.setdefault(k, set()).add((fqn, piece[0]))
            continue
        for box, rank in layout.boxes(fqn):
            if any(_overlap(box, m) for m in mine):
                wanted.setdefault(rank, set()).add((fqn, box[0]))
    return wanted


def parse_rank_file(
    data: bytes, where: str, rank: int
) -> list[tuple[str, tuple[int, ...], tuple[int, ...], str, int, int]]:
    """Rank ``rank``'s index file: (key, offsets, sizes, relative path, offset, length) of each piece.

    Raises:
        CheckpointError: it is not such a file, or not rank ``rank``'s.
    """
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("rank") != rank:
            raise ValueError(f"it is not rank {rank}'s index file of format {FORMAT}")
        return [
            (str(fqn), tuple(map(int, offsets)), tuple(map(int, sizes)), str(rel), int(off), int(n))
            for fqn, offsets, sizes, rel, off, n in raw["items"]
        ]
    except (ValueError, KeyError, TypeError) as ex:
        raise CheckpointError(
            f"The index file {where!r} of rank {rank} cannot be read ({type(ex).__name__}: {ex}). The file is"
            " corrupt; restore the checkpoint directory from a copy, or load an earlier checkpoint."
        ) from ex


def partial_metadata(
    layout: IndexLayout,
    pieces: Iterable[tuple[str, tuple[int, ...], tuple[int, ...], str, int, int]],
    wanted: Iterable[tuple[str, tuple[int, ...]]],
    where: str,
) -> Any:
    """A DCP ``Metadata`` with every key of ``layout`` and, of the pieces that grids name, the ``pieces``
    read (from the ranks' files): what DCP plans this rank's reads with.

    Raises:
        CheckpointError: a piece of ``wanted`` is in none of the files read (``where`` names them).
    """
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from lightning_sharded._compat import storage_info

    chunks: dict[str, list[Any]] = {fqn: [] for fqn in layout.tensors}
    storage: dict[Any, Any] = {}
    found: set[tuple[str, tuple[int, ...]]] = set()
    for fqn, offsets, sizes, rel, off, length in pieces:
        if fqn not in chunks or (fqn, offsets) in found or layout.tensors[fqn][2][0] == WHOLE:
            continue
        found.add((fqn, offsets))
        chunks[fqn].append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        storage[MetadataIndex(fqn, torch.Size(offsets))] = storage_info(rel, off, length)
    missing = sorted(set(wanted) - found)
    if missing:
        fqn, offsets = missing[0]
        raise CheckpointError(
            f"The checkpoint's index does not say where the piece at {list(offsets)} of {fqn!r} is: the index"
            f" files {where} do not list it ({len(missing)} piece(s) missing). The index files are corrupt;"
            " restore the checkpoint directory from a copy, or load an earlier checkpoint."
        )
    state_dict_metadata: dict[str, Any] = {}
    for fqn, (dtype, size, grid) in layout.tensors.items():
        if grid[0] == WHOLE:
            whole = torch.Size([0] * len(size))
            chunks[fqn] = [ChunkStorageMetadata(whole, torch.Size(size))]
            storage[MetadataIndex(fqn, whole)] = storage_info(str(grid[1]), int(grid[2]), int(grid[3]))
        properties = TensorProperties(dtype=dtype)
        state_dict_metadata[fqn] = TensorStorageMetadata(properties, torch.Size(size), chunks[fqn])
    for fqn, (rel, off, length) in layout.byte_items.items():
        state_dict_metadata[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = storage_info(rel, off, length)
    planner_data = {k: tuple(v) for k, v in layout.planner_data.items()}
    return Metadata(
        state_dict_metadata, planner_data=planner_data, storage_data=storage, storage_meta=StorageMeta()
    )
