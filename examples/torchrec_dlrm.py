"""A small DLRM-style recommendation model on CPU, in 2 processes: sparse embedding tables sharded by
TorchRec (a fused kernel applying Adagrad in backward), the dense MLP sharded by FSDP2, resumed exactly.

Three tables are sharded by a TorchRec plan (``item`` row-wise over both ranks, ``user`` table-wise on
rank 0, ``category`` table-wise on rank 1); ``ShardedModelParallelStrategy(fully_shard_policy={nn.Linear})``
applies ``fully_shard`` to the MLP and leaves TorchRec's module alone. One run trains 4 steps unbroken;
another trains 2, saves a sharded checkpoint and stops; a third resumes from it with
the same plan and trains to step 4: the tables, their fused Adagrad state and the MLP then equal the
unbroken run's, bit for bit. A fourth run restores the checkpoint into another plan (``item``
column-wise, ``user`` row-wise, ``category`` on rank 0): every value equals what the second run saved.

Needs TorchRec (see docs/torchrec.md for the CPU install). Run it (Lightning starts the second process
itself)::

    python examples/torchrec_dlrm.py

It prints ``OK: 3 tables, their fused Adagrad state and the MLP resumed exactly, into the same plan and
into another one``.
It writes into a new temporary folder, or into ``OUT_DIR`` with ``python examples/torchrec_dlrm.py OUT_DIR``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.shard import shard
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv

from lightning_sharded import ShardedModelParallelStrategy, ShardedStateMixin
from lightning_sharded.tensors import to_full

warnings.filterwarnings("ignore", category=FutureWarning)  # ShardedTensor's deprecation notice
TABLES, ROWS, DIM, DENSE = ("item", "user", "category"), 100, 8, 4


def first_plan() -> dict[str, Any]:
    return {"item": row_wise(compute_kernel="fused"), "user": table_wise(rank=0, compute_kernel="fused"),
            "category": table_wise(rank=1, compute_kernel="fused")}  # fmt: skip


def second_plan() -> dict[str, Any]:
    return {"item": column_wise(ranks=[0, 1], compute_kernel="fused"),
            "user": row_wise(compute_kernel="fused"),
            "category": table_wise(rank=0, compute_kernel="fused")}  # fmt: skip


class DLRM(ShardedStateMixin, L.LightningModule):
    def __init__(self, second: bool = False) -> None:
        super().__init__()
        self.second = second
        torch.manual_seed(0)
        configs = [
            EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[t])
            for t in TABLES
        ]
        self.sparse: nn.Module = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        self.bottom = nn.Linear(DENSE, DIM)
        self.top = nn.Sequential(nn.Linear(DIM * (len(TABLES) + 1), 16), nn.ReLU(), nn.Linear(16, 1))

    def configure_model(self) -> None:
        if not isinstance(self.sparse, EmbeddingBagCollection):
            return  # already sharded
        # The same initial tables in every process and every plan, so the runs can be compared.
        initial = {t: torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(i)) * 0.1
                   for i, t in enumerate(TABLES)}  # fmt: skip
        sharder = EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
        )
        world = dist.get_world_size()
        plan = construct_module_sharding_plan(
            self.sparse, second_plan() if self.second else first_plan(),
            sharder=sharder, local_size=world, world_size=world, device_type="cpu",
        )  # fmt: skip
        env = ShardingEnv.from_process_group(dist.group.WORLD)
        self.sparse = shard(self.sparse, plan, env=env, device=torch.device("cpu"), sharder=sharder)
        state = self.sparse.state_dict()
        with torch.no_grad():
            for t in TABLES:  # copy the initial values into this rank's shards
                for piece in state[f"embedding_bags.{t}.weight"].local_shards():
                    (r, c), (h, w) = piece.metadata.shard_offsets, piece.metadata.shard_sizes
                    piece.tensor.copy_(initial[t][r : r + h, c : c + w])

    def forward(self, dense: torch.Tensor, ids: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(ids)
        features = [self.bottom(dense).relu(), *(pooled[t] for t in TABLES)]
        return self.top(torch.cat(features, dim=1)).squeeze(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        dense, ids, clicked = batch
        return nn.functional.binary_cross_entropy_with_logits(self(dense, ids), clicked)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # The tables are updated by TorchRec's fused Adagrad in backward; Adam trains the MLPs.
        dense = [p for name, p in self.named_parameters() if not name.startswith("sparse.")]
        return torch.optim.Adam(dense, lr=0.01)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch  # CPU


def click_batches(samples: int = 16, batch_size: int = 4) -> DataLoader[Any]:
    """Synthetic clicks: 4 dense features, 0-3 ids per table, a 0/1 label; sample i is fixed by seed i."""

    def sample(i: int) -> tuple[torch.Tensor, list[torch.Tensor], float]:
        g = torch.Generator().manual_seed(i)
        ids = [
            torch.randint(0, ROWS, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g)
            for _ in TABLES
        ]
        return torch.randn(DENSE, generator=g), ids, float(torch.randint(0, 2, (1,), generator=g))

    def collate(batch: list[tuple[torch.Tensor, list[torch.Tensor], float]]) -> tuple[Any, ...]:
        per_table = [[ids[k] for _, ids, _ in batch] for k in range(len(TABLES))]
        ids = KeyedJaggedTensor.from_lengths_sync(
            keys=list(TABLES),
            values=torch.cat([i for table in per_table for i in table]).long(),
            lengths=torch.tensor([len(i) for table in per_table for i in table]),
        )
        return torch.stack([d for d, _, _ in batch]), ids, torch.tensor([c for _, _, c in batch])

    return DataLoader([sample(i) for i in range(samples)], batch_size=batch_size, collate_fn=collate)


def snapshot(model: DLRM) -> dict[str, torch.Tensor]:
    """Tables, fused optimizer state and MLP weights in full (every rank takes part)."""
    state = model.state_dict()  # the fused state is there too, as `sparse.fused_optimizer__<table>__<state>`
    return {k: to_full(v).clone() for k, v in sorted(state.items())}


def trainer(steps: int, root: Path) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, max_steps=steps, default_root_dir=root,
        strategy=ShardedModelParallelStrategy(fully_shard_policy={nn.Linear}),
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip


def main(out: Path) -> None:
    unbroken = DLRM()
    trainer(4, out).fit(unbroken, click_batches())
    expected = snapshot(unbroken)

    first = DLRM()
    stopped = trainer(2, out)
    stopped.fit(first, click_batches())
    stopped.save_checkpoint(out / "dlrm.ckpt")
    saved = snapshot(first)

    resumed = DLRM()  # the same plan: training continues exactly like the unbroken run
    trainer(4, out).fit(resumed, click_batches(), ckpt_path=out / "dlrm.ckpt")
    check(expected, snapshot(resumed), "continued run")

    moved = DLRM(second=True)  # another plan: the checkpoint is resharded into it (max_steps reached)
    trainer(2, out).fit(moved, click_batches(), ckpt_path=out / "dlrm.ckpt")
    check(saved, snapshot(moved), "restore into another plan")
    if dist.get_rank() == 0:
        print(
            "OK: 3 tables, their fused Adagrad state and the MLP resumed exactly,"
            " into the same plan and into another one"
        )


def check(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> None:
    differ = [k for k in expected if k not in actual or not torch.equal(expected[k], actual[k])]
    fused = [k for k in expected if "fused_optimizer__" in k]
    if differ or len(fused) != len(TABLES):
        raise SystemExit(f"rank {dist.get_rank()}, {what}: not exact for {differ} (fused state: {fused})")


def output_dir() -> Path:
    """``OUT_DIR`` if given, else one new temporary folder, the same in every process (Lightning runs this
    script again for the other rank with this process's environment)."""
    if len(sys.argv) > 1:
        return Path(sys.argv[1])
    return Path(os.environ.setdefault("TORCHREC_DLRM_OUT", tempfile.mkdtemp(prefix="torchrec_dlrm_")))


if __name__ == "__main__":
    main(output_dir())
