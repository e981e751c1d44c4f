"""Parameters whose local shapes differ per rank (per-rank pieces of a sharded table, an empty piece on
one rank, an uneven DTensor): their optimizer state is saved whole and restored exactly at 2 and 1
processes, and a checkpoint whose state does not fit is refused naming the key and both shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import run_batch

SCRIPT = Path(__file__).with_name("distributed") / "scenario_uneven.py"

pytestmark = pytest.mark.slow


def _run(root: Path, world: int, jobs: list[list[str]]) -> None:
    jobs_file = root / f"jobs-{world}-{len(list(root.iterdir()))}.pt"
    torch.save(jobs, jobs_file)
    run_batch(SCRIPT, world, jobs_file, timeout=300)


def _load(path: Path) -> Any:
    result = torch.load(path, weights_only=False)
    assert "traceback" not in result or result.get("error") is None, result.get("traceback")
    return result


def _differ(saved: dict[str, Any], restored: dict[str, Any], prefix: str = "") -> list[str]:
    keys = [k for k in saved if k.startswith(prefix)]
    assert keys
    return [k for k in keys if k not in restored or not torch.equal(torch.as_tensor(saved[k]), restored[k])]


@pytest.fixture(scope="module")
def mp_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("uneven-mp")
    ck = str(root / "ck")
    _run(
        root,
        2,
        [
            ["fit", "--strategy", "mp", "--ckpt", ck, "--out", str(root / "fit.pt")],
            ["resume", "--strategy", "mp", "--ckpt", ck, "--out", str(root / "resume2.pt"), "--steps", "5"],
            [
                "fit",
                "--strategy",
                "mp",
                "--ckpt",
                str(root / "ck5"),
                "--out",
                str(root / "fit5.pt"),
                "--steps",
                "5",
            ],
            [
                "fit",
                "--strategy",
                "mp",
                "--ckpt",
                str(root / "old"),
                "--out",
                str(root / "old.pt"),
                "--unwrapped",
            ],
            ["resume", "--strategy", "mp", "--ckpt", str(root / "old"), "--out", str(root / "old-resume.pt")],
            [
                "fit",
                "--strategy",
                "mp",
                "--ckpt",
                str(root / "ragged"),
                "--out",
                str(root / "ragged.pt"),
                "--ragged",
                "--unwrapped",
            ],
            [
                "fit",
                "--strategy",
                "mp",
                "--ckpt",
                str(root / "ragged-new"),
                "--out",
                str(root / "ragged-save.pt"),
                "--ragged",
            ],
            [
                "resume",
                "--strategy",
                "mp",
                "--ckpt",
                str(root / "ragged"),
                "--out",
                str(root / "ragged-resume.pt"),
                "--ragged",
            ],
        ],
    )
    _run(
        root,
        1,
        [["resume", "--strategy", "mp", "--ckpt", ck, "--out", str(root / "resume1.pt"), "--steps", "5"]],
    )
    return root


@pytest.mark.parametrize("resume", ["resume2", "resume1"])
def test_pieces_state_restored_exactly(mp_runs: Path, resume: str) -> None:
    """Every table (an empty piece on rank 0, an uneven split) and every optimizer state tensor, gathered,
    equals what the saving run held; the tables' training after the resume matches the unbroken run.
    On main the tables' exp_avg / exp_avg_sq came back as one rank's copy (or were refused at 1 process)."""
    saved = _load(mp_runs / "fit.pt")
    result = _load(mp_runs / f"{resume}.pt")
    assert _differ(saved, result["restored"]) == []
    assert _differ(_load(mp_runs / "fit5.pt"), result["final"], "opt.pieces") == []
    assert _differ(_load(mp_runs / "fit5.pt"), result["final"], "model.pieces") == []


def test_state_saved_per_rank_is_refused_naming_key_and_shapes(mp_runs: Path) -> None:
    """A checkpoint whose pieces' state is one rank's plain copy (how main saved it) is refused on every
    rank with the key and both shapes, never loaded into another rank's piece."""
    result = torch.load(mp_runs / "old-resume.pt", weights_only=False)
    assert result.get("error") == "CheckpointError", result
    message = result["message"]
    assert "size mismatch for optimizer_0.state.pieces." in message
    assert "the model [5, 4]" in message
    assert "the checkpoint has shape [" in message


def test_plain_per_rank_parameter_is_refused_naming_key_and_shapes(mp_runs: Path) -> None:
    """A checkpoint holding one rank's copy of a plain parameter of another shape on each rank (nothing
    says how its pieces fit; saved as main did) is refused on every rank with its key and both shapes (on
    main rank 1 raised alone and rank 0 read on: a hang)."""
    result = torch.load(mp_runs / "ragged-resume.pt", weights_only=False)
    assert result.get("error") == "CheckpointError", result
    assert "size mismatch for ragged: the checkpoint has shape [" in result["message"]


def test_fsdp1_pieces_state_continues_like_the_unbroken_run(tmp_path: Path) -> None:
    """Under FSDP1 (the pieces left out of FSDP): the resumed run's tables and their optimizer state end
    where the unbroken run's do (on main the resume was refused: "size mismatch ... the model [0]")."""
    ck = str(tmp_path / "ck")
    _run(
        tmp_path,
        2,
        [
            ["fit", "--strategy", "fsdp", "--ckpt", ck, "--out", str(tmp_path / "fit.pt")],
            [
                "resume",
                "--strategy",
                "fsdp",
                "--ckpt",
                ck,
                "--out",
                str(tmp_path / "resume.pt"),
                "--steps",
                "5",
            ],
            [
                "fit",
                "--strategy",
                "fsdp",
                "--ckpt",
                str(tmp_path / "ck5"),
                "--out",
                str(tmp_path / "fit5.pt"),
                "--steps",
                "5",
            ],
        ],
    )
    final = _load(tmp_path / "resume.pt")["final"]
    assert _differ(_load(tmp_path / "fit5.pt"), final, "opt.pieces") == []
    assert _differ(_load(tmp_path / "fit5.pt"), final, "model.pieces") == []


def test_plain_per_rank_parameter_is_refused_at_the_save(mp_runs: Path) -> None:
    """Its save is refused on every rank, naming the key, both shapes and ranks (on main DCP wrote one
    rank's copy without a word), and nothing is left at the path."""
    result = torch.load(mp_runs / "ragged-save.pt", weights_only=False)
    assert result.get("error") == "CheckpointError", result
    assert (
        "size mismatch for state_dict.ragged: rank 0 holds shape [1, 2], rank 1 [2, 2]" in result["message"]
    )
    assert not (mp_runs / "ragged-new").exists()
