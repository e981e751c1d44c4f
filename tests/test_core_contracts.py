"""Issue 12, items 4-6 and 8, in one process: checksums of owned bytes, durable new directories, stock
interop, the CheckpointIO plugin, deferred logger notifications and the synchronous SLURM save."""

from __future__ import annotations

import io
import logging
import os
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from lightning_sharded import CheckpointError, ShardedModelParallelStrategy
from lightning_sharded.checkpoint import names, read_manifest
from lightning_sharded.checkpoint.async_save import AsyncSaver
from lightning_sharded.checkpoint.backends import local
from lightning_sharded.checkpoint.checksum import HashingStream
from lightning_sharded.checkpoint.detect import CheckpointKind, detect
from lightning_sharded.checkpoint.save import write_sharded_checkpoint


def _save(path: Path, step: int = 1) -> None:
    write_sharded_checkpoint(path, {"model": {"w": torch.arange(64.0) + step}}, {"global_step": step}, rank=0)


def _stock(path: Path, meta: bool = True) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"w": torch.zeros(64)}}, checkpoint_id=path, no_dist=True)
    if meta:
        torch.save({"global_step": 7}, path / "meta.pt")


@pytest.mark.parametrize("size", [100, 3 << 20])  # inline and helper-thread paths
def test_hashing_stream_hashes_the_bytes_written_not_what_the_buffer_holds_later(size: int) -> None:
    raw = io.BytesIO()
    stream = HashingStream(raw)
    buffer = bytearray(os.urandom(size))
    original = bytes(buffer)
    assert stream.write(buffer) == size
    buffer[:] = b"\0" * size  # the caller reuses (or frees) its buffer as soon as write returns
    assert stream.result() == (size, f"{zlib.crc32(original):08x}")
    assert raw.getvalue() == original


def test_a_save_fsyncs_every_directory_it_creates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[Path] = []
    real = local.fsync_dir
    monkeypatch.setattr(local, "fsync_dir", lambda p: (synced.append(Path(p)), real(p))[1])
    target = tmp_path / "a" / "b" / "ckpt"
    _save(target)
    for directory in (tmp_path, tmp_path / "a", tmp_path / "a" / "b"):
        assert directory in synced, directory


def test_the_manifest_s_rename_is_made_durable_before_the_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest is renamed into the staged directory last; that directory is fsynced after the rename
    and before the rename that publishes it, or a power loss could publish a checkpoint without its
    manifest (the mutant dropping ``fsync_dir(staging)`` after the manifest survived the suite)."""
    events: list[tuple[str, str]] = []
    real_fsync_dir, real_replace, real_publish = local.fsync_dir, os.replace, local.LocalBackend.publish

    def fsync_dir(path: Path) -> None:
        events.append(("fsync_dir", os.path.realpath(path)))
        real_fsync_dir(path)

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        events.append(("replace", os.path.realpath(dst)))
        real_replace(src, dst, **kwargs)

    def publish(self: local.LocalBackend, staging: Any, *args: Any, **kwargs: Any) -> None:
        events.append(("publish", os.path.realpath(staging)))
        real_publish(self, staging, *args, **kwargs)

    monkeypatch.setattr(local, "fsync_dir", fsync_dir)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(local.LocalBackend, "publish", publish)
    _save(tmp_path / "ckpt")
    (staged,) = [path for kind, path in events if kind == "publish"]
    renamed = events.index(("replace", os.path.join(staged, names.MANIFEST_NAME)))
    published = events.index(("publish", staged))
    assert ("fsync_dir", staged) in events[renamed:published], events
    assert read_manifest(tmp_path / "ckpt") is not None


def test_a_crashed_stock_save_is_refused_by_loads_and_replaced_by_the_next_save(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    _stock(target, meta=False)  # stock crashed after the shards, before meta.pt
    with pytest.raises(CheckpointError, match=r"has no `meta\.pt`"):
        detect(target)
    _save(target, step=3)
    found = detect(target)
    assert found.kind is CheckpointKind.SHARDED and found.manifest is not None
    assert found.manifest.global_step == 3


def test_a_stock_save_over_ours_makes_the_manifest_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_sharded.checkpoint.tools import load_checkpoint
    from lightning_sharded.checkpoint.verify import verify_checkpoint

    target = tmp_path / "ckpt"
    _save(target, step=1)
    _stock(target)  # stock Lightning writes in place over our directory, leaving our manifest
    os.utime(target / ".metadata", (1e10, 1e10))  # newer than the manifest, whatever the clock's grain
    assert read_manifest(target) is not None
    with caplog.at_level(logging.WARNING):
        found = detect(target)
    assert found.manifest is None
    assert "a save without lightning_sharded wrote over it. Ignoring the manifest" in caplog.text
    checkpoint = load_checkpoint(target, verify=True)
    assert checkpoint["global_step"] == 7 and torch.equal(checkpoint["state_dict"]["w"], torch.zeros(64))
    assert not verify_checkpoint(target).has_manifest


def test_a_manifest_is_stale_by_content_even_where_the_sizes_still_match(tmp_path: Path) -> None:
    """A save without the library over ours that wrote `.metadata` and `meta.pt` of the same sizes (the
    same model: a new save id of the same length) still makes the manifest stale; one of the two
    changed alone is damage, not staleness. (The mutant that compared the sizes only survived.)"""
    target = tmp_path / "ckpt"
    _save(target)
    manifest = read_manifest(target)
    assert manifest is not None
    backend = local.LocalBackend()
    assert not backend.manifest_is_stale(target, manifest)
    for name in (".metadata", "meta.pt"):
        path = target / name
        same_size = bytes(b ^ 0xFF for b in path.read_bytes())  # other bytes, the same length
        path.write_bytes(same_size)
        assert backend.manifest_is_stale(target, manifest) is (name == "meta.pt"), name


class RecordingIO(CheckpointIO):
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.calls.append(("save", (sorted(checkpoint), str(path), storage_options)))

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: Any = None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def remove_checkpoint(self, path: Any) -> None:
        self.calls.append(("remove", str(path)))


def test_full_saves_and_removals_go_through_a_checkpoint_io_plugin(tmp_path: Path) -> None:
    strategy = ShardedModelParallelStrategy(state_dict_type="full")
    plugin = RecordingIO()
    strategy.checkpoint_io = plugin
    path = tmp_path / "full.ckpt"
    strategy.save_checkpoint({"state_dict": {}, "epoch": 0}, path, storage_options={"acl": "private"})
    strategy.remove_checkpoint(path)
    assert plugin.calls == [
        # the per-rank state (save_rank_state=True) goes into a full file, through the plugin too
        ("save", (["epoch", "lightning_sharded_rank_state", "state_dict"], str(path), {"acl": "private"})),
        ("remove", str(path)),
    ]
    assert not path.exists()


def test_a_sharded_save_refuses_a_checkpoint_io_plugin_and_says_what_to_use(tmp_path: Path) -> None:
    strategy = ShardedModelParallelStrategy()
    strategy.checkpoint_io = RecordingIO()
    with pytest.raises(
        TypeError, match=r"`RecordingIO` plugin cannot write a sharded directory.*`async_save=True`"
    ):
        strategy.save_checkpoint({"state_dict": {}}, tmp_path / "ckpt")


def test_published_callbacks_run_only_once_the_save_is_published(tmp_path: Path) -> None:
    saver = AsyncSaver("test")
    seen: list[str] = []
    gate = __import__("threading").Event()

    def write(path: Any, staged: Any, group: Any) -> None:
        gate.wait(30)
        Path(path).write_text("done")

    saver.save(tmp_path / "a", {"w": torch.ones(2)}, write)
    saver.on_published(lambda: seen.append("a"))
    saver.poll()
    assert seen == []  # still being written
    gate.set()
    saver.wait()
    assert seen == ["a"] and (tmp_path / "a").read_text() == "done"

    def failing(path: Any, staged: Any, group: Any) -> None:
        raise OSError(28, "No space left on device (injected)")

    saver.save(tmp_path / "b", {"w": torch.ones(2)}, failing)
    saver.on_published(lambda: seen.append("b"))
    with pytest.raises(CheckpointError, match=r"background save of the checkpoint .* failed"):
        saver.wait()
    assert seen == ["a"]  # a failed save is never announced
    saver.on_published(lambda: seen.append("now"))  # nothing in flight: at once
    assert seen == ["a", "now"]
    saver.close()


def test_an_async_slurm_requeue_save_is_synchronous(tmp_path: Path) -> None:
    strategy = ShardedModelParallelStrategy(async_save=True)
    path = tmp_path / "hpc_ckpt_1.ckpt"
    strategy.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 5}, path)
    assert strategy._async_saver is None  # never went to the background
    manifest = read_manifest(path)
    assert manifest is not None and manifest.global_step == 5
    other = tmp_path / "epoch=0.ckpt"
    strategy.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 6}, other)
    assert strategy._async_saver is not None and str(strategy._async_saver.in_flight) == str(other)
    strategy.wait_for_checkpoint()
    assert read_manifest(other).global_step == 6  # type: ignore[union-attr]
    strategy._async_saver.close()


def test_with_async_save_loggers_hear_of_a_checkpoint_once_it_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time
    from types import SimpleNamespace

    from lightning_sharded.checkpoint import save

    gate = threading.Event()
    real = save.write_sharded_checkpoint

    def slow(*args: Any, **kwargs: Any) -> None:
        gate.wait(30)
        real(*args, **kwargs)

    monkeypatch.setattr(save, "write_sharded_checkpoint", slow)
    heard: list[bool] = []

    class Logger:
        def after_save_checkpoint(self, callback: Any) -> None:  # as W&B's log_model would
            heard.append((tmp_path / "ckpt" / "lightning_sharded.json").is_file())

    logger = Logger()
    strategy = ShardedModelParallelStrategy(async_save=True)
    strategy._lightning_module = SimpleNamespace(_trainer=SimpleNamespace(loggers=[logger]))  # type: ignore[assignment]
    strategy.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, tmp_path / "ckpt")
    logger.after_save_checkpoint(object())  # what ModelCheckpoint does right after save_checkpoint
    strategy.on_train_batch_start(None, 0)
    assert heard == []
    gate.set()
    saver = strategy._async_saver
    assert saver is not None
    for _ in range(300):  # the next batches poll; the save finishes in the background meanwhile
        strategy.on_train_batch_start(None, 1)
        if heard:
            break
        time.sleep(0.05)
    assert heard == [True]
    saver.close()


def test_a_copy_with_new_file_times_keeps_its_manifest_and_its_checks(tmp_path: Path) -> None:
    """`cp -r` gives the files new times in any order: the manifest still describes them, so it is used."""
    from lightning_sharded.checkpoint.verify import verify_checkpoint

    source, copy = tmp_path / "ckpt", tmp_path / "copy"
    _save(source, step=1)
    shutil.copytree(source, copy, copy_function=shutil.copyfile)  # no times kept
    os.utime(copy / ".metadata", (1e10, 1e10))  # `.metadata` newer than the manifest
    found = detect(copy)
    assert found.manifest is not None and found.manifest.global_step == 1
    assert verify_checkpoint(copy).has_manifest
    shard = next(copy.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: damage, still found by the manifest's checksums
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is corrupted"):
        verify_checkpoint(copy)


def test_a_damaged_metadata_alone_is_damage_not_a_stock_save(tmp_path: Path) -> None:
    from lightning_sharded.checkpoint.verify import verify_checkpoint

    target = tmp_path / "ckpt"
    _save(target, step=1)
    index = target / ".metadata"
    data = bytearray(index.read_bytes())
    data[len(data) // 2] ^= 0x01
    index.write_bytes(bytes(data))
    assert detect(target).manifest is not None  # meta.pt still matches: not a stock save over ours
    with pytest.raises(CheckpointError, match=r"'\.metadata'.*is corrupted"):
        verify_checkpoint(target)
