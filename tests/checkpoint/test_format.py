"""Format detection and the DCP index reader, in one process with no process group."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_sharded import CheckpointError
from lightning_sharded.checkpoint.dcp_index import read_sharded_layout
from lightning_sharded.checkpoint.detect import CheckpointKind, detect
from lightning_sharded.checkpoint.load.checks import KeyReport, summarize_keys
from lightning_sharded.checkpoint.state_dicts import key_by_index as _key_by_index


def detect_format(path: Path) -> CheckpointKind:
    return detect(path).kind


CheckpointFormat = CheckpointKind


def _sharded(path: Path, state: dict, meta: bool = True) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=path, no_dist=True)
    if meta:
        torch.save({"global_step": 1}, path / "meta.pt")
    return path


def test_detects_a_sharded_directory_and_a_full_file(tmp_path: Path) -> None:
    assert (
        detect_format(_sharded(tmp_path / "d", {"model": {"w": torch.zeros(2)}})) is CheckpointFormat.SHARDED
    )
    torch.save({"state_dict": {}}, tmp_path / "f.ckpt")
    assert detect_format(tmp_path / "f.ckpt") is CheckpointFormat.FULL


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (lambda p: None, FileNotFoundError, "does not exist"),
        (lambda p: p.mkdir(), CheckpointError, "is empty"),
        (lambda p: (p.mkdir(), (p / "x.txt").write_text("x")), CheckpointError, "not a sharded checkpoint"),
        (lambda p: _sharded(p, {"model": {"w": torch.zeros(1)}}, meta=False), CheckpointError, "'meta.pt'"),
    ],
    ids=["missing", "empty", "foreign", "no-meta"],
)
def test_paths_that_are_no_checkpoint(tmp_path: Path, make: object, error: type, fragment: str) -> None:
    path = tmp_path / "ckpt"
    make(path)  # type: ignore[operator]
    with pytest.raises(error, match=fragment) as info:
        detect_format(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("model_key", ["model", "state_dict"])
def test_layout_finds_the_model_key_and_the_optimizers(tmp_path: Path, model_key: str) -> None:
    state = {
        model_key: {"layer.weight": torch.zeros(3, 2), "table": torch.ones(4)},
        "optimizer_0": {
            "state": {"layer.weight": {"exp_avg": torch.zeros(3, 2)}},
            "param_groups": [{"lr": 0.1}],
        },
        "optimizer_1": {"state": {}, "param_groups": [{"lr": 0.2}]},
    }
    layout = read_sharded_layout(_sharded(tmp_path / "d", state))
    assert layout.model_key == model_key
    assert layout.model_entries == {"layer.weight": (3, 2), "table": (4,)}
    assert layout.optimizer_count == 2
    assert layout.entries["optimizer_0.state.layer.weight.exp_avg"] == (3, 2)


def test_layout_rejects_a_directory_without_model_state(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="holds no model state"):
        read_sharded_layout(_sharded(tmp_path / "d", {"weights": {"w": torch.zeros(1)}}))


def test_layout_names_a_truncated_or_missing_shard_file(tmp_path: Path) -> None:
    path = _sharded(tmp_path / "d", {"model": {"w": torch.zeros(1000)}})
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=rf"'{shard.name}' has 10 bytes"):
        read_sharded_layout(path)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"'{shard.name}' is missing"):
        read_sharded_layout(path)


def test_layout_names_an_unreadable_index(tmp_path: Path) -> None:
    path = _sharded(tmp_path / "d", {"model": {"w": torch.zeros(1)}})
    (path / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="Could not read the DCP index"):
        read_sharded_layout(path)


def test_key_report_and_summaries() -> None:
    report = KeyReport(["a", "b", "c"], ["b", "c", "d"])
    assert (report.missing, report.unexpected, report.common) == (["a"], ["d"], ["b", "c"])
    assert (
        report.describe()
        == 'Missing key(s) in the checkpoint: "a". Unexpected key(s) in the checkpoint: "d".'
    )
    assert not KeyReport(["a"], ["a"])
    assert summarize_keys([str(i) for i in range(12)], limit=2) == '"0", "1", ... (10 more)'


def test_name_keyed_optimizer_state_becomes_index_keyed() -> None:
    state = {
        "state": {"b.w": {"step": 1}, "a.w": {"step": 2}},
        "param_groups": [{"lr": 0.1, "params": ["a.w"]}, {"lr": 0.2, "params": ["b.w"]}],
    }
    assert _key_by_index(state) == {
        "state": {1: {"step": 1}, 0: {"step": 2}},
        "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1]}],
    }
