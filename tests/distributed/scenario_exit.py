"""Stock DDP runs of a ``ShardedStateMixin`` model that end right after a collective, exiting for real.

    python scenario_exit.py OUT RUNS

The driver imports torch and Lightning once, then for each of RUNS runs forks 2 ranks (``RANK``... set,
so Lightning's DDP does not relaunch). Each rank fits 2 steps under ``strategy="ddp"``, saves one full
checkpoint (the mixin gathers its DTensor table), and ends with ``table.full_tensor()``: the last line
is a gloo collective. Then it leaves through ``sys.exit``: the interpreter's own shutdown, atexit
handlers and finalization included, where torch 2.13 aborts when a gloo worker thread drops the last
collective's tensors late (``terminate called without an active exception``, see
``lightning_sharded/_exit.py``). Unlike the tests' zygote, which leaves with ``os._exit``, nothing here
skips that shutdown. Nothing but the mixin registers the exit handler: no strategy of this library.

Each rank's output goes to ``OUT/run-R-rank-K.out``; the driver writes ``OUT/results.json``: every
rank's exit status, and whether its output holds ``terminate called``.
``LIGHTNING_SHARDED_TEST_NO_DRAIN=1`` turns the handler off (to measure how often runs abort without it).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_sharded._launch import free_port, rank_env  # noqa: E402

WORLD = 2


def rank_main(out: Path) -> None:
    """One rank: a stock DDP fit and a full save of a mixin model, ending in a collective."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from lightning_sharded import ShardedStateMixin, _exit

    if os.environ.get("LIGHTNING_SHARDED_TEST_NO_DRAIN") == "1":
        _exit._drain = lambda limit=_exit.LIMIT: None  # type: ignore[assignment]

    class TableModel(ShardedStateMixin, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 1)
            self.table: Any = None

        def configure_model(self) -> None:
            if self.table is None:
                mesh = init_device_mesh("cpu", (self.trainer.world_size,))
                self.table = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            with torch.no_grad():
                self.table.to_local().add_(1.0)
            return self.proj(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = TableModel()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy="ddp",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4))
    trainer.save_checkpoint(out / "table.ckpt")
    print("table sum", float(model.table.full_tensor().sum()))  # the last collective, then exit


def main(out: Path, runs: int) -> None:
    results: list[dict[str, Any]] = []
    for run in range(runs):
        port = free_port()
        children = []
        for rank in range(WORLD):
            log = out / f"run-{run}-rank-{rank}.out"
            pid = os.fork()
            if pid == 0:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.clear()
                os.environ.update(rank_env(rank, WORLD, port, Path(__file__).resolve().parents[2]))
                from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

                rank_zero_only.rank = _get_rank() or 0
                rank_main(out)
                sys.exit(0)  # the interpreter's shutdown: atexit handlers, then finalization
            children.append((rank, pid, log))
        for rank, pid, log in children:
            _, status = os.waitpid(pid, 0)
            text = log.read_text(errors="replace")
            results.append(
                {
                    "run": run,
                    "rank": rank,
                    "exit": os.waitstatus_to_exitcode(status),
                    "terminate": "terminate called" in text,
                    "tail": text[-2000:],
                }
            )
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
