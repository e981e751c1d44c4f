"""ShardedStateMixin under stock DDP on CPU, in 2 processes: a hand-sharded table survives a resume.

The table is a ``DTensor`` sharded row-wise over the 2 ranks and updated by hand in every step (as a
cache or a running statistic would be). Without the mixin, ``state_dict()`` does not see it and a
resume silently starts from zeros; with it, the checkpoint holds the whole table (gathered from both
ranks, since DDP writes one file) and the resume cuts each rank's rows back out.

Run it (Lightning starts the second process itself)::

    python examples/mixin_ddp.py

It prints ``OK: table (10, 4) sharded over 2 ranks restored exactly (sum ...)``. It writes into a new
temporary folder, or into ``OUT_DIR`` with ``python examples/mixin_ddp.py OUT_DIR``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
from torch.utils.data import DataLoader, TensorDataset

from lightning_sharded import ShardedStateMixin


class TableModel(ShardedStateMixin, L.LightningModule):
    def __init__(self, rows: int = 10, dim: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.proj = nn.Linear(dim, 1)
        self.table: DTensor | None = None

    def configure_model(self) -> None:
        if self.table is None:
            mesh = init_device_mesh("cpu", (self.trainer.world_size,))
            zeros = torch.zeros(self.hparams.rows, self.hparams.dim)
            self.table = distribute_tensor(zeros, mesh, [Shard(0)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        assert self.table is not None
        with torch.no_grad():
            self.table.to_local().add_(x.mean() + self.global_rank + 1)
        return self.proj(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(root: Path, epochs: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=epochs,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def main(out: Path) -> None:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
    first = trainer(out, epochs=2)
    model = TableModel()
    first.fit(model, data)
    ckpt = out / "table.ckpt"
    first.save_checkpoint(ckpt, weights_only=False)
    assert model.table is not None
    saved = model.table.full_tensor()

    second = trainer(out, epochs=2)  # max_epochs reached: a pure restore
    resumed = TableModel()
    second.fit(resumed, data, ckpt_path=ckpt)
    assert resumed.table is not None
    restored = resumed.table.full_tensor()
    if not torch.equal(restored, saved) or saved.abs().sum() == 0:
        raise SystemExit(f"rank {dist.get_rank()}: the table was not restored:\n{restored}\n!=\n{saved}")
    if second.global_rank == 0:
        print(f"OK: table {tuple(saved.shape)} sharded over 2 ranks restored exactly (sum {saved.sum():.3f})")


def output_dir() -> Path:
    """``OUT_DIR`` if given, else one new temporary folder, the same in every process.

    Lightning runs this script again for the other rank, with this process's environment: the folder
    made here travels in it (each process making its own would put rank 1 in another folder).
    """
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    return Path(os.environ.setdefault("MIXIN_DDP_OUT", tempfile.mkdtemp(prefix="mixin_ddp_")))


if __name__ == "__main__":
    main(output_dir())
