"""``tiling_problem``: the check that a DCP index's chunks hold each element of a tensor exactly once."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sharded.checkpoint.dcp_index import tiling_problem


def _chunks(*boxes: tuple[tuple[int, ...], tuple[int, ...]]) -> list[SimpleNamespace]:
    return [SimpleNamespace(offsets=offsets, sizes=sizes) for offsets, sizes in boxes]


def _grid(shape: tuple[int, ...], cuts: list[list[int]]) -> list[SimpleNamespace]:
    """The boxes of ``shape`` cut at ``cuts[d]`` along each dimension ``d``."""
    bounds = [sorted({0, n, *(c for c in cut if 0 < c < n)}) for n, cut in zip(shape, cuts, strict=True)]
    spans = [list(itertools.pairwise(b)) for b in bounds]
    return _chunks(
        *((tuple(a for a, _ in box), tuple(b - a for a, b in box)) for box in itertools.product(*spans))
    )


@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    cuts=st.lists(st.lists(st.integers(0, 9), max_size=3), min_size=3, max_size=3),
    order=st.randoms(use_true_random=False),
)
@settings(max_examples=150, deadline=None)
def test_every_grid_of_a_tensor_tiles_it_and_dropping_or_repeating_a_chunk_does_not(
    shape: tuple[int, ...], cuts: list[list[int]], order: object
) -> None:
    chunks = _grid(shape, cuts[: len(shape)])
    order.shuffle(chunks)  # type: ignore[attr-defined]
    assert tiling_problem(shape, chunks) is None
    if len(chunks) > 1:
        assert "hold" in str(tiling_problem(shape, chunks[1:]))  # one dropped: elements in none
        doubled = [*chunks, chunks[0]]
        assert "overlap" in str(tiling_problem(shape, doubled))


@pytest.mark.parametrize(
    ("size", "boxes", "problem"),
    [
        ((4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 6))], None),  # FSDP's rows
        ((4, 6), [((0, 0), (4, 3)), ((0, 3), (4, 3))], None),  # tensor parallel's columns
        ((0, 4), [((0, 0), (0, 4)), ((0, 0), (0, 4))], None),  # empty: no element to hold
        ((), [((), ())], None),  # a scalar
        ((4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 6)), ((1, 0), (0, 6))], None),  # an empty chunk anywhere
        ((4, 6), [((0, 0), (3, 6)), ((2, 0), (2, 6))], "the chunks at [0, 0] and [2, 0] overlap"),
        ((4, 6), [((0, 0), (2, 6)), ((3, 0), (2, 6))], "a chunk at [3, 0] of size [2, 6] lies outside"),
        ((4, 6), [((0, 0), (2, 6)), ((-1, 0), (2, 6))], "a chunk at [-1, 0] of size [2, 6] lies outside"),
        ((4, 6), [((0, 0), (2, 6)), ((2,), (2, 6))], "a chunk at [2] of size [2, 6] lies outside"),
        ((4, 6), [((0, 0), (2, 6))], "its chunks hold 12 of its 24 elements"),
        ((4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 3)), ((2, 2), (2, 4))], "overlap"),  # a column twice
    ],
)
def test_tilings_and_what_is_wrong_with_the_others(
    size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], problem: str | None
) -> None:
    found = tiling_problem(size, _chunks(*boxes))
    assert found == problem if problem is None else problem in str(found)
