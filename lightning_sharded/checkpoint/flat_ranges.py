"""A contiguous range of a row-major tensor's flattening, as boxes (standard library only): an FSDP1
parameter's piece of its rank's flat shard, cut the same way by the FSDP1 views
(:mod:`~lightning_sharded.checkpoint.fsdp1.layout`) and the per-rank index's ``flat`` grid
(:mod:`~lightning_sharded.checkpoint.rank_index`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["Box", "boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, flat start)


def boxes(start: int, stop: int, shape: Sequence[int]) -> list[Box]:
    """The flat range ``[start, stop)`` of a row-major tensor of ``shape`` as at most a few boxes (a
    partial first row, whole rows, a partial last row, recursively), in flat order, covering it once.
    A scalar (``shape == ()``) is one box when the range holds its element."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [((), (), start)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []

    def in_row(row: int, lo: int, hi: int) -> list[Box]:  # [lo, hi) of one row
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in boxes(lo, hi, shape[1:])]

    first_full = -(-start // inner)  # first row that starts inside the range
    last_full = stop // inner  # rows [first_full, last_full) are whole
    if first_full > last_full:  # inside one row
        row = start // inner
        return in_row(row, start - row * inner, stop - row * inner)
    out: list[Box] = []
    if start < first_full * inner:
        out += in_row(first_full - 1, start - (first_full - 1) * inner, inner)
    if first_full < last_full:
        out.append(
            ((first_full, *(0,) * (len(shape) - 1)), (last_full - first_full, *shape[1:]), first_full * inner)
        )
    if last_full * inner < stop:
        out += in_row(last_full, 0, stop - last_full * inner)
    return out
