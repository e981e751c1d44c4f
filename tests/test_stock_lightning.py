"""Checkpoints written by stock Lightning's ModelParallelStrategy (FSDP2) and FSDPStrategy (FSDP1), 2 real
ranks on gloo, read in one process: load_checkpoint, consolidate then a stock single-device resume and
load_from_checkpoint, the mixin's load_from_checkpoint on the directory, verify and inspect."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_sharded import CheckpointError, consolidate_checkpoint, load_checkpoint, verify_checkpoint
from lightning_sharded.checkpoint.tools import inspect_checkpoint
from tests._compare import assert_same
from tests.distributed.launch import run_ranks
from tests.distributed.tiny_models import TinyModel, TinyShardedModel

SCRIPT = Path(__file__).parent / "distributed" / "stock_lightning.py"


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stock")
    run_ranks(SCRIPT, 2, str(out), "mp", "fsdp", timeout=240)
    return out


@pytest.fixture(scope="module")
def stock(stock_run: Path) -> tuple[Path, dict[str, Any]]:
    """The ModelParallelStrategy checkpoint and its full values."""
    return stock_run / "mp.ckpt", torch.load(stock_run / "mp.expected.pt", weights_only=False)


@pytest.fixture(scope="module")
def stock_fsdp(stock_run: Path) -> tuple[Path, dict[str, Any]]:
    """The FSDPStrategy (FSDP1) checkpoint and its full model values."""
    return stock_run / "fsdp.ckpt", torch.load(stock_run / "fsdp.expected.pt", weights_only=False)


def torch_form(optimizer: dict[str, Any]) -> dict[str, Any]:
    """DCP's FQN-keyed optimizer state in torch's index form, numbered in parameter-group order."""
    names = [n for group in optimizer["param_groups"] for n in group["params"]]
    index = {n: i for i, n in enumerate(names)}
    return {
        "state": {index[n]: s for n, s in optimizer["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optimizer["param_groups"]],
    }


def test_load_checkpoint_reads_the_stock_directory(stock: tuple[Path, dict[str, Any]]) -> None:
    ckpt, expected = stock
    loaded = load_checkpoint(ckpt)
    assert_same(loaded["state_dict"], expected["state_dict"])
    assert_same(loaded["optimizer_states"], [torch_form(expected["optimizer"])])
    assert loaded["global_step"] == expected["global_step"] == 3
    assert {"epoch", "loops", "callbacks", "hyper_parameters", "pytorch-lightning_version"} <= set(loaded)
    # indices follow the order of the model's parameters, as Optimizer.state_dict() numbers them
    names = [n for group in expected["optimizer"]["param_groups"] for n in group["params"]]
    assert names == [n for n, _ in TinyModel().named_parameters()]


def test_verify_and_inspect_without_manifest(stock: tuple[Path, dict[str, Any]]) -> None:
    ckpt, _ = stock
    report = verify_checkpoint(ckpt)
    assert not report.has_manifest and "no manifest" in report.notes[0]
    info = inspect_checkpoint(ckpt)
    assert info.world_size == 2 and info.global_step == 3 and not info.has_manifest
    weight = next(e for e in info.entries if e.key == "state_dict.net.0.weight")
    assert weight.shape == [8, 4] and weight.dtype == "torch.float32" and weight.shards == 2
    assert weight.size == 8 * 4 * 4


class Capture(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state_dict = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.global_step = trainer.global_step


def test_consolidate_then_stock_resume_and_load(stock: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    ckpt, expected = stock
    out = consolidate_checkpoint(ckpt, tmp_path / "full.ckpt", progress=False)
    plain = torch.load(out, weights_only=False)
    assert_same(plain["state_dict"], expected["state_dict"])
    assert verify_checkpoint(out).files == 1

    capture = Capture()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[capture],
    )
    trainer.fit(TinyModel(), ckpt_path=out)
    assert capture.global_step == 3
    assert_same(capture.state_dict, expected["state_dict"])
    assert_same(capture.optimizer["state"], torch_form(expected["optimizer"])["state"])
    assert trainer.global_step == 4

    model = TinyModel.load_from_checkpoint(out)
    assert_same({k: v.detach() for k, v in model.state_dict().items()}, expected["state_dict"])


def test_mixin_load_from_checkpoint_reads_a_directory(stock: tuple[Path, dict[str, Any]]) -> None:
    ckpt, expected = stock
    model = TinyShardedModel.load_from_checkpoint(ckpt)
    assert model.hparams["hidden"] == 8
    assert_same({k: v.detach() for k, v in model.state_dict().items()}, expected["state_dict"])
    with torch.no_grad():
        assert model(torch.ones(1, 4)).shape == (1, 2)


def test_mixin_load_from_checkpoint_shape_mismatch(stock: tuple[Path, dict[str, Any]]) -> None:
    ckpt, _ = stock
    with pytest.raises(
        CheckpointError,
        match=r"(?s)does not fit TinyShardedModel.*size mismatch for net\.0\.weight.*hyperparameters",
    ):
        TinyShardedModel.load_from_checkpoint(ckpt, hidden=16)


def test_mixin_load_from_checkpoint_of_a_file_is_unchanged(
    stock: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    ckpt, expected = stock
    out = consolidate_checkpoint(ckpt, tmp_path / "full.ckpt", progress=False)
    model = TinyShardedModel.load_from_checkpoint(str(out))
    assert_same({k: v.detach() for k, v in model.state_dict().items()}, expected["state_dict"])


def test_load_checkpoint_reads_a_stock_fsdp1_directory(stock_fsdp: tuple[Path, dict[str, Any]]) -> None:
    ckpt, expected = stock_fsdp
    loaded = load_checkpoint(ckpt)
    assert_same(loaded["state_dict"], expected["state_dict"])
    assert loaded["global_step"] == 3
    (optimizer,) = loaded["optimizer_states"]
    names = [n for n, _ in TinyModel().named_parameters()]
    assert optimizer["param_groups"][0]["params"] == list(range(len(names)))
    for i, name in enumerate(names):
        state = optimizer["state"][i]
        assert state["exp_avg"].shape == expected["state_dict"][name].shape
        assert state["exp_avg_sq"].shape == expected["state_dict"][name].shape
        assert state["step"].item() == 3


def test_consolidate_stock_fsdp1_then_stock_resume(
    stock_fsdp: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    ckpt, expected = stock_fsdp
    out = consolidate_checkpoint(ckpt, tmp_path / "full.ckpt", progress=False)
    capture = Capture()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[capture],
    )
    trainer.fit(TinyModel(), ckpt_path=out)
    assert capture.global_step == 3
    assert_same(capture.state_dict, expected["state_dict"])
    assert_same(capture.optimizer["state"], load_checkpoint(ckpt)["optimizer_states"][0]["state"])
