"""DirectReader: tensors read straight into their targets equal what torch's own reader loads, and the
pages they were read through leave the page cache unless another rank reads the same bytes."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from lightning_sharded.checkpoint.backends.dcp_reader import (
    DirectReader,
    _readinto,
    _storage_location,
)
from lightning_sharded.checkpoint.backends.dcp_writer import ChecksummingWriter
from lightning_sharded.checkpoint.integrity import ReadChecksums
from tests._pages import resident
from tests.distributed.launch import run_ranks

MiB = 1 << 20
# The largest page-cache folio (a PMD: 2 MiB with 4 KiB pages): the kernel drops only whole folios.
EDGE = 2 * MiB


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    return {
        "big": torch.randn(1024, 512),  # 2 MiB: read directly
        "half": torch.randn(1024, 512).to(torch.bfloat16),  # 1 MiB, another dtype
        "view": torch.randn(2048, 512)[::2],  # a strided view: torch's path
        "small": torch.arange(7.0),
        "step": torch.tensor(5.0),
        "meta": {"epoch": 3, "name": "x"},
    }


def _load(path: Path, reader: object | None) -> dict[str, object]:
    out: dict[str, object] = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"epoch": 0, "name": ""}
        for k, v in _state().items()
    }
    if reader is None:
        dcp.load(out, checkpoint_id=path, no_dist=True)
    else:
        dcp.load(out, storage_reader=reader, no_dist=True)  # type: ignore[arg-type]
    return out


def test_direct_reads_equal_torch_reads(tmp_path: Path) -> None:
    for crc in (False, True):
        path = tmp_path / f"crc{crc}"
        writer = ChecksummingWriter(path, thread_count=2, torch_crc32=crc)
        dcp.save(_state(), storage_writer=writer, no_dist=True)
        ours, theirs = _load(path, DirectReader(path)), _load(path, None)
        for key, value in _state().items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(ours[key], value) and torch.equal(theirs[key], value), key  # type: ignore[arg-type]
            else:
                assert ours[key] == value


def test_a_record_that_is_not_the_target_s_bytes_goes_through_torch_s_path(tmp_path: Path) -> None:
    """A saved tensor whose record is not the target's bytes as they lie (a transposed view that DCP
    saves with its strides, float16 into a bfloat16 target of the same size) is read by torch's path,
    which lays it out and casts it: a straight read would fill the target with the record's bytes."""
    torch.manual_seed(0)
    state = {"transposed": torch.randn(512, 1024).t(), "cast": torch.randn(1024, 512).half()}
    dcp.save(state, storage_writer=ChecksummingWriter(tmp_path), no_dist=True)
    out = {"transposed": torch.zeros(1024, 512), "cast": torch.zeros(1024, 512, dtype=torch.bfloat16)}
    dcp.load(out, storage_reader=DirectReader(tmp_path), no_dist=True)
    assert torch.equal(out["transposed"], state["transposed"])
    assert torch.equal(out["cast"], state["cast"].to(torch.bfloat16))


def test_storage_record_is_found_and_checked(tmp_path: Path) -> None:
    tensor = torch.randn(512, 512)
    file = tmp_path / "one.pt"
    torch.save(tensor, file)
    nbytes = tensor.numel() * 4
    with open(file, "rb", buffering=0) as f:
        length = file.stat().st_size
        offset = _storage_location(f, 0, length, nbytes)
        assert offset is not None
        f.seek(offset)
        assert f.read(16) == tensor.numpy().tobytes()[:16]
        assert _storage_location(f, 0, length, nbytes - 4) is None  # a size that does not fit


def test_direct_reads_go_through_two_streams_and_commit_in_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_sharded.checkpoint.backends import dcp_reader

    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(512, 1024) for i in range(8)}  # 2 MiB each: all read directly
    dcp.save(state, storage_writer=ChecksummingWriter(tmp_path, thread_count=1), no_dist=True)
    readers: dict[str, str] = {}
    real = dcp_reader._readinto

    def recording(
        file: object, offset: int, target: torch.Tensor, crc: bool = False, drop: bool = False
    ) -> tuple[bool, int]:
        readers[str(offset)] = threading.current_thread().name  # unique, where an ident can be reused
        return real(file, offset, target, crc, drop)

    monkeypatch.setattr(dcp_reader, "_readinto", recording)
    out = {key: torch.zeros_like(value) for key, value in state.items()}
    committers: set[int] = set()

    class Planner(DefaultLoadPlanner):
        def commit_tensor(self, read_item: object, tensor: torch.Tensor) -> None:
            committers.add(threading.get_ident())

    dcp.load(out, storage_reader=DirectReader(tmp_path), planner=Planner(), no_dist=True)
    assert all(torch.equal(out[key], state[key]) for key in state)
    assert len(readers) == 8 and len(set(readers.values())) == 2
    assert committers == {threading.get_ident()}


def test_checksums_of_direct_reads_are_those_of_the_bytes_in_the_file(tmp_path: Path) -> None:
    import zlib

    from lightning_sharded.checkpoint import read_manifest
    from lightning_sharded.checkpoint.checksum import file_checksum, ranges_checksum
    from lightning_sharded.checkpoint.commit import commit_directory

    def write(staging: Path) -> None:
        dcp.save(_state(), storage_writer=ChecksummingWriter(staging), no_dist=True)

    path = tmp_path / "ckpt"
    commit_directory(path, write)
    checksums = ReadChecksums()
    ours = _load(path, DirectReader(path, checksums=checksums))
    assert torch.equal(ours["big"], _state()["big"])  # type: ignore[arg-type]
    # "big", "half" and "view" (stored as a whole tensor) are read directly, one range each; the small
    # ones and the dict are not.
    assert sum(len(ranges) for ranges in checksums.ranges.values()) == 3
    manifest = read_manifest(path)
    assert manifest is not None
    for relative, ranges in checksums.ranges.items():
        data = (path / relative).read_bytes()
        for offset, length, crc in ranges:
            assert length in (2 << 20, 1 << 20) and crc == zlib.crc32(data[offset : offset + length])
        entry = next(e for e in manifest.files if e.path == relative)
        assert ranges_checksum(path / relative, entry.size, ranges) == file_checksum(path / relative)
        assert file_checksum(path / relative)[1] == entry.checksum
    assert sum(checksums.covered().values()) == 5 << 20


def test_a_direct_read_drops_the_pages_it_read_and_only_those(droppable: Path) -> None:
    file = droppable / "three"
    data = os.urandom(24 * MiB + 123)
    with open(file, "wb") as f:  # on disk (a dirty page is not dropped), and cached: as just saved
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    file.read_bytes()
    # Not aligned: the large folios (up to EDGE) it shares with its neighbours stay cached.
    start, nbytes = 8 * MiB + 123, 8 * MiB
    target = torch.empty(nbytes, dtype=torch.uint8)
    with open(file, "rb", buffering=0) as f:
        whole, _ = _readinto(f, start, target, drop=True)
    assert whole and target.numpy().tobytes() == data[start : start + nbytes]
    assert resident(file, start + EDGE, start + nbytes - EDGE) == 0
    assert resident(file, 0, start) == 1.0 and resident(file, start + nbytes) == 1.0
    with open(file, "rb", buffering=0) as f:
        _readinto(f, 0, torch.empty(4 * MiB, dtype=torch.uint8))  # without drop: left cached
    assert resident(file, 0, 4 * MiB) == 1.0


def test_what_only_one_rank_reads_leaves_the_cache_what_two_read_stays(droppable: Path) -> None:
    """Two ranks: each reads its half of a sharded tensor and both the replicated one, saved once. A
    rank dropping the replicated tensor's pages would make the other read them from the disk again."""
    script = Path(__file__).parent / "distributed" / "read_behind_script.py"
    out = droppable / "cached.json"
    run_ranks(script, 2, str(droppable / "ckpt"), str(out), timeout=120)
    report = json.loads(out.read_text())
    assert report["equal"] == [True, True]
    cached = {(chunk["key"], i): chunk["cached"] for i, chunk in enumerate(report["chunks"])}
    assert sorted(key for key, _ in cached) == ["replicated", "sharded", "sharded"]
    for (key, _), (whole, inside) in cached.items():
        if key == "replicated":
            assert whole == 1.0, cached
        else:
            assert inside == 0, cached


def test_a_file_checksum_reads_each_byte_once_in_two_streams_and_drops_the_cache_behind(
    droppable: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `verify` and the completion of a verified load read: a large file in two contiguous parts
    # at once, each byte once, the pages read leaving the page cache (a checksum reads them once).
    import zlib

    from lightning_sharded.checkpoint import checksum

    file = droppable / "shard"
    data = os.urandom(70 * MiB + 5)  # above the size split in two streams
    with open(file, "wb") as f:  # on disk and cached, as just saved
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    reads: list[tuple[int, int, str]] = []
    preadv = os.preadv

    def spy(fd: int, buffers: list[memoryview], offset: int) -> int:
        n = preadv(fd, buffers, offset)
        reads.append((offset, n, threading.current_thread().name))
        return n

    monkeypatch.setattr(checksum.os, "preadv", spy)
    assert checksum.file_checksum(file) == (len(data), f"{zlib.crc32(data):08x}")
    position = 0
    for offset, n, _ in sorted(reads):
        assert offset == position
        position += n
    assert position == len(data)
    assert len({name for _, _, name in reads}) == checksum.STREAMS == 2
    # Only the large folios at the two parts' ends may stay.
    assert resident(file) <= 3 * EDGE / len(data)
    known = [(MiB, 4 * MiB, zlib.crc32(data[MiB : 5 * MiB]))]
    reads.clear()
    assert checksum.ranges_checksum(file, len(data), known) == (len(data), f"{zlib.crc32(data):08x}")
    assert sum(n for _, n, _ in reads) == len(data) - 4 * MiB  # the known range is not read
