"""The per-rank index (``index/layout.json`` and one ``index/rank-<k>.json`` per rank): each loading rank
reads only the index files of the ranks that wrote what it loads, plans the same reads as with the whole
``.metadata``, and a damaged index file fails the load with the file and rank named.

The 8-rank checkpoints are real ones of our save, made in one process by ``benchmarks.scale``'s
simulated world (rank 0 saves; the other ranks' shard and index files are put beside its own). The
plans are DCP's own, made by its ``DefaultLoadPlanner`` for a rank of a fake process group.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharded.checkpoint import names, rank_index
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.manifest import Manifest

# benchmarks.scale's fake worlds are default process groups: none may exist while this module runs.
pytestmark = pytest.mark.usefixtures("no_default_group")

SAVED = 8  # ranks of the checkpoint
ROWS, COLS = 2, 4  # rows per saving rank, columns (benchmarks.scale's model)
SHARDED = (
    "model.table",
    "model.w1",
    "model.w2",
    "optimizer_0.state.w1.exp_avg",
    "optimizer_0.state.w1.exp_avg_sq",
    "optimizer_0.state.w2.exp_avg",
    "optimizer_0.state.w2.exp_avg_sq",
)


def _save(store: Any, label: str) -> Path:
    from benchmarks.scale.__main__ import one_rank

    warnings.filterwarnings("ignore")
    target = store.target(label)
    one_rank(store, "ours", "save", target, 0, SAVED, [], count=False)
    return Path(target)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, no_default_group: None) -> Path:
    from benchmarks.scale.stores import Local

    return _save(Local(tmp_path_factory.mktemp("rank-index")), "ckpt")


def _state(mesh: Any, world: int) -> dict[str, Any]:
    """What a rank of ``world`` loads: every sharded key as a ``Shard(0)`` DTensor of the global shape,
    Adam's steps as plain tensors."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = (ROWS * SAVED, COLS)
    local, _ = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
    state: dict[str, Any] = {}
    for key in SHARDED:
        value = DTensor.from_local(
            torch.zeros(local), mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=(COLS, 1)
        )
        node = state
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    for name in ("w1", "w2"):
        state["optimizer_0"]["state"][name]["step"] = torch.zeros(())
    return state


def _planned(state: dict[str, Any], metadata: Any) -> set[tuple[Any, ...]]:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner = DefaultLoadPlanner(allow_partial_load=True)
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return {
        (
            item.storage_index.fqn,
            tuple(item.storage_index.offset or ()),
            tuple(item.storage_offsets),
            tuple(item.dest_offsets),
            tuple(item.lengths),
            str(metadata.storage_data[item.storage_index].relative_path),
            int(metadata.storage_data[item.storage_index].offset),
        )
        for item in planner.create_local_plan().items
    }


@pytest.mark.parametrize("world", [SAVED, 4, 3, 16, 1])
def test_each_rank_plans_the_same_reads_from_its_part_of_the_index(saved: Path, world: int) -> None:
    from benchmarks.scale.runs import fake_world

    layout = rank_index.parse_layout((saved / names.INDEX_LAYOUT).read_bytes(), "layout")
    whole = pickle.loads((saved / ".metadata").read_bytes())
    for rank in sorted({0, world // 2, world - 1}):
        with fake_world(rank, world) as mesh:
            state = _state(mesh, world)
            wanted = rank_index.ranks_to_read(layout, rank_index.flat_tensors(state))
            pieces = [
                piece
                for k in sorted(wanted)
                for piece in rank_index.parse_rank_file(
                    (saved / names.rank_index_file(k)).read_bytes(), f"rank {k}", k
                )
            ]
            wanted_pieces = [p for needed in wanted.values() for p in needed]
            partial = rank_index.partial_metadata(layout, pieces, wanted_pieces, "read")
            assert _planned(state, partial) == _planned(state, whole), (world, rank)
            rows = ROWS * SAVED / world  # of each loading rank
            first, last = int(rank * rows) // ROWS, (int((rank + 1) * rows) - 1) // ROWS
            if world == 3:  # torch.chunk's split: 6, 6, 4 rows
                first, last = [(0, 2), (3, 5), (6, 7)][rank]
            # the ranks whose rows it loads, and no other
            assert sorted(wanted) == list(range(first, last + 1)), (world, rank, sorted(wanted))


def test_the_layout_is_small_and_says_no_more_than_the_grid(saved: Path) -> None:
    raw = json.loads((saved / names.INDEX_LAYOUT).read_bytes())
    assert raw["format"] == rank_index.FORMAT
    grids = {key: grid for key, (_, _, grid) in raw["tensors"].items()}
    assert {key: grid for key, grid in grids.items() if key in SHARDED} == {
        key: ["even", ROWS, SAVED] for key in SHARDED
    }
    steps = [grid for key, grid in grids.items() if key.endswith(".step")]
    assert len(steps) == 2 and all(grid[0] == "whole" and grid[1] == "__0_0.distcp" for grid in steps)
    manifest = Manifest.from_json((saved / names.MANIFEST_NAME).read_text())
    owners = {e.path: e.rank for e in manifest.files if e.path.startswith(names.INDEX_DIR + "/")}
    assert owners == {names.INDEX_LAYOUT: 0, **{names.rank_index_file(k): k for k in range(SAVED)}}
    mine = json.loads((saved / names.rank_index_file(SAVED - 1)).read_bytes())
    assert mine["rank"] == SAVED - 1 and {item[3] for item in mine["items"]} == {f"__{SAVED - 1}_0.distcp"}


def _metadata(chunks: list[tuple[tuple[int, int], tuple[int, int], str]], transform: bool = False) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    md = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([4, 4]),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in chunks],
    )
    storage = {
        MetadataIndex("w", torch.Size(o)): _StorageInfo(f, 10 * i, 10, ["zstd"] if transform else None)
        for i, (o, _, f) in enumerate(chunks)
    }
    return Metadata({"w": md}, storage_data=storage)


GRID_2X2 = [
    ((0, 0), (2, 2), "__0_0.distcp"),
    ((0, 2), (2, 2), "__1_0.distcp"),
    ((2, 0), (2, 2), "__2_0.distcp"),
    ((2, 2), (2, 2), "__3_0.distcp"),
]


def test_a_2d_grid_lists_its_pieces_and_a_rank_reads_those_it_overlaps() -> None:
    layout = rank_index.parse_layout(rank_index.layout_bytes(_metadata(GRID_2X2)) or b"", "layout")
    grid = layout.tensors["w"][2]
    assert grid[0] == "chunks" and grid[3] == [0, 1, 2, 3]
    # A plain tensor is the whole of it: every rank's piece. Rows 1..2 of the first two columns: the
    # pieces of ranks 0 and 2.
    assert sorted(rank_index.ranks_to_read(layout, {"w": torch.zeros(4, 4)})) == [0, 1, 2, 3]
    from torch.distributed.tensor import DTensor, Shard

    from benchmarks.scale.runs import fake_world

    with fake_world(1, 2) as mesh:  # rank 1 of 2 along dim 1: columns 2..3, every row
        value = DTensor.from_local(torch.zeros(4, 2), mesh, [Shard(1)], run_check=False)
        assert sorted(rank_index.ranks_to_read(layout, {"w": value})) == [1, 3]


@pytest.mark.parametrize(
    "why",
    ["a storage transform", "a file that does not name its rank"],
)
def test_an_index_the_grids_cannot_describe_writes_no_layout(why: str) -> None:
    if why == "a storage transform":
        metadata = _metadata(GRID_2X2, transform=True)
    else:
        metadata = _metadata([(o, s, f.replace("__3_0", "custom")) for o, s, f in GRID_2X2])
    assert rank_index.layout_bytes(metadata) is None


def _load_last_rank(target: Path, store: Any) -> None:
    """Rank 0, then rank N-1 of a world of N (replaying rank 0's broadcasts): a load of ``target``."""
    from benchmarks.scale.__main__ import one_rank

    tape: list[bytes] = []
    one_rank(store, "ours", "load", target, 0, SAVED, tape, count=False)
    one_rank(store, "ours", "load", target, SAVED - 1, SAVED, tape, count=False)


@pytest.fixture
def own(tmp_path: Path) -> tuple[Path, Any]:
    from benchmarks.scale.stores import Local

    store = Local(tmp_path)
    return _save(store, "ckpt"), store


def _same_size(path: Path, old: str, new: str) -> None:
    assert len(old) == len(new)
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("damage", ["another rank's file", "a piece it does not list"])
def test_a_damaged_index_file_fails_the_load_naming_it(own: tuple[Path, Any], damage: str) -> None:
    target, store = own
    _load_last_rank(target, store)  # whole, it loads
    mine = target / names.rank_index_file(SAVED - 1)
    if damage == "another rank's file":
        _same_size(mine, f'"rank":{SAVED - 1}', '"rank":9')
        expected = f"The index file '{mine}' of rank {SAVED - 1} cannot be read"
    else:
        _same_size(mine, '"model.w1"', '"model.w9"')
        expected = "does not say where the piece at [14, 0] of 'model.w1' is"
    with pytest.raises(CheckpointError, match="(?s)" + expected.replace("[", r"\[").replace("]", r"\]")):
        _load_last_rank(target, store)


def test_a_checkpoint_without_the_index_loads_from_metadata(
    own: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As an older version of this library wrote it: no index folder, a manifest without its files.
    # Rank 0 and rank N-1 each load the saved values (the model's shards and Adam's state).
    import shutil

    from benchmarks.scale import runs

    target, store = own
    shutil.rmtree(target / names.INDEX_DIR)
    manifest = Manifest.from_json((target / names.MANIFEST_NAME).read_text())
    kept = [e for e in manifest.files if not e.path.startswith(names.INDEX_DIR + "/")]
    (target / names.MANIFEST_NAME).write_text(dataclasses.replace(manifest, files=kept).to_json())
    checked: list[int] = []

    def load_and_compare(target: Any, mesh: Any, rank: int, world: Any, store: Any) -> None:
        from lightning_sharded.checkpoint.load import restore_checkpoint

        saved, saved_optimizer = runs.build(mesh, 0, step=True)  # what every rank saved (seed 0)
        model, optimizer = runs.build(mesh, 1, step=False)
        for name in ("w1", "w2", "table"):  # a fresh model (seed 1) holds other values
            assert not torch.equal(getattr(saved, name).to_local(), getattr(model, name).to_local())
        restore_checkpoint(str(target), model, [optimizer], weights_only=False)
        for name in ("w1", "w2", "table"):
            expected, actual = getattr(saved, name).to_local(), getattr(model, name).to_local()
            assert torch.equal(actual, expected), (rank, name)
        for p, q in zip(saved.parameters(), model.parameters(), strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(
                    optimizer.state[q][key].to_local(), saved_optimizer.state[p][key].to_local()
                ), (rank, key)
        checked.append(rank)

    monkeypatch.setitem(runs.RUNS, ("ours", "load"), load_and_compare)
    _load_last_rank(target, store)
    assert checked == [0, SAVED - 1]


def _flat_metadata(shape: tuple[int, ...], at: int, every: int, world: int) -> tuple[Any, list[Any]]:
    """The index of a tensor kept as FSDP1 keeps a parameter: elements ``[at, at + numel)`` of a flat
    buffer cut every ``every`` elements, piece k on rank k; and its pieces ((offsets, sizes), rank)."""
    import math

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from lightning_sharded.checkpoint.flat_ranges import boxes

    numel = math.prod(shape)
    pieces = [
        ((o, s), k)
        for k in range(world)
        for o, s, _ in boxes(max(0, k * every - at), min(numel, (k + 1) * every - at), shape)
    ]
    md = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(shape),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for (o, s), _ in pieces],
    )
    storage = {
        MetadataIndex("w", torch.Size(o)): _StorageInfo(f"__{k}_0.distcp", 100 * i, 100)
        for i, ((o, _), k) in enumerate(pieces)
    }
    return Metadata({"w": md}, storage_data=storage), pieces


@pytest.mark.parametrize(
    ("shape", "at", "every", "world"),
    [
        ((8, 32), 0, 72, 4),  # cuts inside rows (FSDP1's usual case), the last rank's piece shorter
        ((8, 32), 100, 90, 4),  # the parameter starts inside rank 1's shard
        ((8, 32), 4, 160, 2),  # two ranks: one cut only
        ((3, 5, 7), 11, 23, 8),  # 3-D, cuts inside rows and planes
    ],
)
def test_a_flat_parameters_pieces_are_three_numbers(
    shape: tuple[int, ...], at: int, every: int, world: int
) -> None:
    metadata, pieces = _flat_metadata(shape, at, every, world)
    layout = rank_index.parse_layout(rank_index.layout_bytes(metadata) or b"", "layout")
    grid = layout.tensors["w"][2]
    # With two ranks only one cut is known: other numbers may describe the same pieces.
    assert grid == ["flat", at, every] if world > 2 else grid[0] == "flat"
    assert sorted(layout.boxes("w")) == sorted(pieces)
    # A rank loading its rows reads the ranks whose pieces it overlaps, found from the three numbers as
    # from the list of pieces.
    from torch.distributed.tensor import DTensor, Shard

    from benchmarks.scale.runs import fake_world
    from lightning_sharded.checkpoint.rank_index import _local_boxes, _overlap

    for loading in (1, 2, 3):
        for rank in range(loading):
            with fake_world(rank, loading) as mesh:
                value = DTensor.from_local(
                    torch.zeros(0),
                    mesh,
                    [Shard(0)],
                    run_check=False,
                    shape=torch.Size(shape),
                    stride=torch.empty(shape).stride(),
                )
                (box,) = _local_boxes(value)
                expected = sorted({k for piece, k in pieces if _overlap(piece, box)})
                assert sorted(rank_index.ranks_to_read(layout, {"w": value})) == expected, (loading, rank)


@pytest.mark.parametrize(
    "moved",
    [{1: 2, 2: 1}, {1: 2, 2: 4, 3: 6}],  # two ranks swapped; every other rank (as on a 2-D mesh's column)
    ids=["swapped", "every-other-rank"],
)
def test_pieces_that_are_not_a_flat_range_are_listed(moved: dict[int, int]) -> None:
    metadata, pieces = _flat_metadata((8, 32), 0, 72, 4)
    for index, info in list(metadata.storage_data.items()):
        rank = names.shard_rank(info.relative_path)
        assert rank is not None
        new = f"__{moved.get(rank, rank)}_0.distcp"
        metadata.storage_data[index] = dataclasses.replace(info, relative_path=new)
    layout = rank_index.parse_layout(rank_index.layout_bytes(metadata) or b"", "layout")
    assert layout.tensors["w"][2][0] == "chunks"
    assert sorted(layout.boxes("w")) == sorted((p, moved.get(k, k)) for p, k in pieces)
