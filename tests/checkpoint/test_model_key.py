"""Where a sharded checkpoint keeps its model state has one answer (``dcp_index.model_key``): every load,
tool and export finds the same key, and refuses a checkpoint with neither key, or both, with the same
error. In one process, no process group."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sharded import (
    CheckpointError,
    consolidate_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    load_pretrained,
    verify_checkpoint,
)
from lightning_sharded.checkpoint.commit import commit_directory
from lightning_sharded.checkpoint.load import restore_checkpoint


def _save(path: Path, state: dict[str, Any]) -> Path:
    """A sharded checkpoint of ``state`` (top-level keys as given), with ``meta.pt`` and a manifest."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    def write(staging: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            _save_state_dict(state, FileSystemWriter(staging), no_dist=True)
        torch.save({"epoch": 0, "global_step": 1}, staging / "meta.pt")

    commit_directory(path, write, metadata={"epoch": 0, "global_step": 1})
    return path


def _model() -> nn.Module:
    return nn.Linear(3, 2)


#: Every reader of a sharded checkpoint's model state, as a user calls it (``out``: a fresh directory).
READERS: dict[str, Callable[[Path, Path], Any]] = {
    "restore_checkpoint": lambda path, out: restore_checkpoint(path, _model()),
    "load_checkpoint": lambda path, out: load_checkpoint(path),
    "consolidate": lambda path, out: consolidate_checkpoint(path, out / "full.ckpt", progress=False),
    "export": lambda path, out: consolidate_checkpoint(
        path, out / "hf", format="safetensors", progress=False
    ),
    "load_pretrained": lambda path, out: load_pretrained(_model(), path),
    "inspect": lambda path, out: inspect_checkpoint(path),
    "verify": lambda path, out: verify_checkpoint(path),
}


@pytest.mark.parametrize("key", ["model", "state_dict"])
def test_every_reader_finds_the_model_under_either_key(tmp_path: Path, key: str) -> None:
    weights = {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.ones(2)}
    path = _save(tmp_path / "ckpt", {key: weights, "optimizer_0": {"state": {}, "param_groups": [{"lr": 1}]}})
    model = _model()
    restore_checkpoint(path, model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert sorted(load_checkpoint(path)["state_dict"]) == ["bias", "weight"]
    full = torch.load(consolidate_checkpoint(path, tmp_path / "full.ckpt", progress=False), weights_only=True)
    assert sorted(full["state_dict"]) == ["bias", "weight"]
    from safetensors.torch import load_file

    out = consolidate_checkpoint(path, tmp_path / "hf", format="safetensors", progress=False)
    assert sorted(load_file(Path(out) / "model.safetensors")) == ["bias", "weight"]
    pretrained = _model()
    load_pretrained(pretrained, path)
    assert torch.equal(pretrained.weight, weights["weight"])
    assert {e.key for e in inspect_checkpoint(path).entries} >= {f"{key}.weight", f"{key}.bias"}
    verify_checkpoint(path)


@pytest.mark.parametrize(
    ("tops", "pattern"),
    [
        (
            ("model", "state_dict"),
            r"holds model state under both 'model' and 'state_dict': no Lightning strategy writes both",
        ),
        (("weights",), r"has no model state: none of the keys \['state_dict', 'model'\] among its top-level"),
    ],
    ids=["both", "neither"],
)
def test_every_reader_refuses_neither_key_or_both_with_the_same_error(
    tmp_path: Path, tops: tuple[str, ...], pattern: str
) -> None:
    path = _save(
        tmp_path / "ckpt", {top: {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)} for top in tops}
    )
    messages = {}
    for name, read in READERS.items():
        out = tmp_path / name
        out.mkdir()
        with pytest.raises(CheckpointError) as raised:
            read(path, out)
        messages[name] = str(raised.value)
        assert list(out.iterdir()) == [], f"{name} wrote something"
    assert all(re.search(pattern, message) for message in messages.values()), messages
    assert len(set(messages.values())) == 1, messages  # one rule, one message
