"""One rank of the FSDP1 views check (``tests/checkpoint/test_fsdp1_views.py``).

    fsdp1_views_script.py DIR

An FSDP1 model whose parameters straddle the ranks' flat shards at odd places (partial rows, a 4-d
convolution, biases wholly on one rank, a buffer, buffer mixed precision as Lightning sets it) and Adam
after one step. Checks, on every rank, and writes ``DIR/ok`` from rank 0 when all hold:

1. the views' model and optimizer state dicts hold exactly torch's values (the root FSDP unit's
   ``_is_root`` as before) (``get_model_state_dict`` /
   ``get_optimizer_state_dict``, which gather), same keys (the optimizer's: the union over ranks);
2. a checkpoint written from the views restores into a fresh model exactly, and both continue alike;
   the next save's state dicts are the same views (made once), holding the values after that step;
3. a checkpoint written from torch's own state dicts (what stock ``FSDPStrategy`` writes) restores
   through the views exactly;
4. so does a full file (gathered on rank 0), whose values are copied into the views;
5. when one rank's optimizer state is not views of its pieces (rank 0's, then rank 1's), every rank
   leaves the fast path alike (``None`` everywhere, none waits in a collective the others skip), on
   the default group and on a bounded gloo group.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_sharded.checkpoint import collective, fsdp1, load, save, state_dicts  # noqa: E402
from lightning_sharded.checkpoint.load.checks import set_model_state  # noqa: E402
from lightning_sharded.tensors import to_full  # noqa: E402


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        self.c = nn.Conv2d(3, 2, 3)
        self.register_buffer("buf", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)).sum() + self.c(x[:, :3, None, None].expand(-1, 3, 5, 5)).sum()


def build(seed: int) -> tuple[Any, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    torch.manual_seed(seed)
    model = FullyShardedDataParallel(
        Odd(),
        auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, nn.Linear),
        device_id=torch.device("cpu"),
        use_orig_params=True,
        mixed_precision=MixedPrecision(torch.float32, torch.float32, torch.float32),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    step(model, optimizer, seed)
    return model, optimizer


def step(model: Any, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(100 + seed)
    optimizer.zero_grad()
    model(torch.randn(2, 5)).backward()
    optimizer.step()


def full_model(model: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: to_full(v).clone() for k, v in sorted(get_model_state_dict(model).items())}


def full_optimizer(model: Any, optimizer: torch.optim.Optimizer) -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)["state"]
    return {(n, e): to_full(v).clone() for n in sorted(state) for e, v in sorted(state[n].items())}


def same(a: dict[Any, Any], b: dict[Any, Any], what: str) -> None:
    assert list(a) == list(b), (what, list(a), list(b))
    for key in a:
        assert torch.equal(a[key], b[key]), (what, key)


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = build(0)
    optimizer.param_groups[0]["lr"] = 0.0123  # restored on every rank, not the fresh optimizer's 0.1
    assert fsdp1.supported(model)

    # 1. the views hold torch's values; the root is the root again after (its post hook skips torch's
    # per-entry logging), also between two state dicts in one block
    views = state_dicts.model_state_dict(model, full=False)
    assert model._is_root is True
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT), fsdp1.views():
        twice = [model.state_dict(), model.state_dict()]
    assert model._is_root is True and sorted(twice[0]) == sorted(twice[1])
    reference = full_model(model)
    assert sorted(views) == list(reference), (sorted(views), list(reference))
    for key, value in views.items():
        assert type(value).__name__ == "ShardedTensor" or key == "buf", (key, type(value))
        assert torch.equal(to_full(value), reference[key]), key
    optim_views = state_dicts.optimizer_state_dict(model, optimizer, full=False)
    optim_reference = full_optimizer(model, optimizer)
    seen = set()
    for name, entries in optim_views["state"].items():
        for entry, value in entries.items():
            seen.add((name, entry))
            expected = optim_reference[(name, entry)]
            if type(value).__name__ == "ShardedTensor":
                assert tuple(value.size()) == tuple(expected.shape)
                for shard in value.local_shards():
                    m = shard.metadata
                    index = tuple(
                        slice(o, o + s) for o, s in zip(m.shard_offsets, m.shard_sizes, strict=True)
                    )
                    assert torch.equal(shard.tensor, expected[index]), (name, entry)
            else:
                assert torch.equal(value, expected), (name, entry)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    assert set().union(*everyone) == set(optim_reference), (everyone, list(optim_reference))

    # 2. round trip through the views, then both continue alike
    ours = root / "views.ckpt"
    state = {"model": views, "optimizer_0": optim_views}
    save.write_sharded_checkpoint(ours, state, {"epoch": 0, "global_step": 1}, rank=rank)
    fresh, fresh_optimizer = build(1)
    load.restore_checkpoint(ours, fresh, [fresh_optimizer])
    same(full_model(fresh), reference, "model after restore")
    same(full_optimizer(fresh, fresh_optimizer), optim_reference, "optimizer after restore")
    assert fresh_optimizer.param_groups[0]["lr"] == 0.0123, (rank, fresh_optimizer.param_groups[0]["lr"])
    step(model, optimizer, 7)
    step(fresh, fresh_optimizer, 7)
    same(full_model(fresh), full_model(model), "model after one more step")

    # 2b. the next save's state dicts reuse the views made for the first (made once per memory), and
    # they show the values after that step
    again = state_dicts.model_state_dict(model, full=False)
    assert all(again[k] is views[k] for k in views if k != "buf"), "model views made again"
    now = full_model(model)
    for key in sorted(again):
        assert torch.equal(to_full(again[key]), now[key]), key
    optim_again = state_dicts.optimizer_state_dict(model, optimizer, full=False)["state"]
    now_optim = full_optimizer(model, optimizer)
    for name, entries in optim_again.items():
        for entry, value in entries.items():
            if type(value).__name__ == "ShardedTensor":
                assert value is optim_views["state"][name][entry], (name, entry, "made again")
                for shard in value.local_shards():
                    m = shard.metadata
                    index = tuple(
                        slice(o, o + s) for o, s in zip(m.shard_offsets, m.shard_sizes, strict=True)
                    )
                    assert torch.equal(shard.tensor, now_optim[(name, entry)][index]), (name, entry)

    # 2c. one model's view state dict loaded into another of the same layout (other memory): copied
    twin, _ = build(4)
    load_views = state_dicts.model_state_dict(model, full=False)
    set_model_state(twin, {k: v for k, v in load_views.items() if k != "buf"})
    same(full_model(twin), full_model(model), "a view state dict loaded into another model")

    # 3. a checkpoint in torch's own chunking restores through the views
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    stock = root / "stock.ckpt"
    torch_state = {
        "model": get_model_state_dict(model),
        "optimizer_0": get_optimizer_state_dict(model, optimizer),
    }
    save.write_sharded_checkpoint(stock, torch_state, {"epoch": 0, "global_step": 2}, rank=rank)
    other, other_optimizer = build(2)
    load.restore_checkpoint(stock, other, [other_optimizer])
    same(full_model(other), full_model(model), "model from torch's chunks")
    same(
        full_optimizer(other, other_optimizer),
        full_optimizer(model, optimizer),
        "optimizer from torch's chunks",
    )

    # 4. a full file (gathered on rank 0, as `state_dict_type="full"` writes it) restores through the views
    full = root / "full.ckpt"
    checkpoint = {
        "state_dict": state_dicts.model_state_dict(model, full=True),
        "optimizer_states": [state_dicts.optimizer_state_dict(model, optimizer, full=True)],
        "global_step": 2,
    }
    if rank == 0:
        torch.save(checkpoint, full)
    dist.barrier()
    last, last_optimizer = build(3)
    load.restore_checkpoint(full, last, [last_optimizer])
    same(full_model(last), full_model(model), "model from a full file")
    same(full_optimizer(last, last_optimizer), full_optimizer(model, optimizer), "optimizer from a full file")
    assert last_optimizer.param_groups[0]["lr"] == 0.0123, (rank, last_optimizer.param_groups[0]["lr"])

    # 5. ranks that disagree on the fast path all leave it
    assert fsdp1.optimizer_state_views(model, optimizer) is not None
    where = collective.ranks()
    assert collective.all_true(True, where) and not collective.all_true(rank == 1, where)
    bounded = collective.bounded_group(60.0)
    for bad in (0, 1):
        param, entries = next(
            (p, e) for p, e in optimizer.state.items() if e["exp_avg"].numel() > 0
        )  # a piece this rank holds
        kept = entries["exp_avg"]
        if rank == bad:
            entries["exp_avg"] = torch.cat([kept, kept[:1]])  # not the parameter's local piece
        for group in (None, bounded):
            with collective.scope(group):
                assert fsdp1.optimizer_state_views(model, optimizer) is None, (rank, bad, group)
        entries["exp_avg"] = kept
        assert param in optimizer.state
    assert fsdp1.optimizer_state_views(model, optimizer) is not None

    dist.barrier()
    if rank == 0:
        (root / "ok").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
