"""LightningCLI picks this library's strategies from YAML: by name, or by class path with init arguments.

``examples/lightning_cli_fit.yaml`` fits on 2 CPU processes with ``strategy: sharded_fsdp`` (a name
``import lightning_sharded`` registers) and saves a sharded checkpoint at every step;
``examples/lightning_cli_resume.yaml`` resumes it under FSDP2, the strategy given as
``class_path: lightning_sharded.ShardedModelParallelStrategy`` with ``init_args`` (the LR scheduler's
and the callbacks' states left out of the load). The same as these two commands::

    python examples/lightning_cli.py

which run ``fit --config examples/lightning_cli_fit.yaml`` then ``fit --config
examples/lightning_cli_resume.yaml --ckpt_path .../last.ckpt`` through ``LightningCLI``. It prints
``OK: fit with 'sharded_fsdp', resumed with ShardedModelParallelStrategy at step 3, weights and table exact``.
It writes into a new temporary folder, or into ``OUT_DIR`` with ``python examples/lightning_cli.py OUT_DIR``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sharded  # noqa: F401  # registers "sharded_fsdp", "sharded_model_parallel"...

HERE = Path(__file__).resolve().parent


class TableModel(L.LightningModule):
    """Two linear layers and a ``DTensor`` table (a sharded attribute) updated at every step."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer1 = nn.Linear(8, hidden)
        self.layer2 = nn.Linear(hidden, 1)
        self.table: Any = None

    def configure_model(self) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        if self.table is None:
            mesh = init_device_mesh("cpu", (self.trainer.world_size,))
            self.table = distribute_tensor(torch.zeros(10, 4), mesh, [Shard(0)])
        if self._device_mesh is not None:  # ShardedModelParallelStrategy: FSDP2 over the data-parallel mesh
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if not isinstance(self.layer1, FSDPModule):
                for layer in (self.layer1, self.layer2):
                    fully_shard(layer, mesh=self._device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            self.table.to_local().add_(1.0)
        return self.layer2(torch.relu(self.layer1(batch[0]))).pow(2).mean()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(1))), 4)


def gathered(trainer: L.Trainer, model: TableModel) -> dict[str, torch.Tensor]:
    """The weights and the table, whole (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    state = get_model_state_dict(trainer.strategy.model, options=options)
    values = {k: v.clone() for k, v in state.items() if k.startswith("layer")}
    values["table"] = model.table.full_tensor().clone()
    return values


class Restored(L.Callback):
    """What the resume restored, right before its first step."""

    values: dict[str, torch.Tensor] = {}
    step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        Restored.values, Restored.step = gathered(trainer, pl_module), trainer.global_step


class ResumeCLI(LightningCLI):
    def before_fit(self) -> None:
        self.trainer.callbacks.append(Restored())


def main(out: Path) -> None:
    fit = LightningCLI(
        TableModel,
        args=["fit", "--config", str(HERE / "lightning_cli_fit.yaml"), f"--trainer.default_root_dir={out}"],
        save_config_callback=None,
    )
    saved = gathered(fit.trainer, fit.model)
    checkpoint = out / "checkpoints" / "last.ckpt"
    resume = ResumeCLI(
        TableModel,
        args=[
            "fit",
            "--config",
            str(HERE / "lightning_cli_resume.yaml"),
            f"--trainer.default_root_dir={out / 'resumed'}",
            f"--ckpt_path={checkpoint}",
        ],
        save_config_callback=None,
    )
    if resume.trainer.global_rank == 0:
        assert type(fit.trainer.strategy).__name__ == "ShardedFSDPStrategy"
        assert Restored.step == 3, Restored.step
        differ = [k for k, v in saved.items() if not torch.equal(v, Restored.values[k])]
        assert not differ, f"not restored exactly: {differ}"
        name = type(resume.trainer.strategy).__name__
        print(f"OK: fit with 'sharded_fsdp', resumed with {name} at step 3, weights and table exact")


def output_dir() -> Path:
    """``OUT_DIR`` if given, else one new temporary folder, the same in every process (Lightning runs
    this script again for the other rank, with this process's environment)."""
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    return Path(os.environ.setdefault("LIGHTNING_CLI_EXAMPLE_OUT", tempfile.mkdtemp(prefix="lightning_cli_")))


if __name__ == "__main__":
    main(output_dir())
