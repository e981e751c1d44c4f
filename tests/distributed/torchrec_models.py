"""A TorchRec recommendation model for the multi-process scenarios: sharded embedding tables + a dense MLP.

Importing this module needs TorchRec (``pytest.importorskip("torchrec")`` or the ``torchrec`` marker first):
the TorchRec tests run in their own virtual environment (``.ci/run``), the rest of the suite without it.

``RecModel`` holds an ``EmbeddingBagCollection`` of :data:`TABLES` tables (``ROWS`` x ``DIM``), sharded in
``configure_model`` with ``torchrec.distributed.shard`` and a plan from ``construct_module_sharding_plan``
(by default t0 row-wise, t1 table-wise on rank 0, t2 table-wise on rank 1, the ``"dense"`` kernel), and a
small dense MLP. Every rank builds the same initial tables from fixed seeds and copies them into its
shards, whatever the plan, so two runs with different plans start from the same values. Batches are
synthetic click-through samples (dense features, one id list per table, a 0/1 label), the same for a
given index in every process; :func:`collate` makes them ``KeyedJaggedTensor`` batches.

Helpers gather what the scenarios compare (collective: every rank calls them): :func:`gathered_tables`
(each table in full), :func:`gathered_fused_state` (every fused optimizer state tensor in full).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.shard import shard
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardedModule, ShardingEnv

from lightning_sharded import ShardedStateMixin
from lightning_sharded.tensors import to_full

TABLES = ("t0", "t1", "t2")
ROWS, DIM, DENSE_IN = 64, 8, 4
#: The plan the issue describes: t0 row-wise, t1 table-wise on rank 0, t2 table-wise on rank 1.
DEFAULT_PLAN: dict[str, str] = {"t0": "row", "t1": "table:0", "t2": "table:1"}
#: Optimizers a fused kernel can apply in backward, by name (fbgemm's ``EmbOptimType`` members).
FUSED_OPTIMIZERS = ("exact_adagrad", "exact_sgd", "exact_row_wise_adagrad", "adam")


def table_init(name: str) -> torch.Tensor:
    """The initial values of table ``name``: the same in every process, whatever the plan."""
    generator = torch.Generator().manual_seed(1000 + TABLES.index(name))
    return torch.randn(ROWS, DIM, generator=generator) * 0.1


def sharding_for(spec: str, world: int, kernel: str) -> Any:
    """A TorchRec parameter sharding generator for one table from a short spec.

    ``"row"``: row-wise over every rank; ``"table:R"``: table-wise on rank ``R`` (taken modulo ``world``, so
    a plan for 2 ranks also runs on 1); ``"column"``: column-wise, one half of the columns per rank
    (``"column:R,S"`` names the ranks; on one rank both halves stay there).
    """
    kind, _, arg = spec.partition(":")
    if kind == "row":
        return row_wise(compute_kernel=kernel)
    if kind == "table":
        return table_wise(rank=int(arg or 0) % world, compute_kernel=kernel)
    if kind == "column":
        ranks = [int(r) % world for r in arg.split(",")] if arg else [r % world for r in (0, 1)]
        return column_wise(ranks=ranks, compute_kernel=kernel)
    raise ValueError(f"unknown sharding spec {spec!r} (row, table:R, column[:R,S])")


def fused_params(optimizer: str, lr: float) -> dict[str, Any]:
    """TorchRec's ``fused_params`` for a fused kernel applying ``optimizer`` (:data:`FUSED_OPTIMIZERS`)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return {"optimizer": EmbOptimType(optimizer), "learning_rate": lr, "eps": 1e-8}


class RecModel(ShardedStateMixin, L.LightningModule):
    """Click-through model: sparse tables sharded by TorchRec, dense features and an MLP over both.

    Args:
        plan: sharding spec per table (see :func:`sharding_for`); default :data:`DEFAULT_PLAN`.
        kernel: TorchRec compute kernel of every table: ``"dense"`` (the tables are parameters that the
            Lightning optimizer updates) or ``"fused"`` (fbgemm applies ``fused_optimizer`` in backward).
        fused_optimizer: the optimizer a fused kernel applies (:data:`FUSED_OPTIMIZERS`).
        optimizer: the Lightning optimizer: ``"adam"``, ``"adagrad"`` or ``"sgd"``; over every parameter
            with the dense kernel, over the dense part only with a fused one.
        lr: learning rate of both.
        wrap_dense: apply ``fully_shard`` (FSDP2, under a strategy with a device mesh) or FSDP1 ``wrap``
            (under ``ShardedFSDPStrategy``) to the MLP by hand in ``configure_model``.
        data_size: samples per epoch (4 per batch and rank).
    """

    def __init__(
        self,
        plan: Mapping[str, str] | None = None,
        kernel: str = "dense",
        fused_optimizer: str = "exact_adagrad",
        optimizer: str = "adam",
        lr: float = 0.05,
        wrap_dense: bool = False,
        data_size: int = 64,
    ) -> None:
        super().__init__()
        self.plan = dict(DEFAULT_PLAN if plan is None else plan)
        self.kernel = kernel
        self.fused_optimizer = fused_optimizer
        self.optimizer_name = optimizer
        self.lr = lr
        self.wrap_dense = wrap_dense
        self.data_size = data_size
        torch.manual_seed(0)
        self.sparse: nn.Module = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f_{t}"])
                for t in TABLES
            ],
            device=torch.device("cpu"),
        )
        self.dense = nn.Sequential(nn.Linear(DIM * len(TABLES) + DENSE_IN, 16), nn.ReLU(), nn.Linear(16, 1))

    def sharder(self) -> EmbeddingBagCollectionSharder:
        if self.kernel == "fused":
            return EmbeddingBagCollectionSharder(fused_params=fused_params(self.fused_optimizer, self.lr))
        return EmbeddingBagCollectionSharder()

    def configure_model(self) -> None:
        if isinstance(self.sparse, ShardedModule):
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not dist.is_initialized():
            # One plain process (load_from_checkpoint, inspection): the unsharded tables.
            with torch.no_grad():
                for t in TABLES:
                    self.sparse.embedding_bags[t].weight.copy_(table_init(t))
            return
        sharder = self.sharder()
        per_param = {t: sharding_for(self.plan[t], world, self.kernel) for t in TABLES}
        module_plan = construct_module_sharding_plan(
            self.sparse, per_param, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
        )
        self.sparse = shard(
            self.sparse,
            module_plan,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=torch.device("cpu"),
            sharder=sharder,
        )
        set_tables(self.sparse, {t: table_init(t) for t in TABLES})
        if self.wrap_dense:
            self._wrap_dense()

    def _wrap_dense(self) -> None:
        mesh = getattr(self, "device_mesh", None)
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard

            dp = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
            for layer in self.dense:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=dp)
            fully_shard(self.dense, mesh=dp)
        else:
            from torch.distributed.fsdp.wrap import wrap

            self.dense = wrap(self.dense)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(sparse)
        embedded = torch.cat([pooled[f"f_{t}"] for t in TABLES], dim=1)
        return self.dense(torch.cat([embedded, dense], dim=1)).squeeze(1)

    def training_step(self, batch: tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor], idx: int) -> Any:
        dense, sparse, label = batch
        return nn.functional.binary_cross_entropy_with_logits(self(dense, sparse), label)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.kernel == "fused":
            params = [p for n, p in self.named_parameters() if not n.startswith("sparse.")]
        else:
            params = list(self.parameters())
        classes: dict[str, Callable[..., torch.optim.Optimizer]] = {
            "adam": torch.optim.Adam,
            "adagrad": torch.optim.Adagrad,
            "sgd": torch.optim.SGD,
        }
        return classes[self.optimizer_name](params, lr=self.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        return loader(self.data_size)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch  # CPU only; a KeyedJaggedTensor is not a collection Lightning can move


class ClickData(Dataset[tuple[torch.Tensor, list[list[int]], float]]):
    """Synthetic click-through samples: sample ``i`` is the same in every process."""

    def __init__(self, size: int = 64) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, list[list[int]], float]:
        generator = torch.Generator().manual_seed(index)
        dense = torch.randn(DENSE_IN, generator=generator)
        ids = []
        for _ in TABLES:
            count = int(torch.randint(0, 4, (1,), generator=generator))
            ids.append(torch.randint(0, ROWS, (count,), generator=generator).tolist())
        label = float(torch.randint(0, 2, (1,), generator=generator))
        return dense, ids, label


def collate(samples: Sequence[tuple[torch.Tensor, list[list[int]], float]]) -> tuple[Any, ...]:
    """Samples to ``(dense, KeyedJaggedTensor, label)``: one id list per table and sample."""
    lengths: list[int] = []
    values: list[int] = []
    for k in range(len(TABLES)):
        for _, ids, _ in samples:
            lengths.append(len(ids[k]))
            values.extend(ids[k])
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{t}" for t in TABLES],
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
    )
    dense = torch.stack([s[0] for s in samples])
    label = torch.tensor([s[2] for s in samples])
    return dense, sparse, label


def loader(size: int = 64, batch_size: int = 4) -> DataLoader[Any]:
    """The training loader (no shuffling: a resumed run sees the batches the unbroken one saw)."""
    return DataLoader(ClickData(size), batch_size=batch_size, collate_fn=collate)


def sharded_tables(model: nn.Module) -> nn.Module:
    """The model's TorchRec-sharded ``EmbeddingBagCollection``."""
    for module in model.modules():
        if isinstance(module, ShardedModule):
            return module
    raise AssertionError("the model has no TorchRec ShardedModule: configure_model did not shard it")


def set_tables(sharded: nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Copy full tables into the local shards of a sharded collection (any plan, any kernel)."""
    state = sharded.state_dict()
    with torch.no_grad():
        for t, value in full.items():
            st = state[f"embedding_bags.{t}.weight"]
            for local in st.local_shards():
                offsets, sizes = local.metadata.shard_offsets, local.metadata.shard_sizes
                local.tensor.copy_(
                    value[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
                )


def gathered_tables(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every table in full (collective), by table name; a plain EBC's tables as they are."""
    module = model.sparse if hasattr(model, "sparse") else model
    state = module.state_dict()
    return {t: to_full(state[f"embedding_bags.{t}.weight"]).detach().clone() for t in TABLES}


def gathered_fused_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every fused optimizer state tensor in full (collective), by ``<table>.<state>`` (``t0.momentum1``).

    A rank's ``fused_optimizer`` holds only the tables it has shards of; the gathers need the same
    tensors in the same order on every rank, so each rank's names are exchanged first and a rank without
    a shard of a table takes part with an empty ShardedTensor of the table's layout.
    """
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    sharded = sharded_tables(model)
    local: dict[str, Any] = {}
    for per_param in sharded.fused_optimizer.state_dict()["state"].values():  # type: ignore[union-attr]
        for name, value in per_param.items():
            if isinstance(value, ShardedTensor):
                local[name] = value
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {name: value.metadata() for name, value in local.items()})
    values: dict[str, torch.Tensor] = {}
    for name in sorted({n for metadata in everyone for n in metadata}):
        value = local.get(name)
        if value is None:
            metadata = next(m[name] for m in everyone if name in m)
            value = ShardedTensor._init_from_local_shards_and_global_metadata([], metadata)
        values[name] = to_full(value).detach().clone()
    return values


def gathered_dense(model: nn.Module) -> dict[str, torch.Tensor]:
    """The MLP's parameters in full (collective), by name without wrapper parts (FSDP1: its parameters
    summoned in full; FSDP2: its DTensors gathered)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def clean(name: str) -> str:
        return name.replace("_fsdp_wrapped_module.", "")

    if any(isinstance(m, FSDP) for m in model.modules()):
        with FSDP.summon_full_params(model, writeback=False):
            return {clean(n): p.detach().clone() for n, p in sorted(model.dense.named_parameters())}
    return {clean(n): to_full(p).detach().clone() for n, p in sorted(model.dense.named_parameters())}
