"""Exact resume (issue 14): every rank's RNG and train dataloader state saved with the checkpoint and
restored, so the steps after a resume equal the unbroken run's, on both ranks, with both strategies,
sharded and full (and async); what another world size restores and says; stock Lightning resumes it;
what the files hold, and what verify, inspect and consolidate do with them.

One run of ``tests/distributed/scenario_rank_state.py`` (see its docstring) serves every test.
"""

from __future__ import annotations

import fractions
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharded import CheckpointError, consolidate_checkpoint, load_checkpoint, verify_checkpoint
from lightning_sharded.checkpoint import names
from lightning_sharded.checkpoint.checksum import file_checksum
from lightning_sharded.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest
from lightning_sharded.checkpoint.tools import inspect_checkpoint
from lightning_sharded.cli import main as cli
from tests._compare import assert_same
from tests.distributed.scenario_rank_state import CASES, SAVED_AT, STEPS, checkpoint_of

SCRIPT = Path(__file__).parents[1] / "distributed" / "scenario_rank_state.py"
RESUMED = list(range(SAVED_AT + 1, STEPS + 1))


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rank_state")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    return root


def result(out: Path, case: str, phase: str, rank: int = 0) -> dict[str, Any]:
    failed = out / f"{case}.failed.rank{rank}.pt"
    assert not failed.exists(), torch.load(failed, weights_only=False)["failed"]
    return torch.load(out / f"{case}.{phase}.rank{rank}.pt", weights_only=False)  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rank", [0, 1])
def test_every_resumed_step_equals_the_unbroken_run(out: Path, case: str, rank: int) -> None:
    unbroken, resumed = result(out, case, "unbroken", rank), result(out, case, "resume", rank)
    assert resumed["start"] == SAVED_AT
    assert sorted(resumed["losses"]) == RESUMED
    assert {s: resumed["losses"][s] for s in RESUMED} == {s: unbroken["losses"][s] for s in RESUMED}
    assert len(resumed["values"]) == len(unbroken["values"]) == 5  # 4 parameters (shards) and the DTensor
    assert all(torch.equal(a, b) for a, b in zip(resumed["values"], unbroken["values"], strict=True))


@pytest.mark.parametrize("rank", [0, 1])
def test_stock_model_parallel_resumes_a_directory_with_rank_state(out: Path, rank: int) -> None:
    stock, unbroken = result(out, "stock-mp", "resume", rank), result(out, "mp-sharded", "unbroken", rank)
    assert stock["start"] == SAVED_AT and sorted(stock["losses"]) == RESUMED
    # Without the per-rank state (stock Lightning ignores it) the continuation is another one.
    assert all(stock["losses"][s] != unbroken["losses"][s] for s in RESUMED)


def test_stock_single_device_resumes_a_full_file_with_rank_state(out: Path) -> None:
    stock = result(out, "stock-single", "resume")
    assert stock["start"] == SAVED_AT and sorted(stock["losses"]) == RESUMED
    saved = torch.load(checkpoint_of(out, "fsdp-full"), weights_only=True)
    assert names.RANK_STATE_KEY in saved
    assert stock["state"].keys() == saved["state_dict"].keys()
    assert all(torch.equal(stock["state"][k], saved["state_dict"][k]) for k in saved["state_dict"])


@pytest.mark.parametrize("case", ["mp-sharded", "fsdp-full"])
def test_a_smaller_world_restores_the_model_and_says_what_it_did_not(out: Path, case: str) -> None:
    smaller = result(out, f"smaller-{case}", "resume")
    path = checkpoint_of(out, case)
    assert smaller["warnings"] == [
        f"The per-rank state of {str(path)!r} was saved by 2 rank(s), this run has 1. The random number"
        " generator states (torch, CUDA, random, numpy) were not restored: they belong to ranks that do not"
        " exist now, so every rank keeps its generators as they are (call `lightning.seed_everything` for a"
        " reproducible continuation). The train dataloader state was not restored either: it differs"
        " between the saved ranks (each had its own position or shuffle), so every train dataloader starts"
        " from its beginning. The model and optimizer states were restored (resharded)."
    ]
    assert smaller["start"] == SAVED_AT and sorted(smaller["losses"]) == RESUMED
    saved = load_checkpoint(path)["state_dict"]
    assert smaller["state"].keys() == saved.keys()
    assert all(torch.equal(smaller["state"][k], saved[k]) for k in saved)


@pytest.mark.parametrize("case", ["mp-sharded", "fsdp-sharded"])
def test_a_sharded_directory_lists_each_ranks_file_in_its_manifest(out: Path, case: str) -> None:
    path = checkpoint_of(out, case)
    manifest = Manifest.from_json((path / MANIFEST_NAME).read_text())
    entries = {e.path: e for e in manifest.files}
    for rank in (0, 1):
        entry = entries[f"rank_state/rank-0000{rank}.pt"]
        assert entry.rank == rank and entry.size == (path / entry.path).stat().st_size
        state = torch.load(path / entry.path, weights_only=True)
        assert (state["rank"], state["world_size"]) == (rank, 2)
        assert set(state["rng"]) == {"torch", "python", "numpy"}
        assert state["train_dataloader"] is not None
    meta = torch.load(path / names.LIGHTNING_METADATA, weights_only=True)
    assert meta[names.RANK_STATE_KEY] == {"format": 1, "world_size": 2, "dir": "rank_state"}
    assert verify_checkpoint(path).files == len(manifest.files) + 1  # and the manifest itself


def test_a_full_file_holds_every_ranks_state(out: Path) -> None:
    saved = torch.load(checkpoint_of(out, "mp-full"), weights_only=True)
    entry = saved[names.RANK_STATE_KEY]
    assert entry["world_size"] == 2 and [s["rank"] for s in entry["ranks"]] == [0, 1]
    loaders = [s["train_dataloader"] for s in entry["ranks"]]
    # Lightning keeps rank 0's loader state in the loops; rank 1's own differs (its own shuffle).
    assert_same(loaders[0], saved["loops"]["fit_loop"]["state_dict"]["combined_loader"])
    with pytest.raises(AssertionError, match="values differ"):
        assert_same(loaders[1], loaders[0])


def test_a_damaged_rank_file_fails_verify_naming_it(out: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint_of(out, "mp-sharded"), copy)
    damaged = copy / "rank_state" / "rank-00001.pt"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    named = r"'rank_state/rank-00001\.pt' \(written by rank 1\) is corrupted"
    with pytest.raises(CheckpointError, match=named):
        verify_checkpoint(copy)


def test_inspect_shows_the_per_rank_state(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_checkpoint(checkpoint_of(out, "mp-sharded")).rank_state_ranks == 2
    info = inspect_checkpoint(checkpoint_of(out, "fsdp-full"))
    assert info.rank_state_ranks == 2
    assert not any(e.key.startswith(names.RANK_STATE_KEY) for e in info.entries)
    assert cli(["inspect", str(checkpoint_of(out, "fsdp-sharded"))]) == 0
    shown = capsys.readouterr().out
    assert "rank state:  2 rank(s): RNG and train dataloader state, per rank\n" in shown


def test_consolidate_keeps_rank_zeros_loader_state_and_says_it_drops_the_rest(
    out: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = checkpoint_of(out, "mp-sharded")
    with caplog.at_level(logging.INFO, logger="lightning_sharded"):
        full = consolidate_checkpoint(path, tmp_path / "full.ckpt", progress=False)
    assert (
        f"{path} holds the per-rank state (RNG, train dataloader) of 2 rank(s); the output keeps rank 0's"
        " train dataloader state where Lightning keeps it (the loops) and drops the rest, RNG included"
    ) in caplog.text
    plain = torch.load(full, weights_only=True)
    assert names.RANK_STATE_KEY not in plain
    rank0 = torch.load(path / "rank_state" / "rank-00000.pt", weights_only=True)["train_dataloader"]
    assert_same(plain["loops"]["fit_loop"]["state_dict"]["combined_loader"], rank0)
    assert inspect_checkpoint(full).rank_state_ranks is None


def test_verify_refuses_a_rank_file_holding_an_unsafe_type(out: Path, tmp_path: Path) -> None:
    """The per-rank files are pickles too: verify checks them statically, as it checks meta.pt."""
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint_of(out, "fsdp-sharded"), copy)
    rank_file = copy / "rank_state" / "rank-00001.pt"
    state = torch.load(rank_file, weights_only=True)
    state["train_dataloader"] = fractions.Fraction(1, 3)  # not on torch's weights_only list
    torch.save(state, rank_file)
    manifest = Manifest.from_json((copy / MANIFEST_NAME).read_text())
    size, crc = file_checksum(rank_file)
    manifest.files = [
        FileEntry(e.path, size, crc, e.rank) if e.path == "rank_state/rank-00001.pt" else e
        for e in manifest.files
    ]
    (copy / MANIFEST_NAME).write_text(manifest.to_json())
    named = r"The per-rank state 'rank_state/rank-00001\.pt' .*\(rank 1\)"
    with pytest.raises(CheckpointError, match=named) as err:
        verify_checkpoint(copy)
    assert "fractions.Fraction" in str(err.value)
