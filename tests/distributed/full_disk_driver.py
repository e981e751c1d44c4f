"""Saves onto a real, small filesystem until it is full, then onto it read-only; 2 real ranks.

Usage (as root, in a mount namespace of its own, which ``tests/test_full_disk.py`` makes with
``unshare``): ``python full_disk_driver.py DISK OUT``, where ``DISK`` is a small filesystem (a tmpfs of
a few MiB) mounted for the run. The ranks fork from this process, join a gloo group and, in order:

1. ``fill``: save versions 1, 2, ... as ``DISK/ckpt-<v>`` (sharded, about 1 MiB each) until a save
   fails: the space check refuses it before writing;
2. ``unchecked``: the same save with ``check_space=False``: the disk really fills up (ENOSPC mid-write);
3. ``overwrite``: version 20 over ``DISK/ckpt-1``: refused too (the old one is kept until the new one
   is published, so both must fit);
4. ``full``: a full checkpoint file (rank 0 writes it), unchecked: ENOSPC inside ``torch.save``;
5. ``read_only``: after ``mount -o remount,ro DISK``, a save to ``DISK/ckpt-30``: EROFS.

Every step's outcome on every rank goes to ``OUT/results.json`` (``{step: [{type, message, errno}]}``),
with the versions saved and the free bytes before each step; then ``DISK`` is copied to ``OUT/disk``
for the test to load what is left (the mount goes with the namespace).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_sharded.checkpoint import save as io
from lightning_sharded.checkpoint.failures import free_space
from tests.distributed.launch import fork, join_forked_group, store_socket

WORLD_SIZE = 2
ROWS, COLS = 256, 512  # 512 KiB of float32, twice (weight and its optimizer state): 1 MiB a checkpoint


def expected(version: int) -> dict[str, torch.Tensor]:
    """The full values of a version."""
    weight = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + version
    return {"weight": weight, "exp_avg": weight * 0.5}


def _state(version: int, mesh: Any, rank: int) -> dict[str, Any]:
    rows = ROWS // WORLD_SIZE
    sharded = {
        name: DTensor.from_local(
            full[rank * rows : (rank + 1) * rows].clone(),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )
        for name, full in expected(version).items()
    }
    return {
        "model": {"weight": sharded["weight"]},
        "optimizer_0": {"state": {"weight": {"exp_avg": sharded["exp_avg"]}}},
    }


def _attempt(call: Any) -> dict[str, Any] | None:
    try:
        call()
    except Exception as err:
        return {"type": type(err).__name__, "message": str(err), "errno": getattr(err, "errno", None)}
    return None


def run_rank(rank: int, listener: socket.socket, disk: Path, out: Path) -> int:
    join_forked_group(rank, WORLD_SIZE, listener)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))

    def save(path: Path, version: int, **kwargs: Any) -> None:
        io.write_sharded_checkpoint(
            path, _state(version, mesh, rank), {"global_step": version}, rank=rank, **kwargs
        )

    steps: dict[str, Any] = {"saved": [], "free": {}}
    version = 0
    while version < 50:
        version += 1
        steps["free"][f"fill-{version}"] = free_space(disk)
        failed = _attempt(lambda v=version: save(disk / f"ckpt-{v}", v))
        if failed is not None:
            steps["fill"] = failed
            break
        steps["saved"].append(version)
    steps["free"]["unchecked"] = free_space(disk)
    steps["unchecked"] = _attempt(lambda: save(disk / f"ckpt-{version}", version, check_space=False))
    steps["overwrite"] = _attempt(lambda: save(disk / "ckpt-1", 20))
    full = {"state_dict": expected(21), "global_step": 21}
    steps["full"] = _attempt(
        lambda: io.save_checkpoint(
            disk / "full.ckpt", dict(full), sharded=False, model_key="model", rank=rank, check_space=False
        )
    )
    dist.barrier()
    if rank == 0:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    dist.barrier()
    steps["read_only"] = _attempt(lambda: save(disk / "ckpt-30", 30))
    (out / f"rank{rank}.json").write_text(json.dumps(steps))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> None:
    disk, out = Path(argv[0]), Path(argv[1])
    listener = store_socket()
    pids = [fork(functools.partial(run_rank, rank, listener, disk, out)) for rank in range(WORLD_SIZE)]
    listener.close()  # rank 0 serves the store on its copy
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    if codes != [0] * WORLD_SIZE:
        raise SystemExit(f"ranks exited with {codes}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    (out / "results.json").write_text(json.dumps({"ranks": ranks}, indent=1))
    shutil.copytree(disk, out / "disk", symlinks=True)


if __name__ == "__main__":
    main(sys.argv[1:])
