"""A LoRA run on 2 CPU processes: trainable-only checkpoints, their resume, and a warm start from one.

The model: a frozen base (two ``Linear``) loaded from a Hugging Face directory, and a LoRA adapter
and a head that train, under FSDP1 (the strategy picked by its registered name first). The run saves
only what trains (``save_trainable_only=True``): the checkpoint names the Hugging Face directory as
where its frozen part comes from. A resume then restores both parts exactly, from a model whose base
was never loaded; a new run starts from the checkpoint's weights only (``warm_start=``), with a fresh
optimizer at step 0. Run it (Lightning starts the second process itself)::

    python examples/partial_checkpoints.py

It prints ``OK: the trainable-only checkpoint holds 0 of the 4 frozen tensors, ... KiB against ... KiB
complete`` and ``OK: resumed at step 4 with the base read back from base/; warm start at step 0, weights
exact``. It writes into a new temporary folder, or into ``OUT_DIR`` with
``python examples/partial_checkpoints.py OUT_DIR``.
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
from torch.utils.data import DataLoader, TensorDataset

from lightning_sharded import ShardedFSDPStrategy, inspect_checkpoint, load_pretrained

DIM, RANK = 256, 4


class LoraModel(L.LightningModule):
    def __init__(self, base_dir: str | None = None) -> None:
        super().__init__()
        self.base_dir = base_dir  # the run that starts from the pretrained base loads it
        torch.manual_seed(1)
        self.base = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(DIM, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, DIM, bias=False)
        self.head = nn.Linear(DIM, 1)

    def on_fit_start(self) -> None:
        if self.base_dir is not None:  # after FSDP wrapped the model: each rank reads its slices
            load_pretrained(self, self.base_dir, prefix="base.")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.head(torch.relu(self.base(x) + self.lora_b(self.lora_a(x)))).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(64, DIM, generator=torch.Generator().manual_seed(0))), 8)


def trainer(strategy: Any, steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def weights(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The model's weights, whole (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {k: v.clone() for k, v in get_model_state_dict(trainer.strategy.model, options=options).items()}


def main(out: Path) -> None:
    base_dir = out / "base"
    if not base_dir.exists():  # the "pretrained" base, as a Hugging Face directory
        from safetensors.torch import save_file

        torch.manual_seed(0)
        base_dir.mkdir(parents=True)
        save_file(
            {
                k: v.contiguous()
                for k, v in nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)).state_dict().items()
            },
            str(base_dir / "model.safetensors"),
        )

    # 1. A LoRA run by the strategy's name, saving everything; then only what trains.
    first = trainer("sharded_fsdp", steps=4)
    first.fit(LoraModel(str(base_dir)))
    first.save_checkpoint(out / "complete.ckpt")
    saved = weights(first)
    lora = ShardedFSDPStrategy(save_trainable_only=True, frozen_source=base_dir, frozen_prefix="base.")
    second = trainer(lora, steps=4)
    second.fit(LoraModel(str(base_dir)))
    second.save_checkpoint(out / "lora.ckpt")
    assert all(torch.equal(v, saved[k]) for k, v in weights(second).items())  # the same run
    if second.global_rank == 0:
        info = inspect_checkpoint(out / "lora.ckpt")
        held = sum(e.key.startswith("model.base.") for e in info.entries)
        complete = inspect_checkpoint(out / "complete.ckpt").disk_size
        print(
            f"OK: the trainable-only checkpoint holds {held} of the 4 frozen tensors,"
            f" {info.disk_size / 1024:.0f} KiB against {complete / 1024:.0f} KiB complete"
        )

    # 2. Resume it: the base is read from base/ (this model never loads it itself).
    resumed = trainer(ShardedFSDPStrategy(), steps=5)
    model = LoraModel()

    class Check(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            restored = weights(trainer)
            assert trainer.global_step == 4
            assert all(torch.equal(v, saved[k]) for k, v in restored.items()), "not restored exactly"

    resumed.callbacks.append(Check())
    resumed.fit(model, ckpt_path=out / "lora.ckpt")

    # 3. A new run from the checkpoint's weights only: fresh Adam, step 0.
    warm = trainer(ShardedFSDPStrategy(warm_start=out / "lora.ckpt"), steps=2)

    class Fresh(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            assert trainer.global_step == 0 and not trainer.optimizers[0].state
            assert all(torch.equal(v, saved[k]) for k, v in weights(trainer).items()), "not the saved weights"

    warm.callbacks.append(Fresh())
    warm.fit(LoraModel())
    if warm.global_rank == 0:
        print("OK: resumed at step 4 with the base read back from base/; warm start at step 0, weights exact")


def output_dir() -> Path:
    """``OUT_DIR`` if given, else one new temporary folder, the same in every process (Lightning runs
    this script again for the other rank, with this process's environment)."""
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    return Path(
        os.environ.setdefault("PARTIAL_CHECKPOINTS_OUT", tempfile.mkdtemp(prefix="partial_checkpoints_"))
    )


if __name__ == "__main__":
    main(output_dir())
