"""A rank that dies or hangs in the middle of a save or a load, with real processes and a real gloo group.

Usage: ``python rank_fault_driver.py OUT`` runs every case of :data:`CASES` at once (each in processes of
its own), 3 ranks each, with the checkpoint's collectives on a gloo group whose timeout is
:data:`TIMEOUT_S` (``collective.bounded_group``, what the strategies' ``checkpoint_timeout`` makes).

For each case, in ``OUT/<case>/``:

- ``crashed/ckpt``: version 1 (a complete save, copied from ``OUT/template``); then the case's save of
  version 2 over it, or a load of it, with one rank told to hang (``LIGHTNING_SHARDED_FAULT=...:hang``,
  or a sleep inside DCP's shard writer) or to SIGKILL itself. Each surviving rank writes
  ``result.rank<R>.json``: the type and message of what it raised and the seconds from the start of
  the save or load to the error. The hung rank is killed once the others are done.
- ``recovered/ckpt`` (saves only): a copy of ``crashed/`` with whatever the failed save left, then a
  clean save of version 3, which must succeed and remove the leftovers.

``OUT/results.json``: each case's exit codes (``crash``, ``recover``).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_sharded.checkpoint import collective
from lightning_sharded.checkpoint import save as io
from lightning_sharded.checkpoint.load import restore_checkpoint
from tests.distributed.launch import fork, join_forked_group, store_socket
from tests.fault_injection import FAULT_ENV, HANG_S, install

install()

WORLD_SIZE = 3
ROWS, COLS = 6, 4
#: The checkpoint collectives' timeout in these runs (the strategies' default is 300 s).
TIMEOUT_S = 3.0
#: How long a survivor may take at most to raise, beyond the timeout (the marks' grace, the exit).
SLACK_S = 6.0

#: case -> (operation, LIGHTNING_SHARDED_FAULT, hang inside DCP's writer on this rank, the faulty rank)
CASES: dict[str, tuple[str, str, int | None, int]] = {
    "save_hang_after_write_rank1": ("save", "after_write@1:hang", None, 1),
    "save_hang_after_write_rank0": ("save", "after_write@0:hang", None, 0),
    "save_hang_in_dcp_write_rank2": ("save", "", 2, 2),
    # rank 0 dies between sealing and publishing: the others learn it from the outcome's broadcast
    "save_kill_before_publish_rank0": ("save", "before_publish@0", None, 0),
    "load_hang_rank1": ("load", "before_read@1:hang", None, 1),
    "load_kill_rank2": ("load", "before_read@2", None, 2),
}


def expected(version: int) -> dict[str, torch.Tensor]:
    """The model's full values at ``version``."""
    weight = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000.0 * version
    return {"weight": weight, "bias": torch.full((ROWS,), float(version))}


def _model(version: int, mesh: Any, rank: int) -> nn.Module:
    model = nn.Linear(COLS, ROWS)
    rows = ROWS // WORLD_SIZE
    for name, full in expected(version).items():
        local = full[rank * rows : (rank + 1) * rows].clone()
        value = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
        setattr(model, name, nn.Parameter(value))
    return model


def _report(folder: Path, rank: int, err: BaseException, started: float) -> None:
    elapsed = time.monotonic() - started
    print(f"rank {rank} after {elapsed:.1f}s {type(err).__name__}: {err}", flush=True)
    (folder / f"result.rank{rank}.json").write_text(
        json.dumps({"type": type(err).__name__, "message": str(err), "elapsed": elapsed})
    )


def run_rank(
    rank: int, listener: socket.socket, ckpt: Path, operation: str, version: int, dcp_hang: int | None
) -> int:
    """One rank: join the group, make the bounded group, save ``version`` or load; the exit code."""
    join_forked_group(rank, WORLD_SIZE, listener)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    group = collective.bounded_group(TIMEOUT_S)
    if dcp_hang == rank:
        from torch.distributed.checkpoint import filesystem

        original = filesystem._write_item

        def write_then_hang(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            time.sleep(HANG_S)
            return result

        filesystem._write_item = write_then_hang  # type: ignore[assignment]
    model = _model(version if operation == "save" else 0, mesh, rank)
    started = time.monotonic()
    try:
        with collective.scope(group):
            if operation == "save":
                state = {"state_dict": {"weight": model.weight, "bias": model.bias}}
                io.write_sharded_checkpoint(
                    ckpt, state, {"global_step": version, "epoch": version}, rank=rank
                )
            else:
                restore_checkpoint(ckpt, model)
                for name, full in expected(1).items():
                    assert torch.equal(getattr(model, name).full_tensor(), full), name
    except BaseException as err:
        _report(ckpt.parent, rank, err, started)
        os._exit(4)  # the group is broken: no teardown that could wait on it
    dist.destroy_process_group()
    return 0


def run_op(
    ckpt: Path, operation: str, version: int, fault: str = "", dcp_hang: int | None = None, faulty: int = -1
) -> list[int]:
    """Fork the ranks of one save or load; once every rank but ``faulty`` has exited (or the deadline
    passed), kill what is left. Each rank's exit code (negative: killed by that signal)."""
    listener = store_socket()

    def the_rank(rank: int) -> int:
        os.environ[FAULT_ENV] = fault
        return run_rank(rank, listener, ckpt, operation, version, dcp_hang)

    pids = [fork(functools.partial(the_rank, rank)) for rank in range(WORLD_SIZE)]
    listener.close()  # rank 0 serves the store on its copy
    codes: dict[int, int] = {}
    deadline = time.monotonic() + 30 + TIMEOUT_S + SLACK_S
    while len(codes) < WORLD_SIZE:
        for i, pid in enumerate(pids):
            if i not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)
        others_done = all(i in codes for i in range(WORLD_SIZE) if i != faulty)
        if others_done or time.monotonic() > deadline:
            for i, pid in enumerate(pids):
                if i not in codes:
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    return [codes[i] for i in range(WORLD_SIZE)]


def _warm_up() -> None:
    """Pay DTensor's first-use cost once, before forking, on a fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    # DTensors only: a layout computed here (an nn.Parameter of one) is cached for rank 0 and would be
    # reused by every forked rank
    DTensor.from_local(
        torch.zeros(2, COLS), mesh, [Shard(0)], run_check=False, shape=(ROWS, COLS), stride=(COLS, 1)
    )
    dist.destroy_process_group()


def run_case(out: Path, name: str) -> dict[str, list[int]]:
    operation, fault, dcp_hang, faulty = CASES[name]
    crashed = out / name / "crashed"
    shutil.copytree(out / "template", crashed, symlinks=True)
    result = {"crash": run_op(crashed / "ckpt", operation, 2, fault, dcp_hang, faulty)}
    if operation == "save":
        recovered = out / name / "recovered"
        shutil.copytree(crashed, recovered, symlinks=True)
        result["recover"] = run_op(recovered / "ckpt", "save", 3)
    return result


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    _warm_up()
    codes = run_op(out / "template" / "ckpt", "save", 1)
    if codes != [0] * WORLD_SIZE:
        raise SystemExit(f"the template save failed: exit codes {codes}")

    def running(name: str) -> None:
        (out / f"{name}.json").write_text(json.dumps(run_case(out, name)))

    children = {name: fork(functools.partial(running, name)) for name in CASES}
    failed = [n for n, pid in children.items() if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])]
    if failed:
        raise SystemExit(f"the driver of case(s) {failed} failed")
    results = {name: json.loads((out / f"{name}.json").read_text()) for name in CASES}
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
