"""Write-behind: a large checkpoint file leaves the page cache as it is written, and its bytes and
checksum are those written."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_sharded.checkpoint.backends.dcp_writer import ChecksummingWriter
from lightning_sharded.checkpoint.checksum import CHUNK_SIZE, HashingStream, file_checksum
from lightning_sharded.checkpoint.writeback import WINDOW, WriteBehind
from tests._pages import resident, write_back_starts

MiB = 1 << 20


def _write(path: Path, chunks: list[bytes], window: int | None) -> tuple[int, str]:
    with open(path, "wb") as raw:
        behind = WriteBehind(raw.fileno(), window=window) if window is not None else None
        stream = HashingStream(raw, write_behind=behind)
        for chunk in chunks:
            stream.write(chunk)
        raw.flush()
        os.fsync(raw.fileno())
        if behind is not None:
            assert resident(path, 0, len(chunks[0]) - window - CHUNK_SIZE) == 0  # dropped while written
            behind.finish()
        return stream.result()


def test_a_large_file_leaves_the_page_cache_as_it_is_written(droppable: Path) -> None:
    chunks = [os.urandom(20 * MiB + 123), b"header", os.urandom(3 * MiB)]  # pieces, inline, a last piece
    plain, behind = droppable / "plain", droppable / "behind"
    plain_figures = _write(plain, chunks, window=None)
    figures = _write(behind, chunks, window=2 * MiB)
    whole = b"".join(chunks)
    assert figures == plain_figures == (len(whole), f"{zlib.crc32(whole):08x}")
    assert behind.read_bytes() == plain.read_bytes() == whole
    assert resident(plain) > 0.9  # what the kernel does by itself: every written page stays
    # After finish, nothing of it is left but what the read-back above brought in again: drop that
    # and check that only the read did it (the file was not left dirty: DONTNEED drops clean pages).
    with open(behind, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert resident(behind) == 0


def test_a_small_file_keeps_its_pages(droppable: Path) -> None:
    path = droppable / "small"
    with open(path, "wb") as raw:
        behind = WriteBehind(raw.fileno())
        stream = HashingStream(raw, write_behind=behind)
        stream.write(os.urandom(WINDOW // 2))
        raw.flush()
        behind.finish()
    assert resident(path) > 0.9  # no larger than the window: cached as any small file


def test_a_descriptor_without_write_back_is_written_as_before() -> None:
    read, write = os.pipe()  # sync_file_range fails on a pipe (ESPIPE): write-behind does nothing
    try:
        behind = WriteBehind(write, window=4096)
        os.write(write, b"x" * 8192)
        behind.advance(8192)
        behind.advance(16384)
        behind.finish()
        assert os.read(read, 16384) == b"x" * 8192
    finally:
        os.close(read)
        os.close(write)


def test_a_dcp_save_of_a_large_shard_checksums_loads_and_is_not_cached(droppable: Path) -> None:
    torch.manual_seed(0)
    state = {"big": torch.randn(12 * MiB), "small": torch.arange(7)}  # 48 MiB: more than WINDOW
    writer = ChecksummingWriter(droppable / "ckpt")
    dcp.save(state, storage_writer=writer, no_dist=True)
    shards = sorted((droppable / "ckpt").glob("*.distcp"))
    assert shards and max(resident(p) for p in shards) < 0.05  # the shard left the cache on disk
    for name, figures in writer.checksums.items():
        assert file_checksum(droppable / "ckpt" / name) == figures
    loaded = {"big": torch.zeros_like(state["big"]), "small": torch.zeros_like(state["small"])}
    dcp.load(loaded, checkpoint_id=droppable / "ckpt", no_dist=True)
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["small"], state["small"])


def test_the_write_back_starts_on_whole_pages_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece that ends mid-page (a save's pieces end where torch.save's records put them) starts the
    write-back of its whole pages only: the page the next piece fills further is left for a later call,
    so no page goes to the disk twice; every whole page is started by the end (the last part page is
    left to the fsync), ``finish`` drops up to the last byte written, and the file is whole."""
    from lightning_sharded.checkpoint import libc, writeback

    started = write_back_starts(monkeypatch)
    dropped: list[tuple[int, int]] = []
    drop = writeback.drop_written
    monkeypatch.setattr(
        writeback, "drop_written", lambda fd, start, n: dropped.append((start, n)) or drop(fd, start, n)
    )
    pieces = [os.urandom(n) for n in (3 * MiB + 100, 64, 5 * MiB + 4000, 4096, 2 * MiB + 1)]
    path = tmp_path / "shard"
    with open(path, "wb", buffering=0) as f:
        behind = WriteBehind(f.fileno(), window=4 * MiB)
        written = 0
        for piece in pieces:
            f.write(piece)
            written += len(piece)
            behind.advance(written)
        os.fsync(f.fileno())
        behind.finish()
    assert started, "no write-back was started"
    assert all(offset % libc.PAGE == 0 and (offset + n) % libc.PAGE == 0 for offset, n in started), started
    # Contiguous from 0 up to the last whole page of what was written.
    assert [o for o, _ in started] == [0] + [o + n for o, n in started[:-1]]
    assert sum(n for _, n in started) == written // libc.PAGE * libc.PAGE
    # Dropped in order while written (4 MiB behind), then by finish up to the end, the part page too.
    assert [o for o, _ in dropped] == [0] + [o + n for o, n in dropped[:-1]]
    assert dropped[-1][0] + dropped[-1][1] == written, (dropped, written)
    assert path.read_bytes() == b"".join(pieces)
