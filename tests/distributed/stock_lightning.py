"""Rank script: stock Lightning strategies on CPU fit ``TinyModel`` for 3 steps and save a sharded
checkpoint, with no library code involved in the save:

- ``mp``: ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` (FSDP2) at
  ``OUT/mp.ckpt``, full values in ``OUT/mp.expected.pt``;
- ``fsdp``: ``FSDPStrategy`` (FSDP1, flat parameters, optimizer state as ShardedTensors) at
  ``OUT/fsdp.ckpt``, full values in ``OUT/fsdp.expected.pt``. FSDP1 refuses ``device_id=None`` on
  CPU, which is what stock Lightning passes there; the subclass below only turns it into the CPU
  device (a subclass also gets past Lightning's "requires a GPU accelerator" check).

Usage: ranks started by ``launch.run_ranks(script, 2, OUT, "mp", "fsdp")``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel

from tests.distributed.tiny_models import TinyModel


class _CpuFSDP(FullyShardedDataParallel):
    def __init__(self, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, device_id=torch.device("cpu") if device_id is None else device_id, **kwargs)


class StockCpuFSDP(FSDPStrategy):
    """Stock FSDPStrategy; only the wrapping gets the CPU device as ``device_id``."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        import torch.distributed.fsdp as fsdp

        original = fsdp.FullyShardedDataParallel
        fsdp.FullyShardedDataParallel = _CpuFSDP  # type: ignore[misc]
        try:
            return super()._setup_model(model)
        finally:
            fsdp.FullyShardedDataParallel = original  # type: ignore[misc]


def run(out: Path, name: str) -> None:
    L.seed_everything(1)
    model = TinyModel()
    strategy: Any
    if name == "mp":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = StockCpuFSDP(state_dict_type="sharded")
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    trainer.save_checkpoint(out / f"{name}.ckpt")
    wrapped = trainer.strategy.model
    assert wrapped is not None
    if name == "mp":
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(wrapped, options=options)
        optimizer: Any = get_optimizer_state_dict(wrapped, trainer.optimizers[0], options=options)
    else:
        # get_model_state_dict / get_optimizer_state_dict with full_state_dict crash (SIGSEGV) on an
        # FSDP1 CPU model in torch 2.13; gather the parameters instead. The test checks the optimizer
        # state's structure and shapes.
        with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False):
            state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
        optimizer = None
    if trainer.global_rank == 0:
        expected = {"state_dict": state_dict, "optimizer": optimizer, "global_step": trainer.global_step}
        torch.save(expected, out / f"{name}.expected.pt")


def main(run: Any = run) -> None:
    """Run each case named on the command line (``OUT NAME...``) with ``run(out, name)``, then exit."""
    out = Path(sys.argv[1])
    for name in sys.argv[2:]:
        run(out, name)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Two Trainers in one process (FSDP1 after FSDP2) sometimes abort at interpreter teardown
    # ("terminate called without an active exception", a C++ thread not joined); everything is
    # written and the group destroyed by now, so leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
