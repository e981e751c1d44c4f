"""Rank script: sharded checkpoints holding everything Lightning pickles, for the safe-unpickling tests.

For each strategy named on the command line (``mp``, ``fsdp``: this library's; ``stock-mp``,
``stock-fsdp``: Lightning's), 2 ranks fit :class:`PickleModel` for 4 steps and ``ModelCheckpoint``
saves ``OUT/<name>/epoch=0-step=4.ckpt``. The checkpoint holds ``save_hyperparameters()`` of plain
values, a nested ``AttributeDict``, an ``argparse.Namespace`` and a ``pathlib`` path; an Adam optimizer
and a ``StepLR`` schedule; the states of ``ModelCheckpoint``, ``EarlyStopping`` and
``LearningRateMonitor`` (with a CSV logger, which it needs); and the loops.

Usage: ranks started by ``launch.run_ranks(script, 2, OUT, "mp", "fsdp", "stock-mp", "stock-fsdp")``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.utilities.data import AttributeDict  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy  # noqa: E402
from tests.distributed.stock_lightning import StockCpuFSDP, main  # noqa: E402
from tests.distributed.tiny_models import TinyModel  # noqa: E402

HPARAMS: dict[str, Any] = {
    "hidden": 8,
    "cfg": AttributeDict(lr=0.01, betas=(0.9, 0.99), layers=[4, 8]),
    "args": argparse.Namespace(seed=1, name="run"),
    "data_dir": Path("/data/train"),
}


class PickleModel(TinyModel):
    """``TinyModel`` with non-plain hyperparameters, a logged loss and an LR schedule."""

    def __init__(
        self,
        hidden: int = 8,
        cfg: AttributeDict | None = None,
        args: argparse.Namespace | None = None,
        data_dir: Path | None = None,
    ) -> None:
        super().__init__(hidden)
        self.save_hyperparameters()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)]


def callbacks(dirpath: Path) -> list[L.Callback]:
    """ModelCheckpoint (every 4 steps), EarlyStopping on the loss, LearningRateMonitor."""
    return [
        ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4),
        EarlyStopping(monitor="loss", check_on_train_epoch_end=True),
        LearningRateMonitor(logging_interval="step"),
    ]


def strategy(name: str) -> Any:
    if name == "mp":
        return ShardedModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if name == "fsdp":
        return ShardedFSDPStrategy(state_dict_type="sharded")
    if name == "stock-mp":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if name == "stock-fsdp":
        return StockCpuFSDP(state_dict_type="sharded")
    raise SystemExit(f"unknown strategy {name}")


def run(out: Path, name: str) -> None:
    L.seed_everything(1)
    trainer = L.Trainer(
        strategy=strategy(name),
        accelerator="cpu",
        devices=2,
        max_steps=4,
        logger=CSVLogger(out / "logs", name=name),
        callbacks=callbacks(out / name),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(PickleModel(**HPARAMS))


if __name__ == "__main__":
    main(run)  # stock_lightning.main: each case, then the same exit
