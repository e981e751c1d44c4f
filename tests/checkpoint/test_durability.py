"""Every data file of a save is fsynced after it was written and before the rename that publishes it: a
power loss right after the publish must not leave a published checkpoint whose files are holes.

Observed by recording every ``os.fsync`` (the file it was given, from ``/proc/self/fd``), the end of the
save's ``write`` and the start of the backend's ``publish``. The ``write`` functions below write with
plain ``open`` and no ``fsync`` of their own, so any fsync seen is the commit's.
"""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_sharded.checkpoint import names, read_manifest
from lightning_sharded.checkpoint.backends import local
from lightning_sharded.checkpoint.commit import commit_directory, commit_file
from lightning_sharded.checkpoint.save import write_sharded_checkpoint

#: Files a rank writes into the staging directory (rank 0 here), with their bytes.
FILES = {
    "__0_0.distcp": os.urandom(3000),
    ".metadata": b"index" * 10,
    "meta.pt": b"meta" * 20,
    names.rank_state_file(0): b"rank state",
    names.rank_index_file(0): b"{}",
}
#: The manifest is written under this name, fsynced, then renamed inside the staged directory.
MANIFEST_TMP = f".{names.MANIFEST_NAME}.tmp"


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """``("fsync", real path)`` for every ``os.fsync``, ``("publish", staged path)`` when the backend
    starts to publish; the test appends ``("written", "")`` when its ``write`` returns."""
    seen: list[tuple[str, str]] = []
    real_fsync = os.fsync
    real_publish = local.LocalBackend.publish

    def fsync(fd: int) -> None:
        seen.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def publish(self: local.LocalBackend, staging: object, *args: object, **kwargs: object) -> None:
        seen.append(("publish", os.path.realpath(str(staging))))
        real_publish(self, staging, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(local.LocalBackend, "publish", publish)
    yield seen


def _synced_between_write_and_publish(seen: list[tuple[str, str]], files: list[str]) -> None:
    """Every one of ``files`` (relative to the staged directory) was fsynced after ``written`` and
    before ``publish``."""
    kinds = [kind for kind, _ in seen]
    assert kinds.count("written") == 1 and kinds.count("publish") == 1, kinds
    written, publish = kinds.index("written"), kinds.index("publish")
    staged = seen[publish][1]
    synced = {path for kind, path in seen[written:publish] if kind == "fsync"}
    missing = [rel for rel in files if os.path.join(staged, rel) not in synced]
    assert not missing, f"not fsynced before the publish: {missing}"


@pytest.mark.parametrize("known", [False, True], ids=["read back", "checksummed while written"])
def test_every_file_of_a_sharded_save_is_fsynced_before_the_publish(
    tmp_path: Path, events: list[tuple[str, str]], known: bool
) -> None:
    def write(staging: Path) -> dict[str, tuple[int, str]]:
        for rel, data in FILES.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            with open(staging / rel, "wb") as f:
                f.write(data)
        events.append(("written", ""))
        return {rel: (len(data), f"{zlib.crc32(data):08x}") for rel, data in FILES.items()} if known else {}

    target = tmp_path / "ckpt"
    commit_directory(target, write)
    manifest = read_manifest(target)
    assert manifest is not None and sorted(e.path for e in manifest.files) == sorted(FILES)
    _synced_between_write_and_publish(events, [*FILES, MANIFEST_TMP])


def test_every_file_of_the_library_s_save_is_fsynced_before_the_publish(
    tmp_path: Path, events: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's shard file, ``.metadata``, ``meta.pt`` and the per-rank index, as the strategies save them."""
    real_seal = local.LocalBackend.seal_own

    def seal_own(self: local.LocalBackend, *args: object, **kwargs: object) -> object:
        events.append(("written", ""))  # the write is done: what DCP fsynced itself is not counted
        return real_seal(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(local.LocalBackend, "seal_own", seal_own)
    target = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming ... a single process"
        write_sharded_checkpoint(target, {"model": {"w": torch.arange(64.0)}}, {"global_step": 1}, rank=0)
    manifest = read_manifest(target)
    assert manifest is not None
    files = [e.path for e in manifest.files]
    assert {"__0_0.distcp", ".metadata", "meta.pt", names.INDEX_LAYOUT} <= set(files), files
    _synced_between_write_and_publish(events, [*files, MANIFEST_TMP])


def test_another_rank_fsyncs_the_files_it_seals(tmp_path: Path, events: list[tuple[str, str]]) -> None:
    """Rank 1 seals its own shard, rank-state and index files (``seal_own``): each is fsynced there."""
    staging = tmp_path / "staging"
    own = ["__1_0.distcp", names.rank_state_file(1), names.rank_index_file(1)]
    for rel in [*own, "__0_0.distcp"]:
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(rel.encode() * 7)
    for known in ({}, {rel: (len(rel) * 7, f"{zlib.crc32(rel.encode() * 7):08x}") for rel in own}):
        events.clear()
        entries = local.LocalBackend().seal_own(staging, 1, known)
        assert sorted(e.path for e in entries) == sorted(own)
        synced = {path for kind, path in events if kind == "fsync"}
        missing = [rel for rel in own if os.path.realpath(staging / rel) not in synced]
        assert not missing, (known, missing)


def test_a_full_file_is_fsynced_before_the_publish(tmp_path: Path, events: list[tuple[str, str]]) -> None:
    def write(staged: Path) -> None:
        staged.write_bytes(b"full checkpoint")
        events.append(("written", ""))

    commit_file(tmp_path / "last.ckpt", write)
    kinds = [kind for kind, _ in events]
    staged = events[kinds.index("publish")][1]
    assert ("fsync", staged) in events[kinds.index("written") : kinds.index("publish")], events
