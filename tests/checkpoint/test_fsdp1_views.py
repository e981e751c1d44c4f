"""FSDP1's state dicts as views of the local flat shards (``lightning_sharded.checkpoint.fsdp1``)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from lightning_sharded.checkpoint.flat_ranges import boxes
from tests.distributed.launch import run_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "distributed" / "fsdp1_views_script.py"


def _covered(shape: tuple[int, ...], start: int, stop: int) -> list[int]:
    """The flat indices the boxes of ``[start, stop)`` cover, in order."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    flat: list[int] = []
    for offsets, sizes, first in boxes(start, stop, shape):
        cells = sorted(
            sum(o * s for o, s in zip(index, strides, strict=True))
            for index in itertools.product(*(range(o, o + n) for o, n in zip(offsets, sizes, strict=True)))
        )
        assert cells == list(range(first, first + len(cells))), (shape, start, stop, offsets, sizes)
        flat += cells
    return flat


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4), (2, 1, 3, 2), (4, 0)])
def test_boxes_cover_every_range_once_in_order_each_contiguous(shape: tuple[int, ...]) -> None:
    numel = math.prod(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            assert _covered(shape, start, stop) == list(range(start, stop))
            assert len(boxes(start, stop, shape)) <= max(1, 2 * len(shape) - 1)


def test_views_match_torchs_gathered_state_and_restore_both_ways(tmp_path: Path) -> None:
    run_ranks(SCRIPT, 2, str(tmp_path), timeout=180)
    assert (tmp_path / "ok").read_text() == "ok"
