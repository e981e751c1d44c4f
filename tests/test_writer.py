"""The checksumming DCP writer and the atomic commit that takes its checksums instead of reading back."""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

from lightning_sharded.checkpoint import read_manifest
from lightning_sharded.checkpoint.backends.dcp_writer import ChecksummingWriter
from lightning_sharded.checkpoint.checksum import crc32, crc32_combine, file_checksum, ranges_checksum
from lightning_sharded.checkpoint.commit import commit_directory


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    # Large enough for the hashing thread path (>= 1 MiB writes) and small ones for the inline path.
    return {"big": torch.randn(512, 1024), "small": torch.arange(7), "scalar": torch.tensor(3.5)}


def test_checksums_equal_a_read_back(tmp_path: Path) -> None:
    writer = ChecksummingWriter(tmp_path / "ckpt")
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert sorted(writer.checksums) == files  # the shard(s) and .metadata, no temporary name
    for name, figures in writer.checksums.items():
        assert file_checksum(tmp_path / "ckpt" / name) == figures


def test_the_index_holds_no_path_so_its_size_does_not_depend_on_where(tmp_path: Path) -> None:
    """The writer writes into a staging directory that is renamed at publish: ``.metadata`` records no
    ``checkpoint_id`` (it would name that directory), and the same state gives an index of one size
    wherever it is written (the documented sessions show sizes)."""
    from lightning_sharded.checkpoint.backends import LocalBackend
    from lightning_sharded.checkpoint.dcp_index import read_index

    sizes = []
    for where in (tmp_path / "a", tmp_path / "a-much-longer-folder-name" / "below"):
        dcp.save(_state(), storage_writer=ChecksummingWriter(where), no_dist=True)
        index = read_index(LocalBackend(), where, weights_only=True)
        assert index.storage_meta.checkpoint_id is None and index.storage_meta.save_id
        sizes.append((where / ".metadata").stat().st_size)
    assert sizes[0] == sizes[1]


def _record_crcs(archive: Path | bytes) -> list[int]:
    """The CRC-32 fields of a ``torch.save`` archive's data records (0 where torch computed none)."""
    import io
    import zipfile

    source = io.BytesIO(archive) if isinstance(archive, bytes) else archive
    with zipfile.ZipFile(source) as zf:
        return [info.CRC for info in zf.infolist() if "/data/" in info.filename and info.file_size]


def _shard_crcs(directory: Path) -> list[int]:
    shards = sorted(directory.glob("*.distcp"))
    assert shards
    # A shard is torch.save archives back to back (one per item); the first one's records are enough.
    data = shards[0].read_bytes()
    end = data.find(b"PK\x05\x06")  # the first archive's end of central directory
    return _record_crcs(data[: end + 22])


@pytest.mark.parametrize("thread_count", [1, 2])
def test_the_shards_carry_no_torch_crc_and_the_setting_is_never_the_process_s(
    tmp_path: Path, thread_count: int
) -> None:
    """The writer's shard archives skip torch.save's per-record CRC-32 (the manifest's covers them) on
    every writer thread; the setting is the writer's own: after the save, and during it for code that is
    not the writer's (a Stateful's ``state_dict`` that torch.saves), torch.save writes CRC records.

    Failed before: the save set torch's global ``compute_crc32=False`` around the whole ``dcp.save`` (a
    user ``state_dict`` called in that window wrote records without CRC), and DCP's extra writer threads
    (``thread_count=2``) did not see it (their shards carried CRC records)."""
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.utils.serialization import config

    from lightning_sharded.checkpoint.save import write_sharded_checkpoint

    class Saves(Stateful):  # a user's object whose state_dict serializes with torch.save
        archive = b""

        def state_dict(self) -> dict[str, Any]:
            import io

            buffer = io.BytesIO()
            torch.save({"t": torch.arange(64.0)}, buffer)
            Saves.archive = buffer.getvalue()
            return {"x": torch.arange(3.0)}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    import lightning_sharded.checkpoint.save as save_module

    before = config.save.compute_crc32
    real = save_module.WRITER_THREADS
    save_module.WRITER_THREADS = thread_count
    try:
        state = {"model": {**_state(), "extra": torch.randn(300, 300)}, "user": Saves()}
        write_sharded_checkpoint(tmp_path / "ckpt", state, {"global_step": 1}, rank=0)
    finally:
        save_module.WRITER_THREADS = real
    assert config.save.compute_crc32 == before is True
    assert Saves.archive and all(_record_crcs(Saves.archive)), "a user torch.save in the save lost its CRC"
    assert not any(_shard_crcs(tmp_path / "ckpt")), "the writer's shards carry torch's CRC records"
    loaded = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp.load({"model": loaded}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in _state().items())


def test_a_user_torch_save_during_an_async_save_keeps_its_crc(tmp_path: Path) -> None:
    """A ``torch.save`` on the training thread while an async save writes (in its background thread)
    writes an archive with CRC-32 records: the writer's choice never reaches another thread. (On torch
    2.13 to 2.15 the old global switch did not either, as torch keeps the setting in a context variable;
    the test holds that for the writer's per-file scope.)"""
    from torch.utils.serialization import config

    from lightning_sharded.checkpoint.async_save import AsyncSaver
    from lightning_sharded.checkpoint.backends import dcp_writer
    from lightning_sharded.checkpoint.save import write_sharded_checkpoint

    inside, release = threading.Event(), threading.Event()
    real = dcp_writer.HashingStream.write

    def write_in_the_middle(self: Any, b: Any) -> int:
        if threading.current_thread() is not threading.main_thread() and not inside.is_set():
            assert config.save.compute_crc32 is False  # the writer's own file: no torch CRC
            inside.set()
            release.wait(30)
        return real(self, b)

    saver = AsyncSaver("crc-test")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dcp_writer.HashingStream, "write", write_in_the_middle)
        saver.save(
            tmp_path / "ckpt",
            {"model": _state()},
            lambda path, staged, group: write_sharded_checkpoint(path, staged, {"global_step": 1}, rank=0),
        )
        try:
            assert inside.wait(30), "the background save never started writing a shard"
            torch.save({"w": torch.arange(100.0)}, tmp_path / "user.pt")  # the training thread, meanwhile
        finally:
            release.set()
            saver.wait()
            saver.close()
    crcs = _record_crcs(tmp_path / "user.pt")
    assert crcs and all(crcs), "the user's archive was written without CRC-32 records"
    assert not any(_shard_crcs(tmp_path / "ckpt"))


def test_commit_uses_known_checksums_and_reads_back_the_rest(tmp_path: Path) -> None:
    def write(staging: Path) -> dict[str, tuple[int, str]]:
        writer = ChecksummingWriter(staging)
        dcp.save(_state(), storage_writer=writer, no_dist=True)
        torch.save({"epoch": 1}, staging / "meta.pt")  # not in the known figures: read back
        known = writer.checksums
        known["extra.bin"] = (1, "00000000")  # a wrong size: not trusted, read back instead
        (staging / "extra.bin").write_bytes(b"ab")
        return known

    target = tmp_path / "ckpt"
    commit_directory(target, write)
    manifest = read_manifest(target)
    assert {e.path for e in manifest.files} >= {".metadata", "meta.pt", "extra.bin"}
    for entry in manifest.files:
        assert file_checksum(target / entry.path) == (entry.size, entry.checksum), entry.path


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_error_in_any_writer_thread_fails_the_save(tmp_path: Path, monkeypatch: Any) -> None:
    """torch's extra writer threads only print their errors; ours must raise (else a corrupt publish)."""
    from lightning_sharded.checkpoint import checksum as writer_module

    original = writer_module.HashingStream.write

    def write(self: Any, b: Any) -> int:
        if threading.current_thread() is not threading.main_thread() and len(memoryview(b)) > 1024:
            raise OSError(28, "No space left on device (injected)")
        return original(self, b)

    monkeypatch.setattr(writer_module.HashingStream, "write", write)
    state = {"a": torch.randn(256, 256), "b": torch.randn(256, 256)}
    # torch.save inside the thread turns our OSError into its own RuntimeError: any error will do, as
    # long as the save fails instead of publishing an index that points at bytes never written.
    with pytest.raises(BaseException, match=r"writer|No space|unexpected pos"):
        dcp.save(state, storage_writer=ChecksummingWriter(tmp_path / "c", thread_count=2), no_dist=True)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_write_that_fails_in_one_writer_thread_raises_its_own_error_naming_its_file(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """One file of two failing in torch's extra writer thread: the save raises that write's
    ``OSError`` (its errno, the file's path), not a stand-in."""
    from lightning_sharded.checkpoint import checksum as writer_module

    original = writer_module.HashingStream._write
    failing: list[str] = []

    class Full:
        def write(self, view: Any) -> int:
            raise OSError(28, "No space left on device (injected)")

    def write(self: Any, view: memoryview) -> None:  # the file's own write fails, in the extra thread
        if threading.current_thread() is threading.main_thread() or len(view) <= 1024:
            return original(self, view)
        failing.append(threading.current_thread().name)
        self._raw, raw = Full(), self._raw
        try:
            return original(self, view)
        finally:
            self._raw = raw

    monkeypatch.setattr(writer_module.HashingStream, "_write", write)
    state = {"a": torch.randn(256, 256), "b": torch.randn(256, 256)}
    writer = ChecksummingWriter(tmp_path / "c", thread_count=2)
    with pytest.raises(CheckpointException) as raised:  # DCP's wrapper of each rank's error
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert len(set(failing)) == 1 and len(writer.fs.errors) == 1  # one thread, one file failed
    error = raised.value.failures[0][0]
    assert isinstance(error, OSError) and error.errno == 28 and error.filename is not None
    assert Path(error.filename).parent == tmp_path / "c" and error.filename.endswith(".distcp")


@given(
    first=st.binary(max_size=3000),
    second=st.one_of(st.binary(max_size=1), st.binary(max_size=5000)),
    start=st.integers(0, 0xFFFFFFFF),
)
@settings(max_examples=200, deadline=None)
def test_crc32_combine_equals_zlib_of_the_joined_bytes(first: bytes, second: bytes, start: int) -> None:
    whole = zlib.crc32(second, zlib.crc32(first, start))
    assert crc32_combine(zlib.crc32(first, start), zlib.crc32(second), len(second)) == whole


@given(data=st.binary(max_size=5000), start=st.integers(0, 0xFFFFFFFF), cut=st.integers(0, 5000))
@settings(max_examples=200, deadline=None)
def test_crc32_is_zlibs(data: bytes, start: int, cut: int) -> None:
    """The checksum of every file is zlib's CRC-32, whoever computes it (ISA-L where installed)."""
    view = memoryview(bytearray(data))
    assert crc32(view, start) == zlib.crc32(data, start)
    assert crc32(view[cut:], crc32(view[:cut])) == zlib.crc32(data)


def test_crc32_of_a_tensors_bytes_is_zlibs() -> None:
    values = torch.randn(3 << 18)  # 3 MiB of float32, through the buffer a tensor gives
    view = memoryview(values.numpy()).cast("B")
    assert crc32(view) == zlib.crc32(view)


def test_crc32_combine_of_large_pieces() -> None:
    data = os.urandom(3 << 20)
    cut = (1 << 20) + 17
    joined = crc32_combine(zlib.crc32(data[:cut]), zlib.crc32(data[cut:]), len(data) - cut)
    assert joined == zlib.crc32(data)


@given(
    data=st.binary(max_size=4096),
    ranges=st.lists(st.tuples(st.integers(0, 4096), st.integers(1, 1500)), max_size=6),
    missing=st.integers(0, 300),
)
@settings(max_examples=150, deadline=None)
def test_ranges_checksum_is_zlibs_of_the_file_whatever_ranges_are_known(
    tmp_path_factory: pytest.TempPathFactory, data: bytes, ranges: list[tuple[int, int]], missing: int
) -> None:
    """A file's checksum from the ranges a load already checksummed and a read of the rest is zlib's of
    the whole file (ranges overlapping, unsorted, or past the end ignored). A file ``missing`` bytes
    shorter than the manifest says counts the bytes it has."""
    path = tmp_path_factory.mktemp("ranges") / "file"
    path.write_bytes(data)
    known = [
        (offset, n, zlib.crc32(data[offset : offset + n])) for offset, n in ranges if offset + n <= len(data)
    ]
    assert ranges_checksum(path, len(data) + missing, known) == (len(data), f"{zlib.crc32(data):08x}")


def test_a_file_the_writer_removed_is_not_in_its_checksums(tmp_path: Path) -> None:
    """What DCP's filesystem removes leaves its checksums too: a commit must not list a file that is gone
    (a rename carries the checksum to the new name)."""
    writer = ChecksummingWriter(tmp_path)
    for name in ("kept", "moved", "removed"):
        with writer.fs.create_stream(tmp_path / name, "wb") as stream:
            stream.write(name.encode())
    writer.fs.rename(tmp_path / "moved", tmp_path / "renamed")
    writer.fs.rm_file(tmp_path / "removed")
    assert set(writer.checksums) == {"kept", "renamed"} == {p.name for p in tmp_path.iterdir()}
    assert writer.checksums["renamed"] == (5, f"{zlib.crc32(b'moved'):08x}")
