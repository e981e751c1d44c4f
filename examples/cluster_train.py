"""Train under torchrun (one agent per node) or srun, checkpointing sharded to a path or an S3 URL.

    torchrun --standalone --nproc-per-node 2 examples/cluster_train.py --ckpt runs/last.ckpt

It prints ``resumed from step 0, saved step 5 to runs/last.ckpt``; run it again and it prints
``resumed from step 5, saved step 10 to runs/last.ckpt``. (``--standalone``: one node, a free port on
this machine.) ``--ckpt`` may be an S3 URL
(``s3://ckpts/run1/last.ckpt``, credentials and endpoint from the usual AWS variables), and the
multi-node commands are in ``docs/cluster.md``.

Lightning sizes the job from the launcher's environment (``num_nodes`` from ``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE``). Every run trains ``--steps`` more steps and saves sharded to ``--ckpt``,
resuming from it first when a checkpoint is there: run it twice and the second run starts at the
step the first one saved. CPU and gloo, so it runs anywhere; on GPUs drop ``accelerator="cpu"``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sharded import ShardedModelParallelStrategy, ShardedStateMixin
from lightning_sharded.checkpoint.backends import backend_for, location


class Model(ShardedStateMixin, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True, help="a local path or an fsspec URL (s3://bucket/key)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    resume = args.ckpt if backend_for(location(args.ckpt)).exists(location(args.ckpt)) else None
    step = 0
    if resume is not None:
        from lightning_sharded import inspect_checkpoint

        step = inspect_checkpoint(resume).global_step or 0
    trainer = L.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        strategy=ShardedModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        max_steps=step + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), ckpt_path=resume)
    trainer.save_checkpoint(args.ckpt, weights_only=False)
    if trainer.global_rank == 0:
        print(f"resumed from step {step}, saved step {trainer.global_step} to {args.ckpt}")


if __name__ == "__main__":
    main()
