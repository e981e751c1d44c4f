"""ShardedStateMixin on a LightningModule: hyperparameters, and a real single-process fit and resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
from torch.utils.data import DataLoader, TensorDataset

from lightning_sharded import ShardedStateMixin, has_sharded_state_hooks
from tests._compare import quiet_trainer

pytestmark = pytest.mark.usefixtures("process_group")


class TableModel(ShardedStateMixin, L.LightningModule):
    def __init__(self, vocab: int = 8, dim: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.proj = nn.Linear(dim, 1)
        self.table: DTensor | None = None

    def configure_model(self) -> None:
        if self.table is None:
            mesh = init_device_mesh("cpu", (1,))
            self.table = distribute_tensor(
                torch.zeros(self.hparams.vocab, self.hparams.dim), mesh, [Shard(0)]
            )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        assert self.table is not None
        with torch.no_grad():  # a hand-updated sharded buffer, as a cache or a running statistic would be
            self.table.to_local().add_(x.sum())
        return self.proj(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class PlainModel(TableModel):
    """The same model without the hooks (the mixin's __init__ is skipped), to show what is lost."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.save_hyperparameters({"vocab": 8, "dim": 4, "lr": 0.1})
        self.proj = nn.Linear(4, 1)
        self.table = None


def data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)


def trainer(root: Path, epochs: int) -> L.Trainer:
    return quiet_trainer(devices=1, max_epochs=epochs, default_root_dir=root)


def test_hyperparameters_and_hooks() -> None:
    model = TableModel(vocab=5, lr=0.5)
    assert model.hparams.vocab == 5 and model.hparams.lr == 0.5
    assert has_sharded_state_hooks(model)
    model.configure_model()
    assert "table" in model.state_dict()


def test_fit_checkpoint_and_resume_restores_the_table(tmp_path: Path) -> None:
    model = TableModel()
    first = trainer(tmp_path, epochs=1)
    first.fit(model, data())
    ckpt = tmp_path / "one.ckpt"
    first.save_checkpoint(ckpt)
    assert model.table is not None
    saved = model.table.full_tensor().clone()
    assert saved.abs().sum() > 0
    stored = torch.load(ckpt, weights_only=False)["state_dict"]["table"]
    assert type(stored) is torch.Tensor  # gathered: a one-file checkpoint holds no DTensor
    assert torch.equal(stored, saved)

    resumed = TableModel()
    second = trainer(tmp_path, epochs=1)  # max_epochs reached: restore only, no further step
    second.fit(resumed, data(), ckpt_path=ckpt)
    assert resumed.table is not None
    assert torch.equal(resumed.table.full_tensor(), saved)
    assert torch.equal(resumed.proj.weight, model.proj.weight)

    loaded = TableModel.load_from_checkpoint(ckpt)
    loaded.configure_model()
    assert loaded.hparams.vocab == 8


def test_without_the_mixin_the_table_is_lost(tmp_path: Path) -> None:
    model = PlainModel()
    t = trainer(tmp_path, epochs=1)
    t.fit(model, data())
    t.save_checkpoint(tmp_path / "plain.ckpt")
    assert "table" not in torch.load(tmp_path / "plain.ckpt", weights_only=False)["state_dict"]
