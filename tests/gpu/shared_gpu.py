"""Two ranks sharing one GPU, with the gloo backend for CUDA tensors: does a sharded save and load work?

Usage (one process per rank, as torchrun starts them): ``python tests/gpu/shared_gpu.py OUT [--device
cuda|cpu]``. Each rank puts an FSDP2 model (``fully_shard``) and a DTensor attribute on ``cuda:0``,
trains a step, saves a sharded checkpoint asynchronously (staging, background write, commit), loads
it into a fresh model and optimizer, and compares. Rank 0 writes ``OUT/shared_gpu.json``: whether it
worked, and if torch refused, the first error (gloo does not implement every collective for CUDA
tensors). Lightning's strategies cannot run this layout (one device per process), so the library's
save and load functions are called directly, as the strategies call them.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_sharded import register_sharded_state_hooks  # noqa: E402
from lightning_sharded.checkpoint.async_save import AsyncSaver  # noqa: E402
from lightning_sharded.checkpoint.load import restore_checkpoint  # noqa: E402
from lightning_sharded.checkpoint.save import split_sharded_checkpoint, write_sharded_checkpoint  # noqa: E402
from lightning_sharded.checkpoint.state_dicts import model_state_dict, optimizer_state_dict  # noqa: E402
from tests import _compare as compare  # noqa: E402


def build(device: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(seed)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    register_sharded_state_hooks(model)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.table = distribute_tensor(torch.randn(8, 3, device=device), mesh, [Shard(0)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def full_values(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    values = compare.full_values(model, [optimizer], optimizer_key="optim")
    values["table"] = model.table.full_tensor().cpu()
    return values


def scenario(out: Path, device: str) -> dict[str, Any]:
    rank = dist.get_rank()
    model, optimizer = build(device, seed=0)
    model(torch.randn(4, 16, device=device)).sum().backward()
    optimizer.step()
    saved = full_values(model, optimizer)
    checkpoint = {
        "state_dict": model_state_dict(model, full=False),
        "optimizer_states": [optimizer_state_dict(model, optimizer, full=False)],
        "global_step": 1,
    }
    state, metadata = split_sharded_checkpoint(checkpoint, "state_dict")
    saver = AsyncSaver("shared-gpu")

    def write(target: Any, staged: Any, group: Any) -> None:
        write_sharded_checkpoint(target, staged[0], staged[1], rank=rank, group=group)

    saver.save(out / "ckpt", (state, metadata), write)
    staged = saver.buffers
    on_cpu = all(b.device.type == "cpu" for b in staged._buffers.values())
    pinned = all(b.is_pinned() for b in staged._buffers.values()) if device == "cuda" else None
    saver.close()

    fresh, fresh_optimizer = build(device, seed=1)
    fresh(torch.randn(4, 16, device=device)).sum().backward()
    fresh_optimizer.step()  # so the optimizer has state to load into
    restore_checkpoint(out / "ckpt", fresh, [fresh_optimizer])
    restored = full_values(fresh, fresh_optimizer)
    differ = sorted(k for k in saved if k not in restored or not torch.equal(saved[k], restored[k]))
    return {"worked": not differ, "differ": differ, "staged_on_cpu": on_cpu, "staged_pinned": pinned}


def main() -> None:
    out = Path(sys.argv[1])
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
    dist.init_process_group("gloo")
    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks on the one GPU
    try:
        result = scenario(out, device)
    except Exception as err:
        result = {
            "worked": False,
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(),
        }
    result["rank"] = dist.get_rank()
    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        (out / "shared_gpu.json").write_text(json.dumps({"device": device, "ranks": results}, indent=1))
        print(json.dumps({"device": device, "worked": all(r["worked"] for r in results)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
