"""Atomic commits in one process: full files, directories without a process group, removal, recovery."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sharded.checkpoint import MANIFEST_NAME, read_manifest
from lightning_sharded.checkpoint.commit import (
    commit_directory,
    commit_file,
    leftovers,
    remove_checkpoint,
    resolve,
)
from lightning_sharded.checkpoint.errors import CheckpointError
from tests.fault_injection import FAULT_ENV, NO_EXCHANGE_ENV

REPO = Path(__file__).resolve().parents[1]


def write_text(text: str):  # type: ignore[no-untyped-def]
    def write(path: Path) -> None:
        path.write_text(text)

    return write


def write_dir(files: dict[str, bytes]):  # type: ignore[no-untyped-def]
    def write(staging: Path) -> None:
        for name, data in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)

    return write


@pytest.fixture(params=["exchange", "two-renames"])
def publish_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(NO_EXCHANGE_ENV, "1" if request.param == "two-renames" else "0")
    return str(request.param)


def test_commit_file_creates_and_replaces(tmp_path: Path, publish_mode: str) -> None:
    target = tmp_path / "sub" / "last.ckpt"
    commit_file(target, write_text("one"))
    assert target.read_text() == "one"
    commit_file(target, write_text("two"))
    assert target.read_text() == "two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]


def test_commit_file_error_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    target.write_text("old")

    def fail(path: Path) -> None:
        path.write_text("partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        commit_file(target, fail)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_commit_file_that_writes_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="did not create the file"):
        commit_file(tmp_path / "x.ckpt", lambda path: None)
    assert list(tmp_path.iterdir()) == []


def test_commit_file_replaces_a_sharded_directory(tmp_path: Path, publish_mode: str) -> None:
    target = tmp_path / "ckpt"
    commit_directory(target, write_dir({"__0_0.distcp": b"abc", "meta.pt": b"m"}))
    assert target.is_dir()
    commit_file(target, write_text("full"))
    assert target.is_file() and target.read_text() == "full"
    assert leftovers(target) == []


def test_commit_directory_without_process_group(tmp_path: Path, publish_mode: str) -> None:
    target = tmp_path / "ckpt"
    target.write_text("a previous full checkpoint")
    files = {"__0_0.distcp": b"x" * 1000, ".metadata": b"md", "meta.pt": b"meta", "extra/notes.txt": b"hi"}
    commit_directory(target, write_dir(files), metadata={"epoch": 4, "global_step": 40})
    manifest = read_manifest(target)
    assert manifest is not None
    assert [e.path for e in manifest.files] == sorted(files)
    assert manifest.world_size == 1
    assert (manifest.epoch, manifest.global_step) == (4, 40)
    assert manifest.entry("__0_0.distcp") is not None
    assert manifest.entry("__0_0.distcp").size == 1000  # type: ignore[union-attr]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_commit_directory_error_keeps_the_old_directory(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    commit_directory(target, write_dir({"meta.pt": b"old"}))

    def fail(staging: Path) -> None:
        (staging / "meta.pt").write_bytes(b"new")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        commit_directory(target, fail)
    assert (target / "meta.pt").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_leftovers_are_cleaned_by_the_next_save_and_ignored_by_resolve(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    commit_directory(target, write_dir({"meta.pt": b"v1"}))
    stale = tmp_path / ".ckpt.staging-0000000000000001deadbeef"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half")
    trash = tmp_path / ".ckpt.trash-0000000000000002deadbeef"
    trash.mkdir()
    assert resolve(target) == target
    assert leftovers(target) == [stale, trash]
    commit_directory(target, write_dir({"meta.pt": b"v2"}))
    assert leftovers(target) == []
    assert (target / "meta.pt").read_bytes() == b"v2"


def test_resolve_picks_the_newest_old_version_when_the_path_is_gone(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    older = tmp_path / ".ckpt.old-0000000000000001aaaaaaaa"
    newer = tmp_path / ".ckpt.old-0000000000000002aaaaaaaa"
    older.mkdir()
    newer.mkdir()
    (newer / "meta.pt").write_bytes(b"v")
    assert resolve(target) == newer
    assert resolve(tmp_path / "other") == tmp_path / "other"
    # the next save puts it back in place before replacing it
    commit_directory(target, write_dir({"meta.pt": b"v2"}))
    assert leftovers(target) == []
    assert (target / "meta.pt").read_bytes() == b"v2"


def test_remove_checkpoint_removes_directory_file_and_leftovers(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    commit_directory(target, write_dir({"meta.pt": b"v1"}))
    (tmp_path / ".ckpt.old-0000000000000001aaaaaaaa").mkdir()
    remove_checkpoint(target)
    assert list(tmp_path.iterdir()) == []
    assert not resolve(target).exists()
    commit_file(target, write_text("file"))
    remove_checkpoint(target)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="no checkpoint to remove"):
        remove_checkpoint(target)


def test_leftovers_of_other_checkpoints_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / ".ckpt2.staging-0000000000000001aaaaaaaa").mkdir()
    commit_directory(tmp_path / "ckpt", write_dir({"meta.pt": b"v1"}))
    assert (tmp_path / ".ckpt2.staging-0000000000000001aaaaaaaa").exists()


@pytest.mark.parametrize(("fault", "survivor"), [("before_publish", "old"), ("after_publish", "new")])
def test_commit_file_sigkill(tmp_path: Path, fault: str, survivor: str) -> None:
    target = tmp_path / "last.ckpt"
    target.write_text("old")
    code = (
        "import sys; from pathlib import Path; from tests.fault_injection import install; install();"
        "from lightning_sharded.checkpoint.commit import commit_file;"
        "commit_file(sys.argv[1], lambda p: Path(p).write_text('new'))"
    )
    env = {**os.environ, FAULT_ENV: fault, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(target)], env=env, timeout=120, capture_output=True
    )
    assert proc.returncode == -9, proc.stderr
    assert target.read_text() == survivor
    commit_file(target, write_text("next"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_manifest_name_is_reserved(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    commit_directory(target, write_dir({MANIFEST_NAME: b"not json", "meta.pt": b"m"}))
    manifest = read_manifest(target)
    assert manifest is not None
    assert [e.path for e in manifest.files] == ["meta.pt"]


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(tmp_path: Path) -> None:
    target = tmp_path / "project"
    target.mkdir()
    (target / "notes.txt").write_text("precious")
    with pytest.raises(
        IsADirectoryError, match=r"is a directory that is not a checkpoint \(it holds notes.txt\)"
    ):
        commit_file(target, write_text("full"))
    with pytest.raises(
        CheckpointError, match=r"is a directory that is not a checkpoint.*Choose another path"
    ):
        commit_directory(target, write_dir({"meta.pt": b"m"}))
    assert (target / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]
    empty = tmp_path / "empty"
    empty.mkdir()
    commit_directory(empty, write_dir({"meta.pt": b"m"}))
    assert (empty / "meta.pt").read_bytes() == b"m"


def test_checksums_computed_while_writing_match_and_skip_the_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from lightning_sharded.checkpoint.backends import local as atomic
    from lightning_sharded.checkpoint.backends.dcp_writer import ChecksummingWriter
    from lightning_sharded.checkpoint.checksum import file_checksum
    from lightning_sharded.checkpoint.verify import verify_checkpoint

    read_back: list[str] = []
    original = atomic.file_checksum

    def spy(path: Path, **kwargs: object) -> tuple[int, str]:
        read_back.append(Path(path).name)
        return original(path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(atomic, "file_checksum", spy)
    state = {
        "model": {"w": torch.arange(1000.0), "b": torch.ones(3)},
        "optimizer_0": {"param_groups": [{"lr": 1}]},
    }

    def write(staging: Path) -> dict[str, tuple[int, str]]:
        writer = ChecksummingWriter(staging, thread_count=2)
        dcp.save(state, storage_writer=writer, no_dist=True)
        torch.save({"epoch": 1}, staging / "meta.pt")
        return writer.checksums

    target = tmp_path / "ckpt"
    commit_directory(target, write)
    assert read_back == ["meta.pt"]  # .metadata and the shard files were checksummed while written
    manifest = read_manifest(target)
    assert manifest is not None
    assert {e.path for e in manifest.files} >= {".metadata", "meta.pt"}
    for entry in manifest.files:
        assert (entry.size, entry.checksum) == file_checksum(target / entry.path), entry
    verify_checkpoint(target)


def test_a_rank_that_failed_itself_reports_its_own_failure_when_rank_0_is_lost_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 dies after gathering the failures, before broadcasting the outcome: a rank whose own write
    # failed says why it failed (its disk), not only that a collective failed.
    from lightning_sharded.checkpoint import collective
    from lightning_sharded.checkpoint import commit as commit_module

    target = tmp_path / "ckpt"
    commit_directory(target, write_dir({"meta.pt": b"old"}))
    real = collective.broadcast

    def broadcast(obj: object, where: object, step: str = "broadcast") -> object:
        if step == "publishing":
            raise RuntimeError("Connection closed by peer (rank 0)")
        return real(obj, where, step)  # type: ignore[arg-type]

    monkeypatch.setattr(commit_module.collective, "broadcast", broadcast)

    def fail(staging: Path) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(CheckpointError) as raised:
        commit_directory(target, fail)
    message = str(raised.value)
    assert "Input/output error" in message and "another rank died" not in message, message
    assert (target / "meta.pt").read_bytes() == b"old"


@pytest.mark.parametrize(
    ("err", "falls_back"),
    [(errno.EINVAL, True), (errno.ENOSYS, True), (errno.EOPNOTSUPP, True), (errno.EACCES, False)],
    ids=["EINVAL", "ENOSYS", "EOPNOTSUPP", "EACCES"],
)
def test_an_exchange_the_file_system_refuses_falls_back_and_any_other_error_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, falls_back: bool
) -> None:
    """``renameat2(RENAME_EXCHANGE)`` refused by a file system without it (EINVAL, ENOSYS, EOPNOTSUPP: NFS,
    some FUSE file systems) makes the publish use two renames; any other error (permissions) is the
    commit's error, naming both paths, and nothing was swapped."""
    import ctypes

    from lightning_sharded.checkpoint import libc
    from lightning_sharded.checkpoint.backends import local

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("a")
    b.write_text("b")
    monkeypatch.setattr(
        libc, "function", lambda name, *types: (lambda *args: -1) if name == "renameat2" else None
    )
    monkeypatch.setattr(ctypes, "get_errno", lambda: err)
    if falls_back:
        assert local._exchange(a, b) is False
    else:
        with pytest.raises(OSError, match=r"renameat2\(RENAME_EXCHANGE\) of '.*a' and '.*b'") as raised:
            local._exchange(a, b)
        assert raised.value.errno == err
    assert (a.read_text(), b.read_text()) == ("a", "b")
