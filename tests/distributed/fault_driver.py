"""Crash a sharded save at chosen points, with real processes, real gloo and real SIGKILLs.

Usage: ``python fault_driver.py OUT CASE...`` (``CASE`` names from :data:`CASES`, or ``all``).

The driver imports torch and warms DTensor up once (on a fake process group), then for every case
forks one process per rank; each rank joins a real gloo process group (its own store per save) and
saves through ``commit_directory`` a checkpoint with the layout of stock Lightning's
``ModelParallelStrategy`` (``state_dict`` and ``optimizer_0`` as DTensors sharded over the ranks,
written by ``torch.distributed.checkpoint.save``, and ``meta.pt`` from rank 0). Forking after one
import makes a save cost about 0.2 s instead of 6 s per launch.

For each case, in ``OUT/<case>/``:

- ``crashed/ckpt``: a copy of ``OUT/template/ckpt`` (version 1, a complete save), then an attempt to
  overwrite it with version 2, crashed as the case says. The test loads it and expects version 1
  or 2, whole.
- ``recovered/ckpt``: a copy of ``crashed/`` (leftovers included), then a clean save of version 3,
  which must succeed and clean the leftovers up; it checksums while writing (``ChecksummingWriter``).

A rank whose ``commit_directory`` raised writes ``<type>: <message>`` to ``error.rank<R>.txt`` next
to the checkpoint. ``OUT/results.json`` maps each case to the exit codes of its ranks (negative:
killed by that signal).

How a rank is crashed: ``LIGHTNING_SHARDED_FAULT=<point>[@rank]`` (``atomic.py``'s fault points), or
a kill inside the ``write`` callable (points ``atomic.py`` cannot see):

- ``during_shards@R``: rank R SIGKILLs itself after DCP wrote its first tensor into its shard file;
- ``after_shards@R``: rank R SIGKILLs itself after ``dcp.save`` returned, before ``meta.pt``;
- ``enospc_shards@R``: DCP's file writer raises ``OSError(ENOSPC)`` on rank R after writing part of
  its shard file (DCP reports it to every rank as a ``CheckpointException``);
- ``enospc_meta@0``: rank 0's ``torch.save`` of ``meta.pt`` raises ``OSError(ENOSPC)``;
- ``eio_after_shards@R``: rank R's ``write`` raises ``OSError(EIO)`` after ``dcp.save`` returned (its
  shards written, the other ranks' writes fine): only rank R knows of the failure;
- ``eio_seal@R``: rank R's ``fsync`` of its files while it seals them raises ``OSError(EIO)`` (its
  ``write`` returned fine): only rank R knows of the failure.
"""

from __future__ import annotations

import errno
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
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_sharded.checkpoint.backends.dcp_writer import ChecksummingWriter
from lightning_sharded.checkpoint.commit import commit_directory
from tests.distributed.launch import fork, join_forked_group, store_socket
from tests.fault_injection import FAULT_ENV, NO_EXCHANGE_ENV, install

install()

WORLD_SIZE = 2
ROWS = 8
COLS = 6
GRACE_S = 10.0
TIMEOUT_S = 60.0

#: case -> (kill spec inside write, LIGHTNING_SHARDED_FAULT, publish with two renames, no previous ckpt)
CASES: dict[str, tuple[str, str, bool, bool]] = {
    "clean": ("", "", False, False),
    "during_shards_rank1": ("during_shards@1", "", False, False),
    "during_shards_all": ("during_shards", "", False, False),
    "after_shards_rank0": ("after_shards@0", "", False, False),
    "after_write_rank1": ("", "after_write@1", False, False),
    "before_manifest_all": ("", "before_manifest", False, False),
    "before_publish_rank0": ("", "before_publish@0", False, False),
    "before_publish_rank1": ("", "before_publish@1", False, False),
    "after_publish_all": ("", "after_publish", False, False),
    "during_remove_all": ("", "during_remove", False, False),
    "fallback_between_renames": ("", "between_renames", True, False),
    "fallback_after_publish": ("", "after_publish", True, False),
    "fallback_during_remove": ("", "during_remove", True, False),
    "enospc_shards_rank1": ("enospc_shards@1", "", False, False),
    "enospc_meta_rank0": ("enospc_meta@0", "", False, False),
    "fresh_before_publish": ("", "before_publish", False, True),
    "eio_after_shards_rank1": ("eio_after_shards@1", "", False, False),
    "eio_seal_rank1": ("eio_seal@1", "", False, False),
}


def expected(version: int) -> dict[str, Any]:
    """The full checkpoint of a version as ``load_checkpoint`` returns it (optimizer in DCP's FQN form)."""
    base = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    weight = base + 1000.0 * version
    bias = torch.full((ROWS,), float(version))
    return {
        "state_dict": {"layer.weight": weight, "layer.bias": bias},
        "optimizer_0": {
            "state": {
                "layer.weight": {"step": torch.tensor(float(version)), "exp_avg": weight * 0.5},
                "layer.bias": {"step": torch.tensor(float(version)), "exp_avg": bias * 0.5},
            },
            "param_groups": [{"lr": 0.1, "params": ["layer.weight", "layer.bias"]}],
        },
        "epoch": version,
        "global_step": 10 * version,
        "loops": {"fit_loop": {"version": version}},
    }


def _shard(tensor: torch.Tensor, mesh: Any, rank: int) -> DTensor:
    rows = tensor.shape[0] // WORLD_SIZE
    local = tensor[rank * rows : (rank + 1) * rows].clone()
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def _kill_at(spec: str, point: str, rank: int) -> bool:
    name, _, who = spec.partition("@")
    return name == point and (not who or int(who) == rank)


def save_rank(rank: int, listener: socket.socket, ckpt: Path, version: int, kill: str) -> int:
    """Body of one rank: join the group, save ``version`` at ``ckpt``; returns the exit code."""
    join_forked_group(rank, WORLD_SIZE, listener)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    full = expected(version)
    state = {
        "state_dict": {k: _shard(v, mesh, rank) for k, v in full["state_dict"].items()},
        "optimizer_0": {
            "state": {
                k: {"step": s["step"], "exp_avg": _shard(s["exp_avg"], mesh, rank)}
                for k, s in full["optimizer_0"]["state"].items()
            },
            "param_groups": full["optimizer_0"]["param_groups"],
        },
    }
    meta = {k: full[k] for k in ("epoch", "global_step", "loops")}

    if _kill_at(kill, "during_shards", rank):
        from torch.distributed.checkpoint import filesystem

        original = filesystem._write_item

        def write_then_die(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            args[1].flush()
            os.kill(os.getpid(), signal.SIGKILL)
            return result

        filesystem._write_item = write_then_die  # type: ignore[assignment]

    if _kill_at(kill, "enospc_shards", rank):
        from torch.distributed.checkpoint import filesystem

        original_write = filesystem._write_item

        def write_then_fail(*args: Any, **kwargs: Any) -> Any:
            original_write(*args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")

        filesystem._write_item = write_then_fail  # type: ignore[assignment]

    failing_fsync = False
    if _kill_at(kill, "eio_seal", rank):
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if failing_fsync:
                raise OSError(errno.EIO, "Input/output error (simulated)")
            real_fsync(fd)

        os.fsync = fsync  # type: ignore[assignment]

    def write(staging: Path) -> dict[str, tuple[int, str]] | None:
        nonlocal failing_fsync
        # Version 3 (the saves after a crash) checksums while DCP writes; the others are read back.
        writer = ChecksummingWriter(staging) if version == 3 else None
        dcp.save(state, checkpoint_id=staging, storage_writer=writer)
        if _kill_at(kill, "after_shards", rank):
            os.kill(os.getpid(), signal.SIGKILL)
        if _kill_at(kill, "eio_after_shards", rank):
            raise OSError(errno.EIO, "Input/output error (simulated)")
        failing_fsync = _kill_at(kill, "eio_seal", rank)  # from here on: the seal's fsyncs
        if rank == 0:
            torch.save(meta, staging / "meta.pt")
            if _kill_at(kill, "enospc_meta", rank):
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return writer.checksums if writer is not None else None

    def report(err: BaseException) -> None:
        message = f"{type(err).__name__}: {err}"
        print(f"rank {rank} {message}", flush=True)
        (ckpt.parent / f"error.rank{rank}.txt").write_text(message)

    try:
        commit_directory(ckpt, write, metadata={"epoch": version, "global_step": 10 * version})
    except OSError as err:
        report(err)
        return 3
    except Exception as err:
        report(err)
        return 4
    except BaseException as err:  # DCP's CheckpointException
        report(err)
        return 5
    dist.destroy_process_group()
    return 0


def run_save(
    ckpt: Path, version: int, kill: str = "", fault: str = "", no_exchange: bool = False
) -> list[int]:
    """Fork the ranks of one save and wait for them; a rank still alive after another was killed is
    given ``GRACE_S`` seconds, then killed. Returns each rank's exit code (negative: signal)."""
    listener = store_socket()

    def the_rank(rank: int) -> int:
        os.environ[FAULT_ENV] = fault
        os.environ[NO_EXCHANGE_ENV] = "1" if no_exchange else "0"
        return save_rank(rank, listener, ckpt, version, kill)

    pids = [fork(functools.partial(the_rank, rank)) for rank in range(WORLD_SIZE)]
    listener.close()  # rank 0 serves the store on its copy
    codes: dict[int, int] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(codes) < len(pids):
        for i, pid in enumerate(pids):
            if i in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[i] = os.waitstatus_to_exitcode(status)
                if codes[i] < 0:
                    deadline = min(deadline, time.monotonic() + GRACE_S)
        if time.monotonic() > deadline:
            for i, pid in enumerate(pids):
                if i not in codes:
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    return [codes[i] for i in range(len(pids))]


def _warm_up() -> None:
    """Pay DTensor's first-use cost (over a second) once, before forking, on a fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    _shard(torch.zeros(ROWS, COLS), mesh, 0)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    names = list(CASES) if argv[1:] == ["all"] else argv[1:]
    _warm_up()
    template = out / "template"
    codes = run_save(template / "ckpt", 1)
    if codes != [0] * WORLD_SIZE:
        raise SystemExit(f"the template save failed: exit codes {codes}")
    results: dict[str, dict[str, list[int]]] = {}
    for name in names:
        kill, fault, no_exchange, fresh = CASES[name]
        crashed = out / name / "crashed"
        if fresh:
            crashed.mkdir(parents=True)
        else:
            shutil.copytree(template, crashed, symlinks=True)
        crash_codes = run_save(crashed / "ckpt", 2, kill, fault, no_exchange)
        recovered = out / name / "recovered"
        shutil.copytree(crashed, recovered, symlinks=True)
        recover_codes = run_save(recovered / "ckpt", 3, no_exchange=no_exchange)
        results[name] = {"crash": crash_codes, "recover": recover_codes}
        print(f"{name}: crash {crash_codes} recover {recover_codes}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
