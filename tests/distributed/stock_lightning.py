"""Rank script: stock ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` on CPU fits
``TinyModel`` for 3 steps and saves a sharded checkpoint at ``OUT/mp.ckpt`` (stock Lightning, no
library involved); rank 0 also saves the full values at ``OUT/expected.pt``.

Usage: ranks started by ``launch.run_ranks(script, 2, OUT)``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from tests.distributed.tiny_models import TinyModel


def main() -> None:
    out = Path(sys.argv[1])
    L.seed_everything(1)
    model = TinyModel()
    trainer = L.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        accelerator="cpu",
        devices=2,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    trainer.save_checkpoint(out / "mp.ckpt")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state_dict = get_model_state_dict(model, options=options)
    optimizer = get_optimizer_state_dict(model, trainer.optimizers[0], options=options)
    if trainer.global_rank == 0:
        expected = {"state_dict": state_dict, "optimizer": optimizer, "global_step": trainer.global_step}
        torch.save(expected, out / "expected.pt")


if __name__ == "__main__":
    main()
