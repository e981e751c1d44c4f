"""``consolidate_checkpoint`` without torch (``consolidate_direct``): the output the torch path writes, for
every layout of chunks, dtype and plain object a checkpoint holds; the checkpoints it cannot do left to
the torch path; each source byte read once and checked before anything is published."""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import io
import logging
import os
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.fabric.utilities.data import AttributeDict

from lightning_sharded import CheckpointError, consolidate_checkpoint, load_checkpoint, verify_checkpoint
from lightning_sharded.checkpoint import checksum
from lightning_sharded.checkpoint.commit import commit_directory, leftovers
from lightning_sharded.checkpoint.dcp_index import read_sharded_layout
from lightning_sharded.checkpoint.detect import detect
from lightning_sharded.checkpoint.tools import (
    archive_writer,
    consolidate_direct,
    consolidate_mapped,
    direct_copy,
    inspect_checkpoint,
)
from lightning_sharded.checkpoint.writeback import RangedWriteBehind
from tests._compare import assert_identical, assert_same
from tests.test_verify_errors import flip_bit

pytestmark = pytest.mark.usefixtures("process_group")  # ShardedTensor's chunks need a (one-rank) group


def sharded(full: torch.Tensor, pieces: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Any:
    """``full`` as a ShardedTensor of ``pieces`` ``(offsets, sizes)``, all on this rank: DCP writes a chunk
    each, as ranks' shards of any layout (rows, columns, blocks) would be."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    shards = [
        Shard(
            full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].clone(),
            ShardMetadata(list(offsets), list(sizes), "rank:0/cpu"),
        )
        for offsets, sizes in pieces
    ]
    return init_from_local_shards(shards, *full.shape)


def full_values() -> dict[str, torch.Tensor]:
    return {
        "rows": torch.arange(12 * 6, dtype=torch.float32).view(12, 6),
        "cols": torch.arange(4 * 10, dtype=torch.float32).view(4, 10) / 3,
        "grid": torch.arange(6 * 8, dtype=torch.float32).view(6, 8).to(torch.bfloat16),
        "cube": torch.arange(4 * 5 * 6, dtype=torch.float64).view(4, 5, 6),
        "exp_avg": torch.linspace(-1, 1, 12 * 6).view(12, 6),
    }


def save(path: Path, meta: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
    """A sharded checkpoint (with its manifest) of chunks of every layout, plain tensors of every common
    dtype, an optimizer, and ``meta`` as ``meta.pt``."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    full = full_values()
    state: dict[str, Any] = {
        "state_dict": {
            "rows": sharded(full["rows"], [((0, 0), (5, 6)), ((5, 0), (7, 6))]),  # FSDP's: whole rows
            "cols": sharded(full["cols"], [((0, 0), (4, 3)), ((0, 3), (4, 7))]),  # tensor parallel's columns
            "grid": sharded(full["grid"], [((r, c), (3, 4)) for r in (0, 3) for c in (0, 4)]),  # blocks
            "cube": sharded(full["cube"], [((0, 0, 0), (4, 2, 6)), ((0, 2, 0), (4, 3, 6))]),  # a middle dim
            "plain": torch.randn(3, 3),
            "step": torch.tensor(7),
            "empty": torch.empty(0, 4, dtype=torch.float16),
            "mask": torch.tensor([True, False, True]),
            **{
                str(d).removeprefix("torch."): torch.arange(5).to(d)
                for d in (torch.int32, torch.uint8, torch.int8)
            },
            "short": torch.arange(5, dtype=torch.int16),
            **(extra or {}),
        },
        "optimizer_0": {
            "state": {
                "rows": {
                    "exp_avg": sharded(full["exp_avg"], [((0, 0), (6, 6)), ((6, 0), (6, 6))]),
                    "step": torch.tensor(3.0),
                }
            },
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["rows"]}],
        },
    }

    def write(staging: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            _save_state_dict(state, FileSystemWriter(staging), no_dist=True)
        torch.save(meta, staging / "meta.pt")

    commit_directory(
        path, write, metadata={"epoch": meta.get("epoch"), "global_step": meta.get("global_step")}
    )
    return path


def lightning_meta() -> dict[str, Any]:
    """What Lightning's meta.pt holds beyond numbers: hyperparameters, callbacks' scores (tensors)..."""
    return {
        "epoch": 2,
        "global_step": 7,
        "hyper_parameters": AttributeDict(lr=0.1, cfg=AttributeDict(betas=(0.9, 0.99)), layers=[4, 8]),
        "args": argparse.Namespace(seed=1, name="run"),
        "data_dir": Path("/data/train"),
        "callbacks": {
            "ModelCheckpoint": {"best_model_score": torch.tensor(0.25), "kth": torch.tensor([1.0, 2.0])}
        },
        "misc": {"raw": b"\x00\xff", "ids": {1, 2}, "od": collections.OrderedDict(a=1), "nan": float("nan")},
        "nested": [1, (2.5, None), {"k": "v"}, True],
    }


def consolidate_both(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any
) -> tuple[Path, Path]:
    """``src`` consolidated without torch (checked: the torch path is not called), then through torch."""
    direct, through = tmp_path / "direct.ckpt", tmp_path / "through-torch.ckpt"
    with monkeypatch.context() as m:
        m.setattr(consolidate_mapped, "consolidate", None)  # called: a TypeError
        consolidate_checkpoint(src, direct, progress=False, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(consolidate_direct, "plan", lambda found, out: "through torch, as the test asks")
        consolidate_checkpoint(src, through, progress=False, **kwargs)
    return direct, through


def test_the_output_is_the_torch_path_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save(tmp_path / "ckpt", lightning_meta())
    plan = consolidate_direct.plan(detect(src), tmp_path / "x.ckpt")
    assert isinstance(plan, consolidate_direct.Plan), plan
    scattered = [s for _, _, segments in plan.files.values() for s in segments if len(s.outs) > 1]
    assert scattered, "no chunk was written in runs of rows: the layouts above did not reach them"
    read_back: list[int] = []  # the records whose CRC-32 is read back from the output
    real = archive_writer._read_crc
    monkeypatch.setattr(
        archive_writer, "_read_crc", lambda fd, start, size: read_back.append(start) or real(fd, start, size)
    )
    direct, through = consolidate_both(src, tmp_path, monkeypatch)
    starts = {s.storage: plan.layout.storages[s.storage].start for s in scattered}
    assert sorted(read_back) == sorted(starts.values())  # the others' from the copy's pieces
    for out in (direct, through):
        with zipfile.ZipFile(out) as archive:
            assert archive.testzip() is None  # every record's CRC-32, those read back included
    assert_identical(torch.load(direct, weights_only=False), torch.load(through, weights_only=False))
    assert_identical(
        torch.load(direct, weights_only=False, mmap=True), torch.load(through, weights_only=False)
    )
    loaded = load_checkpoint(direct)  # the tools' safe load reads it (Lightning's globals only)
    for key, value in full_values().items():
        state = loaded["optimizer_states"][0]["state"][0] if key == "exp_avg" else loaded["state_dict"]
        assert torch.equal(state[key if key != "exp_avg" else "exp_avg"], value), key
    assert type(loaded["hyper_parameters"]) is AttributeDict


def shard_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes each read of a shard file by the copy returns, from now on."""
    read: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: Any, offset: int) -> int:
        n = real(fd, buffers, offset)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):  # not the small files verify reads
            read.append(n)
        return n

    monkeypatch.setattr(direct_copy.os, "preadv", counting)
    return read


def test_each_shard_byte_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save(tmp_path / "ckpt", {"epoch": 0})
    shards = sum(p.stat().st_size for p in src.glob("*.distcp"))
    read = shard_reads(monkeypatch)
    monkeypatch.setattr(checksum, "_SPLIT_FROM", 1)  # the shard in two parts, read at once
    consolidate_checkpoint(src, tmp_path / "full.ckpt", progress=False)
    assert sum(read) == shards  # the entries' heads and tails, read to plan, are small reads (pread)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda meta, extra: meta.update(z=complex(1, 2)), "meta.pt holds more than plain data"),
        (lambda meta, extra: extra.update(c=torch.ones(2, dtype=torch.complex64)), "is torch.complex64"),
        (lambda meta, extra: meta.update(device=torch.device("cpu")), "meta.pt holds more than plain data"),
        (lambda meta, extra: meta.update(view=torch.arange(4.0)[1:]), "meta.pt holds more than plain data"),
    ],
    ids=["complex", "complex-tensor", "device", "tensor-view"],
)
def test_what_needs_torch_is_left_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any, why: str
) -> None:
    meta: dict[str, Any] = {"epoch": 0}
    extra: dict[str, Any] = {}
    change(meta, extra)
    src = save(tmp_path / "ckpt", meta, extra)
    reason = consolidate_direct.plan(detect(src), tmp_path / "x.ckpt")
    assert isinstance(reason, str) and why in reason, reason
    out = consolidate_checkpoint(src, tmp_path / "full.ckpt", progress=False, weights_only=False)
    assert_same(
        load_checkpoint(out, weights_only=False)["state_dict"],
        load_checkpoint(src, weights_only=False)["state_dict"],
    )


@pytest.mark.parametrize(
    ("moved", "why"),
    [
        ((6, 0), "a chunk at [6, 0] of size [7, 6] lies outside its size [12, 6]"),
        ((5,), "a chunk at [5] of size [7, 6] lies outside its size [12, 6]"),
        ((4, 0), "the chunks at [0, 0] and [4, 0] overlap"),
    ],
    ids=["past-the-end", "fewer-dims", "overlapping"],
)
def test_an_index_whose_chunks_do_not_tile_a_tensor_is_refused(
    tmp_path: Path, moved: tuple[int, ...], why: str
) -> None:
    """A chunk the index places past the tensor's end (its count of elements still the tensor's), with
    fewer dimensions, or over another (leaving the last row in none): the copy without torch declines
    before copying anything (it would write a chunk over its neighbour's bytes), and the torch path,
    which would leave the uncovered row as the memory held it, refuses the index, naming the tensor. A
    checkpoint without a manifest (stock Lightning's), whose damage no checksum finds."""
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    src = save(tmp_path / "ckpt", {"epoch": 0})
    (src / "lightning_sharded.json").unlink()
    index = src / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    rows = metadata.state_dict_metadata["state_dict.rows"]
    chunk = rows.chunks[1]  # rows 5-11 of 12
    rows.chunks[1] = ChunkStorageMetadata(offsets=torch.Size(moved), sizes=chunk.sizes)
    stored = {k: v for k, v in metadata.storage_data.items() if k.fqn == "state_dict.rows"}
    for key, info in stored.items():
        if tuple(key.offset) == tuple(chunk.offsets):
            del metadata.storage_data[key]
            metadata.storage_data[MetadataIndex("state_dict.rows", torch.Size(moved), key.index)] = info
    index.write_bytes(pickle.dumps(metadata))
    reason = consolidate_direct.plan(detect(src), tmp_path / "x.ckpt")
    assert isinstance(reason, str) and reason == f"for the tensor 'state_dict.rows', {why}", reason
    with pytest.raises(
        CheckpointError, match=r"\.metadata.* is damaged: for the tensor 'state_dict\.rows'"
    ) as err:
        consolidate_checkpoint(src, tmp_path / "full.ckpt", progress=False)
    assert why in str(err.value) and not (tmp_path / "full.ckpt").exists()
    # Every other reader of the index refuses it alike: a load in one process, inspect, verify, and the
    # layout a strategy's resume of a checkpoint without a manifest plans with.
    for reader in (load_checkpoint, inspect_checkpoint, verify_checkpoint, read_sharded_layout):
        try:
            reader(src)
        except CheckpointError as error:
            message = str(error)
            assert f"is damaged: for the tensor 'state_dict.rows', {why}" in message, (
                reader.__name__,
                message,
            )
        else:
            pytest.fail(f"{reader.__name__} read the damaged index without an error")


def test_a_type_a_safe_load_refuses_is_refused_as_before(tmp_path: Path) -> None:
    # A frozenset is plain data, but torch's safe load refuses it: the torch path's refusal, not an output.
    src = save(tmp_path / "ckpt", {"epoch": 0, "tags": frozenset({"a"})})
    assert "meta.pt" in str(consolidate_direct.plan(detect(src), tmp_path / "x.ckpt"))
    with pytest.raises(CheckpointError, match="frozenset"):
        consolidate_checkpoint(src, tmp_path / "full.ckpt", progress=False)
    assert not (tmp_path / "full.ckpt").exists()


def test_a_damaged_chunk_fails_before_publishing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save(tmp_path / "ckpt", {"epoch": 0})
    (shard,) = src.glob("*.distcp")
    cols = full_values()["cols"][:, 3:].contiguous().numpy().tobytes()  # the second chunk of "cols"
    at = shard.read_bytes().find(cols)
    assert at > 0
    flip_bit(shard, at + 5)
    dst = tmp_path / "full.ckpt"
    dst.write_bytes(b"the previous output")
    with pytest.raises(CheckpointError, match=r"is corrupted: its crc32 is .*Nothing was written at"):
        consolidate_checkpoint(src, dst, progress=False, overwrite=True)
    assert dst.read_bytes() == b"the previous output" and leftovers(dst) == []
    # Without verify, the damaged value is copied, as the torch path copies it.
    direct, through = consolidate_both(src, tmp_path, monkeypatch, verify=False)
    assert_identical(torch.load(direct, weights_only=True), torch.load(through, weights_only=True))
    assert not torch.equal(torch.load(direct, weights_only=True)["state_dict"]["cols"], full_values()["cols"])


def failing_third_piece(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The copy's third chunk piece fails to be written (``EIO``); the offsets of the pieces tried."""
    place, placed = direct_copy.pwrite_all, []

    def failing(fd: int, data: Any, offset: int) -> None:
        placed.append(offset)
        if len(placed) < 3:
            return place(fd, data, offset)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(direct_copy, "pwrite_all", failing)
    return placed


def test_a_failed_write_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save(tmp_path / "ckpt", {"epoch": 0})
    dst = tmp_path / "full.ckpt"
    dst.write_bytes(b"the previous output")
    # The fault comes mid-copy: after the archive's frame and two chunk pieces are written.
    placed = failing_third_piece(monkeypatch)
    with pytest.raises(
        OSError, match=r"^Input/output error \(EIO\): saving the checkpoint '.*full\.ckpt' failed"
    ):
        consolidate_checkpoint(src, dst, overwrite=True, progress=False)
    assert len(placed) >= 3, placed  # the copy had begun
    assert dst.read_bytes() == b"the previous output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "full.ckpt"]  # no staged leftover


def test_the_output_is_written_behind(droppable: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before the copy ends, most of the output has left the page cache: it does not take its size in memory.
    from tests._pages import resident

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    src = save(
        droppable / "ckpt", {"epoch": 0}, {f"w{i}": p.detach() for i, p in enumerate(model.parameters())}
    )
    seen: list[float] = []
    finish = RangedWriteBehind.finish

    def measured(self: Any) -> None:
        seen.append(resident(Path(f"/proc/self/fd/{self._fd}")))
        finish(self)

    monkeypatch.setattr(direct_copy, "WINDOW", 1 << 20)
    monkeypatch.setattr(direct_copy, "BLOCK", 1 << 20)
    monkeypatch.setattr(RangedWriteBehind, "finish", measured)
    out = consolidate_checkpoint(src, droppable / "full.ckpt", progress=False)
    assert out.stat().st_size > 8 << 20
    assert seen and seen[0] < 0.5, seen


def test_zip64_archives_load_in_torch(tmp_path: Path) -> None:
    # Over 4 GiB, sizes and offsets go to zip64 fields: a sparse 4.5 GiB storage, never written.
    big = archive_writer.Tensor("big", (9 << 29,), "bool")  # 4.5 GiB
    after = archive_writer.Tensor(
        "after", (3,), "float32", data=torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes()
    )
    data_pkl, tensors = archive_writer.pickle_with_tensors({"big": big, "after": after})
    layout = archive_writer.layout(data_pkl, tensors)
    file = tmp_path / "big.pt"
    fd = os.open(file, os.O_RDWR | os.O_CREAT)
    try:
        layout.write_frame(fd)
        os.pwrite(fd, b"\x01", layout.storages[0].start + (9 << 29) - 1)
    finally:
        os.close(fd)
    assert all(record.start % archive_writer.ALIGNMENT == 0 for record in layout.storages)
    with zipfile.ZipFile(file) as archive:
        sizes = {info.filename: info.file_size for info in archive.infolist()}
    assert sizes["archive/data/0"] == 9 << 29 and sizes["archive/data/1"] == 12
    loaded = torch.load(file, mmap=True, weights_only=True)
    assert loaded["big"].shape == (9 << 29,) and bool(loaded["big"][-1]) and not bool(loaded["big"][0])
    assert torch.equal(loaded["after"], torch.tensor([1.0, 2.0, 3.0]))


@given(
    data=st.binary(min_size=1, max_size=20000),
    cut=st.tuples(st.integers(0, 20000), st.integers(0, 20000)),
    steps=st.lists(
        st.tuples(
            st.integers(-9000, 20000),
            st.sampled_from([io.SEEK_SET, io.SEEK_CUR, io.SEEK_END]),
            st.integers(-1, 9000),
        ),
        max_size=8,
    ),
)
@settings(max_examples=100, deadline=None)
def test_an_entry_reads_as_a_file_of_its_own(
    tmp_path_factory: pytest.TempPathFactory,
    data: bytes,
    cut: tuple[int, int],
    steps: list[tuple[int, int, int]],
) -> None:
    """An entry of a shard file (the bytes torch.load reads as its own file: head and tail held, the
    middle read when asked) seeks and reads as ``io.BytesIO`` of the same bytes, past its end included."""
    from lightning_sharded.checkpoint.tools.direct_copy import _Entry

    offset = min(cut[0], len(data))
    length = min(cut[1], len(data) - offset)
    path = tmp_path_factory.mktemp("entry") / "shard"
    path.write_bytes(data)
    same = io.BytesIO(data[offset : offset + length])
    fd = os.open(path, os.O_RDONLY)
    try:
        entry = _Entry(fd, offset, length)
        for position, whence, size in steps:
            if (
                same.tell() if whence == io.SEEK_CUR else length if whence == io.SEEK_END else 0
            ) + position < 0:
                continue  # a seek before the start: BytesIO refuses it
            assert entry.seek(position, whence) == same.seek(position, whence)
            assert entry.read(size) == same.read(size) and entry.tell() == same.tell()
            ours, theirs = bytearray(max(size, 0)), bytearray(max(size, 0))
            assert entry.readinto(ours) == same.readinto(theirs) and ours == theirs
    finally:
        os.close(fd)


def record_bars(monkeypatch: pytest.MonkeyPatch, *modules: Any) -> list[tuple[int, list[int]]]:
    """Every progress bar the ``modules`` open from now on: its total and the bytes it was advanced by."""
    bars: list[tuple[int, list[int]]] = []

    @contextlib.contextmanager
    def counting(total: int, progress: bool | None, desc: str) -> Iterator[Callable[[int], None]]:
        bars.append((total, []))
        yield bars[-1][1].append

    for module in modules:
        monkeypatch.setattr(module, "progress_bar", counting)
    return bars


def test_both_paths_count_every_tensor_byte_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The progress bar of a consolidation ends at its total: the shard files' bytes, which a verified
    copy without torch reads whole, or the tensors' bytes, which the torch path fills. The closing log
    line gives the tensors' bytes on both."""
    from lightning_sharded.checkpoint.progress import format_size
    from lightning_sharded.checkpoint.tools import direct_copy

    bars = record_bars(monkeypatch, direct_copy, consolidate_mapped)
    src = save(tmp_path / "ckpt", lightning_meta())
    with caplog.at_level(logging.INFO, logger="lightning_sharded"):
        consolidate_both(src, tmp_path, monkeypatch)
    state = torch.load(tmp_path / "direct.ckpt", weights_only=False)
    tensors = [*state["state_dict"].values(), *state["optimizer_states"][0]["state"][0].values()]
    expected = sum(t.numel() * t.element_size() for t in tensors)
    shards = sum(p.stat().st_size for p in src.glob("*.distcp"))
    assert [(total, sum(ticks)) for total, ticks in bars] == [(shards, shards), (expected, expected)]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Consolidated")]
    assert len(logged) == 2 and all(f"({format_size(expected)} of tensors)" in line for line in logged), (
        logged
    )


def test_the_torch_path_leaves_no_scratch_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path's unbacked tensors live in a sparse temporary file the size of every tensor: gone
    once the output is written, as after a failed one."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    src = save(tmp_path / "ckpt", lightning_meta())
    made: list[str] = []
    real = tempfile.mkstemp

    def recording(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, name = real(*args, **kwargs)
        made.append(name)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", recording)
    monkeypatch.setattr(consolidate_direct, "plan", lambda found, out: "through torch, as the test asks")
    consolidate_checkpoint(src, tmp_path / "full.ckpt", progress=False)
    assert made and all(Path(name).parent == scratch for name in made)  # the scratch file was made here
    assert list(scratch.iterdir()) == []
    monkeypatch.setattr(torch, "save", mock.Mock(side_effect=OSError(28, "No space left on device")))
    with pytest.raises(CheckpointError):
        consolidate_checkpoint(src, tmp_path / "failed.ckpt", progress=False)
    assert list(scratch.iterdir()) == []


def test_a_trainable_only_checkpoint_consolidates_with_its_frozen_part_and_its_bar_ends_at_its_total(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint that holds the trainable weights only consolidates (through torch) into a complete
    one, its frozen part read from the source the manifest names; the progress bar counts those bytes
    too, so it ends at its total."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    from lightning_sharded.checkpoint.manifest import FrozenPart

    base = {"w": torch.arange(64.0).view(8, 8), "b": torch.ones(8)}
    save_file(base, str(tmp_path / "base.safetensors"))
    head = torch.linspace(0, 1, 16).view(2, 8)

    def write(staging: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            _save_state_dict({"state_dict": {"head": head}}, FileSystemWriter(staging), no_dist=True)
        torch.save({"epoch": 1, "global_step": 4}, staging / "meta.pt")

    frozen = FrozenPart(str(tmp_path / "base.safetensors"), ("base.b", "base.w"), "base.")
    commit_directory(tmp_path / "lora", write, metadata={"epoch": 1, "global_step": 4}, frozen=frozen)
    bars = record_bars(monkeypatch, consolidate_mapped)
    out = consolidate_checkpoint(tmp_path / "lora", tmp_path / "full.ckpt", progress=True)
    state = torch.load(out, weights_only=True)["state_dict"]
    assert sorted(state) == ["base.b", "base.w", "head"]
    assert torch.equal(state["base.w"], base["w"]) and torch.equal(state["base.b"], base["b"])
    assert torch.equal(state["head"], head)
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert [(t, sum(ticks)) for t, ticks in bars] == [(total, total)]
