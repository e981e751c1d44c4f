"""One rank of the property over TorchRec plans: the tables' optimizer state survives a save under one plan
and a load under another, bit for bit (row-wise, table-wise on either rank or column-wise, per table).

    torchrec_plans_script.py OUT_FILE [EXAMPLES]

Every rank runs the same hypothesis examples (``derandomize=True``), all in this one process start: for
each, a ``RecModel`` sharded with plan A trains 2 steps with Adam (a manual loop, the same batches on
every rank), its model and optimizer state is saved with this library's sharded save, loaded into a
model sharded with plan B and a fresh Adam, and each table's state is gathered from both and compared.
Rank 0 writes ``{"examples": N}`` to OUT_FILE, or the failure.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_sharded.checkpoint.load import restore_checkpoint  # noqa: E402
from lightning_sharded.checkpoint.save import write_sharded_checkpoint  # noqa: E402
from lightning_sharded.checkpoint.state_dicts import model_state_dict, optimizer_state_dict  # noqa: E402
from tests.distributed.torchrec_models import ROWS, TABLES, RecModel, loader  # noqa: E402

SPECS = ("row", "table:0", "table:1", "column")
plans = st.fixed_dictionaries({t: st.sampled_from(SPECS) for t in TABLES})


def table_state(model: RecModel, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every table's Adam state in full (collective), from each rank's state at its shards' places."""
    out: dict[str, torch.Tensor] = {}
    state_dict = model.sparse.state_dict()
    for table in TABLES:
        param = model.sparse.embedding_bags[table].weight
        layout = state_dict[f"embedding_bags.{table}.weight"]
        state = optimizer.state.get(param, {})
        for entry in ("exp_avg", "exp_avg_sq"):
            full = torch.zeros(ROWS, layout.size(1))
            value = state.get(entry)
            for shard in layout.local_shards() if value is not None else []:
                rel = shard.tensor.storage_offset() - param.storage_offset()
                view = value.as_strided(
                    shard.tensor.shape, shard.tensor.stride(), value.storage_offset() + rel
                )
                rows, cols = shard.metadata.shard_offsets
                n, m = shard.metadata.shard_sizes
                full[rows : rows + n, cols : cols + m] = view
            dist.all_reduce(full)
            out[f"{table}.{entry}"] = full
    return out


def trained(plan: dict[str, str]) -> tuple[RecModel, torch.optim.Optimizer]:
    model = RecModel(plan=plan)
    model.configure_model()
    optimizer = model.configure_optimizers()
    for index, batch in enumerate(loader(size=8)):
        if index == 2:
            break
        optimizer.zero_grad()
        model.training_step(batch, index).backward()
        optimizer.step()
    return model, optimizer


def round_trip(plan_a: dict[str, str], plan_b: dict[str, str], folder: str) -> None:
    model, optimizer = trained(plan_a)
    before = table_state(model, optimizer)
    path = os.path.join(folder, "ck")
    state = {
        "model": model_state_dict(model, full=False),
        "optimizer_0": optimizer_state_dict(model, optimizer, full=False),
    }
    write_sharded_checkpoint(path, state, {}, rank=dist.get_rank())
    other = RecModel(plan=plan_b)
    other.configure_model()
    fresh = other.configure_optimizers()
    restore_checkpoint(path, other, [fresh], read_metadata=False)
    after = table_state(other, fresh)
    differ = [k for k in sorted(before) if not torch.equal(before[k], after[k])]
    assert not differ, f"plan {plan_a} -> {plan_b}: the optimizer state of {differ} differs after the load"


def main(out: Path, examples: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = [tempfile.mkdtemp(prefix="plans-") if rank == 0 else None]
    dist.broadcast_object_list(folder)
    count = [0]

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(plan_a=plans, plan_b=plans)
    def property_(plan_a: dict[str, str], plan_b: dict[str, str]) -> None:
        count[0] += 1
        round_trip(plan_a, plan_b, os.path.join(str(folder[0]), str(count[0])))

    result: dict[str, Any]
    try:
        property_()
        result = {"examples": count[0]}
    except BaseException:
        result = {"failed": traceback.format_exc()}
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 6)
