"""Train with FSDP1 on CPU (2 processes), save a sharded checkpoint, resume it under FSDP2.

    python examples/strategies_resume.py

It prints ``OK: FSDP1 checkpoint fsdp1.ckpt resumed under FSDP2, table (10, 4) exact``. Lightning starts
the second process itself. It writes into a new temporary folder, or into ``OUTPUT_DIR`` with
``python examples/strategies_resume.py OUTPUT_DIR``. The model has FSDP-sharded linear layers and a
``DTensor`` table held as a plain attribute; both strategies register the sharded-state hooks, so the table is
saved and restored with the weights. The resume runs under ``ShardedModelParallelStrategy`` (FSDP2),
whose ``fully_shard_policy`` shards the same plain model, and checks that the table and the weights
came back exactly.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
from torch.utils.data import DataLoader, TensorDataset

from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy


class TableModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 16)
        self.head = nn.Linear(16, 4)
        self.table: Any = None  # a DTensor: a sharded attribute, not a parameter

    def configure_model(self) -> None:
        if self.table is None:
            mesh = init_device_mesh("cpu", (self.trainer.world_size,))
            self.table = distribute_tensor(torch.zeros(10, 4), mesh, [Shard(0)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        rows = self.table.full_tensor()[ids]
        return (self.head(torch.relu(self.encoder(rows + 1))) - rows).pow(2).mean()

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            self.table.to_local().add_(1.0)  # this rank's rows change: only a real restore brings them back

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(torch.arange(32) % 10), batch_size=4)


def main(output: Path) -> None:
    common: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "logger": False,
        "enable_progress_bar": False,
    }
    checkpoint = output / "fsdp1.ckpt"  # a directory of shards

    model = TableModel()
    trainer = L.Trainer(strategy=ShardedFSDPStrategy(auto_wrap_policy={nn.Linear}), max_steps=3, **common)
    trainer.fit(model)
    trainer.save_checkpoint(checkpoint, weights_only=False)
    saved_table = model.table.full_tensor()

    resumed = TableModel()
    trainer = L.Trainer(
        strategy=ShardedModelParallelStrategy(fully_shard_policy={nn.Linear}),
        max_steps=3,  # already reached: the fit restores, then stops at once
        **common,
    )
    trainer.fit(resumed, ckpt_path=checkpoint)
    restored_table = resumed.table.full_tensor()
    if trainer.global_rank == 0:
        assert trainer.global_step == 3, trainer.global_step
        assert torch.equal(restored_table, saved_table), "the table was not restored"
        shape = tuple(saved_table.shape)
        print(f"OK: FSDP1 checkpoint {checkpoint.name} resumed under FSDP2, table {shape} exact")


def output_dir() -> Path:
    """``OUTPUT_DIR`` if given, else one new temporary folder, the same in every process.

    Lightning runs this script again for the other rank, with this process's environment: the folder
    made here travels in it (each process making its own would put rank 1 in another folder).
    """
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    return Path(os.environ.setdefault("STRATEGIES_RESUME_OUT", tempfile.mkdtemp(prefix="strategies_resume_")))


if __name__ == "__main__":
    main(output_dir())
