"""One rank of the param-groups check (``tests/checkpoint/test_param_groups.py``).

    param_groups_script.py DIR

For FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``, as ``ShardedFSDPStrategy`` wraps)
and FSDP2 (``fully_shard`` on a 1-D mesh), with two and with three parameter groups of different sizes,
learning rates and weight decays (AdamW, one step): a sharded save of the model and optimizer as the
strategies make them (``state_dicts``), then a restore into a fresh model whose optimizer has the same
groups with other settings and other state. After the restore, torch's own view of the optimizer
(``get_optimizer_state_dict``, which gathers) must equal the saved one: each group's settings and
members (parameter names, in order), and every parameter's state. Writes ``DIR/ok`` from rank 0 when
every case holds; a failure names the case, the group and the setting or parameter.
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

from lightning_sharded.checkpoint import load, save, state_dicts  # noqa: E402
from lightning_sharded.tensors import to_full  # noqa: E402

#: case -> groups, each (parameter names, lr, weight decay); sizes differ, so does the order of names
GROUPS: dict[str, list[tuple[list[str], float, float]]] = {
    "three": [
        (["a.weight", "a.bias"], 0.1, 0.0),
        (["b.weight"], 0.02, 0.01),
        (["c.bias", "b.bias", "c.weight"], 0.003, 0.1),
    ],
    "two": [
        (["c.weight", "a.weight"], 0.05, 0.2),
        (["a.bias", "b.weight", "b.bias", "c.bias"], 0.007, 0.0),
    ],
}


class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 6)
        self.c = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))).pow(2).sum()


def wrap(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    module = Three()
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module,
            auto_wrap_policy=lambda module, recurse, nonwrapped_numel: (
                recurse or isinstance(module, nn.Linear)
            ),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (module.a, module.b, module.c):
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def build(kind: str, case: str, seed: int, fresh: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and AdamW with the case's groups, stepped once; ``fresh``: other settings per group."""
    model = wrap(kind, seed)
    params = {name.replace("_fsdp_wrapped_module.", ""): p for name, p in model.named_parameters()}
    groups = [
        {
            "params": [params[name] for name in names],
            "lr": 0.5 if fresh else lr,
            "weight_decay": 0.5 if fresh else decay,
            "betas": (0.5, 0.6) if fresh else (0.9, 0.99),
        }
        for names, lr, decay in GROUPS[case]
    ]
    optimizer = torch.optim.AdamW(groups, foreach=False)
    torch.manual_seed(100 + seed)
    model(torch.randn(4, 5)).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def torch_view(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Torch's own optimizer state dict (gathered), tensors full."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    state = {n: {k: to_full(v).clone() for k, v in sorted(e.items())} for n, e in sorted(sd["state"].items())}
    return {"state": state, "param_groups": sd["param_groups"]}


def check(kind: str, case: str, saved: dict[str, Any], restored: dict[str, Any]) -> None:
    groups, expected = restored["param_groups"], saved["param_groups"]
    case_name = f"{kind}-{case}"
    assert len(groups) == len(expected) == len(GROUPS[case]), (case_name, len(groups), len(expected))
    for index, (group, want) in enumerate(zip(groups, expected, strict=True)):
        names, lr, decay = GROUPS[case][index]
        assert group["params"] == want["params"] == names, (case_name, index, group["params"], want["params"])
        assert (group["lr"], group["weight_decay"]) == (lr, decay), (case_name, index, group)
        for key in sorted(want):
            assert group[key] == want[key], (case_name, index, key, group[key], want[key])
    assert list(restored["state"]) == list(saved["state"]), case_name
    for name, entries in saved["state"].items():
        for key, value in entries.items():
            assert torch.equal(restored["state"][name][key], value), (case_name, name, key)


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for kind in ("fsdp1", "fsdp2"):
        for case in GROUPS:
            model, optimizer = build(kind, case, 0, fresh=False)
            saved = torch_view(model, optimizer)
            path = root / f"{kind}-{case}"
            state = {
                "model": state_dicts.model_state_dict(model, full=False),
                "optimizer_0": state_dicts.optimizer_state_dict(model, optimizer, full=False),
            }
            save.write_sharded_checkpoint(path, state, {"epoch": 0, "global_step": 1}, rank=rank)
            fresh, fresh_optimizer = build(kind, case, 1, fresh=True)
            assert torch_view(fresh, fresh_optimizer)["param_groups"] != saved["param_groups"]
            load.restore_checkpoint(path, fresh, [fresh_optimizer])
            check(kind, case, saved, torch_view(fresh, fresh_optimizer))
            print(f"rank {rank}: {kind} {case} groups restored", flush=True)
    dist.barrier()
    if rank == 0:
        (root / "ok").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
