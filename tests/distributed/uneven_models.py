"""A model whose local parameter shapes differ per rank, without TorchRec.

``UnevenModel`` has:

- ``dense``: a ``Linear(4, 3)``: under FSDP2 its weight is a ``DTensor`` of 3 rows over 2 ranks (2 + 1),
  under FSDP1 a flat parameter split unevenly;
- ``pieces``: two tables kept as TorchRec keeps its tables: each rank's rows are a plain parameter (an
  empty ``(0,)`` parameter where the rank holds none) and ``state_dict()`` holds the table as a
  ``ShardedTensor`` whose local shard is that parameter's memory (the module's own state-dict hooks).
  Table ``a`` (5 x 4) lives on the last rank alone, table ``b`` (5 x 4) is split 2 + 3 rows;
- with ``ragged=True``, a plain per-rank parameter ``ragged`` of shape ``(rank + 1, 2)`` and no layout:
  nothing says how its pieces fit together.

The loss touches only the rows a rank holds (an empty parameter gets no gradient, as TorchRec's), so
Adam's state exists where the rows are. :func:`gathered` returns every model and optimizer value in full.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sharded import ShardedStateMixin

ROWS, COLS = 5, 4
#: Rows of each table per rank, by world size (a rank absent from the list holds none).
SPLITS: dict[str, dict[int, list[int]]] = {"a": {1: [5], 2: [0, 5]}, "b": {1: [5], 2: [2, 3]}}


def table_values(name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7 + ord(name))
    return torch.randn(ROWS, COLS, generator=generator)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RowPieces(nn.Module):
    """Tables whose rows are split over the ranks, one plain parameter per table and rank."""

    def __init__(self) -> None:
        super().__init__()
        rank, world = _rank_world()
        self.rows: dict[str, tuple[int, int]] = {}
        self._layouts: dict[str, Any] = {}  # not attributes the library's hooks would find
        for name, splits in SPLITS.items():
            counts = splits[world]
            start = sum(counts[:rank])
            self.rows[name] = (start, counts[rank])
            local = table_values(name)[start : start + counts[rank]].clone()
            self.register_parameter(name, nn.Parameter(local if counts[rank] else torch.empty(0)))
            if world > 1:
                self._layouts[name] = self._sharded(name, counts, rank)
        self._register_state_dict_hook(RowPieces._post_state_dict)
        self._register_load_state_dict_pre_hook(RowPieces._pre_load, with_module=True)

    def _sharded(self, name: str, counts: list[int], rank: int) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            from torch.distributed._shard.metadata import ShardMetadata
            from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
            from torch.distributed._shard.sharded_tensor.metadata import (
                ShardedTensorMetadata,
                TensorProperties,
            )

        metas = []
        local = []
        for r, count in enumerate(counts):
            if count == 0:
                continue
            meta = ShardMetadata([sum(counts[:r]), 0], [count, COLS], f"rank:{r}/cpu")
            metas.append(meta)
            if r == rank:
                local.append(Shard(getattr(self, name).detach(), meta))
        properties = TensorProperties(dtype=torch.float32, requires_grad=False)
        metadata = ShardedTensorMetadata(metas, torch.Size([ROWS, COLS]), properties)
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata)

    @staticmethod
    def _post_state_dict(module: RowPieces, destination: dict[str, Any], prefix: str, _: Any) -> None:
        for name, sharded in module._layouts.items():
            destination[prefix + name] = sharded

    def _pre_load(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, sharded in self._layouts.items():
            value = state_dict.get(prefix + name)
            if value is sharded:  # read in place into the local shard (the parameter's memory)
                state_dict[prefix + name] = getattr(self, name).detach()
            elif hasattr(value, "local_shards"):
                state_dict[prefix + name] = (
                    torch.cat([s.tensor for s in value.local_shards()])
                    if value.local_shards()
                    else torch.empty(0)
                )

    def local_loss(self) -> torch.Tensor:
        return sum((p.pow(2).sum() for p in self.parameters() if p.numel() > 0), torch.zeros(()))


class UnevenModel(ShardedStateMixin, L.LightningModule):
    """See the module docstring."""

    def __init__(self, ragged: bool = False, shard_dense: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(COLS, 3)
        self.shard_dense = shard_dense
        self.pieces: Any = None
        self.ragged: Any = None
        self.want_ragged = ragged

    def configure_model(self) -> None:
        if self.pieces is not None:
            return
        self.pieces = RowPieces()
        if self.want_ragged:
            rank, _ = _rank_world()
            self.ragged = nn.Parameter(torch.arange((rank + 1) * 2, dtype=torch.float32).reshape(rank + 1, 2))
        mesh = getattr(self, "_device_mesh", None)
        if self.shard_dense and mesh is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.dense, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.dense(x).pow(2).mean() + 0.01 * self.pieces.local_loss()
        if self.ragged is not None:
            loss = loss + 0.01 * self.ragged.pow(2).sum()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(32, COLS, generator=generator)), batch_size=4)


def _table(pieces: RowPieces, name: str, local: torch.Tensor | None) -> torch.Tensor:
    """The whole table from each rank's rows (collective): ``local`` is this rank's rows' value."""
    start, count = pieces.rows[name]
    full = torch.zeros(ROWS, COLS)
    if count and local is not None:
        full[start : start + count] = local.detach().reshape(count, COLS)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(full)
    return full


def gathered(model: UnevenModel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every model value and optimizer state tensor in full (collective), keyed ``model.*`` / ``opt.*``:
    the tables from each rank's rows, the dense layer's ``DTensor`` values (FSDP2; FSDP1's flat
    parameters are left to the other scenarios)."""
    values: dict[str, Any] = {}
    for name in sorted(SPLITS):
        param = getattr(model.pieces, name)
        values[f"model.pieces.{name}"] = _table(model.pieces, name, param)
        state = optimizer.state.get(param, {})
        for entry in ("exp_avg", "exp_avg_sq"):
            values[f"opt.pieces.{name}.{entry}"] = _table(model.pieces, name, state.get(entry))
        steps = torch.tensor([float(state["step"]) if "step" in state else -1.0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        values[f"opt.pieces.{name}.step"] = steps
    from torch.distributed.tensor import DTensor

    for key, param in (("dense.weight", model.dense.weight), ("dense.bias", model.dense.bias)):
        if not isinstance(param, DTensor):
            continue  # FSDP1's flat parameters: covered by the other scenarios
        values[f"model.{key}"] = param.full_tensor().detach().clone()
        for entry, value in sorted(optimizer.state.get(param, {}).items()):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            values[f"opt.{key}.{entry}"] = torch.as_tensor(full).detach().clone()
    return values
