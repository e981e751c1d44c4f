"""Saves that the storage fails, in one process: each fault's error names it, and nothing valid is lost.

Every case saves version 1 first, then fails a save of version 2 over it (or next to it) with the
fault injected: a disk that fills up after N bytes (:func:`tests.faulty_storage.filling_disk`, ``ENOSPC``
or a quota's ``EDQUOT``), a read-only filesystem, a parent the process may not write to, a directory
put where the save writes, a save refused for lack of space, an object store that throttles or drops
the connection (:class:`tests.faulty_storage.FlakyFileSystem`). After each, the previous checkpoint
loads and equals version 1, and no leftover of the failed save remains. Multi-process faults (a rank
killed or hung) are in ``test_rank_faults.py``; a real small filesystem in ``test_full_disk.py``.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from lightning_sharded import CheckpointError, load_checkpoint
from lightning_sharded.checkpoint import failures, space
from lightning_sharded.checkpoint import save as io
from lightning_sharded.checkpoint.backends import LocalBackend
from lightning_sharded.checkpoint.backends.retry import BACKOFF_ENV, RETRIES_ENV, transient
from lightning_sharded.checkpoint.commit import commit_directory, leftovers
from lightning_sharded.checkpoint.errors import StorageError
from lightning_sharded.checkpoint.failures import Failure
from tests._compare import assert_version
from tests.faulty_storage import FlakyFileSystem, filling_disk


def state(version: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64, 64), float(version)), "b": torch.arange(8.0) + version},
        "optimizer_0": {
            "state": {"w": {"step": torch.tensor(float(version))}},
            "param_groups": [{"lr": 0.1}],
        },
    }


def save(path: Any, version: int, **kwargs: Any) -> None:
    io.write_sharded_checkpoint(path, state(version), {"global_step": version}, rank=0, **kwargs)


def assert_clean(path: Path) -> None:
    assert leftovers(path) == [], leftovers(path)


# ------------------------------------------------------------------------------- a disk that fills up

#: file of a sharded save -> the file the error names (DCP writes `.metadata` as a temporary first)
FILES = {
    "__0_0.distcp": "__0_0.distcp",  # the shard: torch's zip writer hides the OSError
    ".metadata*": ".metadata.tmp",  # DCP's index, written by DCP's writer on rank 0
    "meta.pt": "meta.pt",  # Lightning's metadata, written by us
    ".lightning_sharded.json.tmp": ".lightning_sharded.json.tmp",  # the manifest, written last
}


@pytest.mark.parametrize("pattern", sorted(FILES))
def test_a_disk_that_fills_up_names_the_cause_and_the_file(tmp_path: Path, pattern: str) -> None:
    path = tmp_path / "ckpt"
    save(path, 1)
    with filling_disk(tmp_path, pattern, after=100) as cut, pytest.raises(StorageError) as raised:
        save(path, 2, check_space=False)
    assert cut, "the fault was never injected"
    err = raised.value
    message = str(err)
    assert message.startswith(
        f"No space left on device (ENOSPC): saving the checkpoint '{path}' failed on rank(s) 0"
    )
    assert isinstance(err, CheckpointError) and isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert f"{FILES[pattern]}'" in message, message
    assert "save_top_k" in message and "The partial save was removed" in message, message
    assert "unexpected pos" not in message and ".metadata names" not in message, message  # no load hint
    assert_version(path, 1, state(1)["model"], verify_while_loading=True)
    assert_clean(path)


def test_a_full_file_on_a_full_disk(tmp_path: Path) -> None:
    path = tmp_path / "full.ckpt"
    io.write_full_checkpoint(path, {"state_dict": state(1)["model"], "global_step": 1}, rank=0)
    with filling_disk(tmp_path, ".full.ckpt.staging-*", after=1000), pytest.raises(StorageError) as raised:
        io.write_full_checkpoint(
            path, {"state_dict": state(2)["model"], "global_step": 2}, rank=0, check_space=False
        )
    message = str(raised.value)
    assert re.match(
        rf"No space left on device \(ENOSPC\): saving the checkpoint '{path}' failed on rank\(s\) 0 \(rank 0:"
        r" '.*\.full\.ckpt\.staging-\w+' \(1000 B written, [0-9.]+ \w+ free\): No space left on device\)\."
        r" This save needed about [0-9.]+ KiB there; [0-9.]+ \w+ were free when it started",
        message,
    ), message
    loaded = torch.load(path, weights_only=True)
    assert loaded["global_step"] == 1
    assert_clean(path)


def test_a_quota(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save(path, 1)
    with (
        filling_disk(tmp_path, "__0_0.distcp", after=10, number=errno.EDQUOT),
        pytest.raises(StorageError) as raised,
    ):
        save(path, 2)
    message = str(raised.value)
    assert message.startswith("Disk quota exceeded (EDQUOT): saving the checkpoint"), message
    assert "quota -s" in message and raised.value.errno == errno.EDQUOT
    assert_version(path, 1, state(1)["model"], verify_while_loading=True)
    assert_clean(path)


def test_torch_hiding_the_cause_on_a_full_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save into a file name raises RuntimeError('unexpected pos') with no OSError anywhere: the
    free space of the filesystem says what happened."""
    hidden = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(failures, "free_space", lambda _: 0)
    failure = Failure.of(hidden, 1, near=tmp_path)
    assert failure.errno == errno.ENOSPC and failure.inferred and failure.free == 0
    assert "torch's writer failed (RuntimeError:" in failure.detail()
    monkeypatch.setattr(failures, "free_space", lambda _: 1 << 30)
    assert Failure.of(hidden, 1, near=tmp_path).errno is None  # space left: not a full disk


# ------------------------------------------------------------------------------------ space check


def test_a_save_that_cannot_fit_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    save(path, 1)
    size = sum(p.stat().st_size for p in path.iterdir())
    needed = space.sharded_share(state(2), 1, [len(_meta_bytes(2))])
    # the estimate covers the real size of a save, and is not far above it
    assert size <= needed <= size * 1.5 + 64 * 1024, (size, needed)
    # over an existing checkpoint the new one must fit beside the old one: free space is what counts
    free = {"bytes": space.required(needed) - 1}
    monkeypatch.setattr(LocalBackend, "free_space", lambda self, target: free["bytes"])
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(StorageError) as raised:
        save(path, 2)
    message = str(raised.value)
    assert re.match(
        rf"No space left on device \(ENOSPC\) for the checkpoint '{path}', refused before writing: this save"
        r" needs about [0-9.]+ KiB \(its estimate; with the margin of 2% and 256\.0 KiB, [0-9.]+ KiB\), and"
        rf" the filesystem of '{tmp_path}' has [0-9.]+ KiB free \(statvfs\)\. Nothing was written",
        message,
    ), message
    assert "check_space=False" in message and raised.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == before, "a refused save created something"
    assert_version(path, 1, state(1)["model"], verify_while_loading=True)
    save(path, 2, check_space=False)  # the check can be turned off
    assert_version(path, 2, state(2)["model"], verify_while_loading=True)
    free["bytes"] = space.required(needed)
    save(path, 3)  # just enough
    assert_version(path, 3, state(3)["model"], verify_while_loading=True)
    # a full file, the same way
    monkeypatch.setattr(LocalBackend, "free_space", lambda self, target: 1000)
    with pytest.raises(
        StorageError, match=r"^No space left on device \(ENOSPC\) for the checkpoint .*refused"
    ):
        io.write_full_checkpoint(tmp_path / "full.ckpt", {"state_dict": state(1)["model"]}, rank=0)
    assert not (tmp_path / "full.ckpt").exists() and leftovers(tmp_path / "full.ckpt") == []


def _meta_bytes(version: int) -> bytes:
    import io as std_io

    buffer = std_io.BytesIO()
    torch.save({"global_step": version}, buffer)
    return buffer.getvalue()


def test_the_strategy_passes_check_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_sharded import ShardedModelParallelStrategy

    monkeypatch.setattr(LocalBackend, "free_space", lambda self, target: 0)
    checkpoint = {"state_dict": {"w": torch.ones(3)}, "global_step": 5}
    with pytest.raises(StorageError, match="refused before writing"):
        ShardedModelParallelStrategy().save_checkpoint(dict(checkpoint), tmp_path / "a")
    ShardedModelParallelStrategy(check_space=False).save_checkpoint(dict(checkpoint), tmp_path / "b")
    assert load_checkpoint(tmp_path / "b")["global_step"] == 5
    with pytest.raises(ValueError, match="checkpoint_timeout=0"):
        ShardedModelParallelStrategy(checkpoint_timeout=0)


# ------------------------------------------------------------------------------- other local faults


@pytest.mark.parametrize(
    ("number", "first", "hint"),
    [
        (errno.EROFS, "Read-only file system (EROFS)", "remount it read-write"),
        (errno.EACCES, "Permission denied (EACCES)", "may not write there"),
    ],
)
def test_a_target_that_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, number: int, first: str, hint: str
) -> None:
    """A read-only filesystem, or a parent directory the process may not write to: the staging
    directory cannot be created (what a real one raises there: see test_full_disk.py)."""
    path = tmp_path / "ckpt"
    save(path, 1)

    def refuse(self: Any, target: Any, *, directory: bool) -> Any:
        raise OSError(number, os.strerror(number), str(target.parent / f".{target.name}.staging-x"))

    monkeypatch.setattr(LocalBackend, "stage", refuse)
    with pytest.raises(StorageError) as raised:
        save(path, 2)
    message = str(raised.value)
    assert message.startswith(f"{first}: saving the checkpoint '{path}' failed on rank(s) 0 (rank 0: '"), (
        message
    )
    assert hint in message and "Nothing was written" in message, message
    with pytest.raises(StorageError, match=re.escape(first)):
        io.write_full_checkpoint(tmp_path / "full.ckpt", {"state_dict": state(1)["model"]}, rank=0)
    assert_version(path, 1, state(1)["model"], verify_while_loading=True)
    assert_clean(path)


def test_a_directory_put_where_the_save_writes(tmp_path: Path) -> None:
    """Something else puts a directory where the save writes (a file of the staging directory, or the
    target itself, between the save's start and its publish): a clear error, nothing of theirs lost."""
    path = tmp_path / "ckpt"
    save(path, 1)

    def write_into_a_directory(staging: Path) -> None:
        (staging / "meta.pt").mkdir()
        LocalBackend().write_bytes(staging / "meta.pt", b"x")

    with pytest.raises(StorageError) as raised:
        commit_directory(path, write_into_a_directory)
    message = str(raised.value)
    assert message.startswith("Is a directory (EISDIR): saving the checkpoint"), message
    assert "meta.pt': Is a directory" in message and "one job at a time" in message, message
    assert_version(path, 1, state(1)["model"], verify_while_loading=True)
    assert_clean(path)

    full = tmp_path / "full.ckpt"
    io.write_full_checkpoint(full, {"state_dict": state(1)["model"]}, rank=0)

    def replace_the_target(staging: Path) -> None:
        full.unlink()
        full.mkdir()
        (full / "notes.txt").write_text("theirs")
        torch.save({}, staging / "meta.pt")

    with pytest.raises(CheckpointError) as raised:
        commit_directory(full, replace_the_target)
    message = str(raised.value)
    assert "is a directory that is not a checkpoint (it holds notes.txt)" in message, message
    assert "one job at a time" in message, message
    assert (full / "notes.txt").read_text() == "theirs", "the save replaced a directory it did not create"
    assert_clean(full)


# ------------------------------------------------------------------------------------ object store


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch) -> type[FlakyFileSystem]:
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    FlakyFileSystem.store.clear()
    FlakyFileSystem.failures, FlakyFileSystem.failed = 0, []
    monkeypatch.setenv(BACKOFF_ENV, "0.001")
    monkeypatch.setenv(RETRIES_ENV, "4")
    return FlakyFileSystem


@pytest.mark.parametrize("kind", ["throttle", "drop"])
def test_an_object_store_that_throttles_or_drops(flaky: type[FlakyFileSystem], kind: str) -> None:
    url = f"flaky://bucket/{kind}/ckpt"
    save(url, 1)
    flaky.kind = kind
    flaky.failures = 4  # each request fails at most 4 times in a row: the retries get through
    save(url, 2)
    assert len(flaky.failed) == 4, flaky.failed
    flaky.failures = 3
    assert_version(url, 2, state(2)["model"], verify_while_loading=True)
    flaky.failures = 1000  # a store that never recovers: a bounded number of tries, then a clear error
    flaky.failed = []
    with pytest.raises(StorageError) as raised:
        save(url, 3)
    message = str(raised.value)
    cause = (
        "kept throttling the requests (503 SlowDown)"
        if kind == "throttle"
        else "kept dropping the connection"
    )
    assert message.startswith(
        f"The object store {cause}: saving the checkpoint '{url}' failed on rank(s) 0"
    ), message
    assert "failed 5 time(s) over" in message and RETRIES_ENV in message, message
    assert len(flaky.failed) == 5, flaky.failed
    flaky.failures = 0
    assert_version(url, 2, state(2)["model"], verify_while_loading=True)


def test_what_is_worth_another_try() -> None:
    """The errors s3fs and botocore raise for a throttled request and a dropped connection."""
    from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError
    from s3fs.errors import translate_boto_error

    slow_down = ClientError(
        {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}}, "PutObject"
    )
    assert transient(translate_boto_error(slow_down)) == "throttled (503 SlowDown)"
    assert transient(ConnectionClosedError(endpoint_url="http://s3")) == "connection dropped"
    assert transient(EndpointConnectionError(endpoint_url="http://s3")) == "connection dropped"
    assert transient(ConnectionResetError(errno.ECONNRESET, "reset")) == "connection dropped"
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "PutObject")
    assert transient(translate_boto_error(denied)) is None
    assert transient(FileNotFoundError("s3://b/k")) is None
    assert transient(ValueError("bad argument")) is None


# ------------------------------------------------------------------------------------------- loads


def test_a_read_the_storage_fails_has_a_load_s_advice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_sharded.checkpoint.lightning_meta import read_meta

    path = tmp_path / "ckpt"
    save(path, 1)

    def unreadable(self: Any, loc: Any, **kwargs: Any) -> Any:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(loc))

    monkeypatch.setattr(LocalBackend, "torch_load", unreadable)
    with pytest.raises(StorageError) as raised:
        read_meta(LocalBackend(), path / "meta.pt", True)
    message = str(raised.value)
    assert message.startswith(
        f"Permission denied (EACCES): could not read the Lightning metadata '{path / 'meta.pt'}'"
    )
    assert "may not read it" in message and "Nothing on disk was changed" in message, message
    assert "save_top_k" not in message  # a load's advice, not a save's
