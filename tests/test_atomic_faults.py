"""Crash a sharded save over an existing checkpoint with real processes and SIGKILLs, then load.

``tests/distributed/fault_driver.py`` runs every case once (about 5 s for all); each test below checks
one case: the checkpoint at the path is the old version or the new one, whole (weights, optimizer
state and ``meta.pt`` of one version, never a mix), and the next save succeeds and cleans up.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharded.checkpoint import read_manifest
from lightning_sharded.checkpoint.commit import leftovers, resolve
from lightning_sharded.checkpoint.verify import verify_checkpoint
from tests._compare import assert_same
from tests.distributed.fault_driver import CASES, expected

OLD, NEW = 1, 2
#: case -> the version that must be at the path after the crash (None: no checkpoint at all).
OUTCOME: dict[str, int | None] = {
    "clean": NEW,
    "during_shards_rank1": OLD,
    "during_shards_all": OLD,
    "after_shards_rank0": OLD,
    "after_write_rank1": OLD,
    "before_manifest_all": OLD,
    "before_publish_rank0": OLD,
    # rank 1 dies while rank 0, which has everything it needs, publishes: the new version.
    "before_publish_rank1": NEW,
    "after_publish_all": NEW,
    "during_remove_all": NEW,
    "fallback_between_renames": OLD,
    "fallback_after_publish": NEW,
    "fallback_during_remove": NEW,
    "enospc_shards_rank1": OLD,
    "enospc_meta_rank0": OLD,
    "fresh_before_publish": None,
    # rank 1 alone fails after its shards are written, or while it seals them: nothing is published
    "eio_after_shards_rank1": OLD,
    "eio_seal_rank1": OLD,
}


@pytest.fixture(scope="module")
def crashes(fault_run: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    return fault_run


def read_dcp_checkpoint(path: Path) -> dict[str, Any]:
    """Read a sharded directory in this process with DCP alone (no library loader involved)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    state.update(torch.load(path / "meta.pt", weights_only=True))
    return state


def assert_published_version(path: Path, version: int) -> None:
    """What the commit published at ``path`` is version ``version``, whole: its manifest's epoch and file
    sizes, and its values as DCP alone reads them."""
    real = resolve(path)
    assert real.is_dir(), f"no checkpoint at {path} (resolved to {real})"
    manifest = read_manifest(real)
    assert manifest is not None
    assert manifest.epoch == version
    for entry in manifest.files:
        assert (real / entry.path).stat().st_size == entry.size, entry
    loaded = read_dcp_checkpoint(real)
    assert_same(loaded, expected(version))


def test_every_case_has_an_expected_outcome() -> None:
    assert set(OUTCOME) == set(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_crash_leaves_old_or_new_whole(crashes: tuple[Path, dict[str, Any]], case: str) -> None:
    out, _ = crashes
    ckpt = out / case / "crashed" / "ckpt"
    version = OUTCOME[case]
    if version is None:
        assert not resolve(ckpt).exists(), "a crashed first save must leave nothing at the path"
        assert not ckpt.exists()
    else:
        assert_published_version(ckpt, version)


@pytest.mark.parametrize("case", list(CASES))
def test_next_save_succeeds_and_cleans_up(crashes: tuple[Path, dict[str, Any]], case: str) -> None:
    out, results = crashes
    assert results[case]["recover"] == [0, 0]
    ckpt = out / case / "recovered" / "ckpt"
    assert_published_version(ckpt, 3)
    verify_checkpoint(ckpt)  # the CRC-32s computed while writing match the bytes on disk
    assert leftovers(ckpt) == []
    assert sorted(p.name for p in ckpt.parent.iterdir() if not p.name.startswith("error.")) == ["ckpt"]


def test_crashed_ranks_really_died_or_failed(crashes: tuple[Path, dict[str, Any]]) -> None:
    _, results = crashes
    assert results["clean"]["crash"] == [0, 0]
    # Every fault point was reached: a case whose ranks all finished cleanly tested nothing (its outcome,
    # the old or the new version, is also what a save that never crashed leaves).
    quiet = [case for case in CASES if case != "clean" and results[case]["crash"] == [0, 0]]
    assert quiet == [], f"no rank crashed or failed in {quiet}"
    assert results["during_shards_all"]["crash"] == [-9, -9]
    assert results["after_write_rank1"]["crash"][1] == -9
    assert results["before_publish_rank0"]["crash"][0] == -9
    # An error on one rank is raised on every rank, the same StorageError (an OSError: exit code 3)
    # naming its cause and the rank where it happened.
    assert results["enospc_meta_rank0"]["crash"] == [3, 3]
    assert results["enospc_shards_rank1"]["crash"] == [3, 3]
    # ...also when only that rank (not rank 0) knows of it, after its DCP write or in its seal
    assert results["eio_after_shards_rank1"]["crash"] == [3, 3]
    assert results["eio_seal_rank1"]["crash"] == [3, 3]


def test_fallback_crash_between_renames_is_recovered_by_resolve(crashes: tuple[Path, dict[str, Any]]) -> None:
    out, _ = crashes
    ckpt = out / "fallback_between_renames" / "crashed" / "ckpt"
    assert not ckpt.exists()
    real = resolve(ckpt)
    assert real.name.startswith(".ckpt.old-")


def test_error_messages_of_a_failed_save(crashes: tuple[Path, dict[str, Any]]) -> None:
    out, _ = crashes
    folder = out / "enospc_meta_rank0" / "crashed"
    for rank in (0, 1):  # the first words say what happened; the same message on every rank
        assert re.fullmatch(
            r"StorageError: No space left on device \(ENOSPC\): saving the checkpoint"
            r" '.*/enospc_meta_rank0/crashed/ckpt' failed on rank\(s\) 0 \(rank 0: No space left on device"
            r" \(simulated\)\)\. Free space there .*save_top_k.* The partial save was removed; the previous"
            r" checkpoint at that path, if any, is unchanged\.",
            (folder / f"error.rank{rank}.txt").read_text(),
        )
    folder = out / "enospc_shards_rank1" / "crashed"
    for rank in (0, 1):  # DCP reports a write error on every rank; the message names the rank it was on
        message = (folder / f"error.rank{rank}.txt").read_text()
        assert message.startswith("StorageError: No space left on device (ENOSPC): saving the checkpoint"), (
            message
        )
        assert "failed on rank(s) 1 (rank 1: No space left on device (simulated))" in message, message
    for case in ("eio_after_shards_rank1", "eio_seal_rank1"):  # rank 1 alone failed: every rank says so
        folder = out / case / "crashed"
        messages = [(folder / f"error.rank{rank}.txt").read_text() for rank in (0, 1)]
        assert messages[0] == messages[1], messages
        assert re.fullmatch(
            rf"StorageError: Input/output error \(EIO\): saving the checkpoint '.*/{case}/crashed/ckpt'"
            r" failed on rank\(s\) 1 \(rank 1: .*Input/output error \(simulated\).*\)\..*"
            r" The partial save was removed; the previous checkpoint at that path, if any, is unchanged\.",
            messages[0],
            flags=re.S,
        ), messages[0]
        assert not any(p.name.startswith(".ckpt.") for p in folder.iterdir()), sorted(folder.iterdir())
    # the seal's failure names the file whose fsync failed
    message = (out / "eio_seal_rank1" / "crashed" / "error.rank0.txt").read_text()
    assert re.search(r"\(rank 1: '[^']*/__1_0\.distcp' \(.*\): Input/output error", message), message
    # a peer killed mid-save: the survivor names it, from gloo's error and the ranks' marks
    message = (out / "after_write_rank1" / "crashed" / "error.rank0.txt").read_text()
    assert re.match(
        r"RanksLost: Saving the checkpoint '.*/after_write_rank1/crashed/ckpt' failed after writing,"
        r" before publishing: rank\(s\) 1 did not reach the checkpoint's step 'gathering the written files'"
        r" \(dead, hung, or slower than the timeout; rank 1 last reached 'preparing the save'; the collective"
        r" failed with RuntimeError: .*\)",
        message,
    ), message
    assert "The path holds the previous checkpoint or this one, whole" in message
