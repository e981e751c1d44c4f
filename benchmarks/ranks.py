"""The one rank runner: start N ranks as torchrun would, forked after one import; figures come back as files.

Driver side, :func:`run_rank_cases`: starts one process, ``python -m benchmarks.cases`` (the registry
of rank cases), with the cases and their options, and waits for it (``timeout``: every rank is killed
at it). That process imports torch, Lightning and the cases once, then forks one child per rank
(:func:`serve`), each with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` (loopback) and
``MASTER_PORT`` (a free port) set, so ``init_process_group("gloo")`` works and Lightning uses this
environment instead of relaunching ``sys.argv``. A child is a real process of its own; forking only
spares each rank the import of torch and Lightning, which no figure times.

Rank side, :func:`run_cases`: every rank runs the named cases one after the other in the same
process group and writes its figures to ``OUT/rank<R>.json`` after each case (so a case that fails
leaves the others; its error is recorded); its output goes to ``OUT/rank<R>.log``. When a rank
exits with an error, the others are killed (they would wait in a collective) and the driver raises
with every rank's log.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from benchmarks import ROOT

#: A rank case: ``(case name, options) -> this rank's figures`` (JSON-serializable).
Case = Callable[[str, argparse.Namespace], dict[str, Any]]
#: Imported once before the ranks are forked: third-party only, none of which reads per-rank state at
#: import except Lightning's ``rank_zero_only`` (set again in each rank).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "lightning.pytorch",
    "lightning.fabric",
)
#: Variables a launcher sets per rank: the process that forks the ranks must not inherit them.
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_PORT")


# ------------------------------------------------------------------------------------- driver side


def launcher_env() -> dict[str, str]:
    """This process's environment for a child that starts ranks itself: no rank variables, loopback,
    one OpenMP thread (set before torch is imported, so a forked rank starts none), the repository first
    on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env.update(
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")])),
    )
    return env


def run_rank_cases(
    cases: Sequence[str],
    scratch: Path,
    width: int,
    layers: int,
    *options: str,
    world: int = 2,
    timeout: float,
) -> list[dict[str, Any]]:
    """Run ``cases`` on ``world`` ranks, their files in ``scratch``, the model ``layers`` x
    ``Linear(width, width)``; ``options`` are those of :func:`parser`. Each rank's figures, by rank.

    Raises:
        RuntimeError: a rank failed or the ranks did not finish within ``timeout`` seconds; the message
            holds every rank's log.
    """
    out = scratch / "ranks"
    out.mkdir()
    argv = [*cases, "--dir", str(scratch), "--out", str(out), "--world", str(world)]
    argv += ["--width", str(width), "--layers", str(layers), *options]
    with open(out / "launcher.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.cases", *argv],
            env=launcher_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # what is left of the ranks
            proc.wait()
    if code != 0:
        reason = f"timed out after {timeout:.0f} s" if code is None else f"failed (exit {code})"
        logs = "\n".join(
            f"----- {path.name} -----\n{path.read_text(errors='replace')[-6000:]}"
            for path in sorted(out.glob("*.log"))
        )
        raise RuntimeError(f"the ranks of {' '.join(cases)} {reason}:\n{logs}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


# --------------------------------------------------------------------------------------- rank side


def parser() -> argparse.ArgumentParser:
    """The options every rank gets (those of every case)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.cases")
    p.add_argument("cases", nargs="+")
    p.add_argument("--dir", type=Path, required=True, help="scratch folder of the checkpoints")
    p.add_argument("--out", type=Path, required=True, help="where rank<R>.json and rank<R>.log go")
    p.add_argument("--world", type=int, default=2, help="ranks")
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--raw-bytes", type=int, default=0, help="probe the disk with this many bytes")
    p.add_argument("--full", action="store_true", help="stock-mp also writes the full file")
    p.add_argument("--batch", type=int, default=16, help="rows per step of the throughput cases")
    p.add_argument("--light-batch", type=int, default=8, help="rows per step of the throughput-light-* cases")
    p.add_argument("--steady", type=int, default=6, help="steps per window without a save")
    p.add_argument("--cycles", type=int, default=2, help="save windows of the throughput cases")
    p.add_argument("--async-repeats", type=int, default=None, help="timed async saves (--repeats)")
    p.add_argument("--verify-cycles", type=int, default=None, help="verify case's loads (--cycles)")
    p.add_argument("--cprofile", type=Path, default=None, help="phases-*: rank 0's pstats go here")
    return p


def serve(cases: Mapping[str, Case], argv: Sequence[str] | None = None) -> None:
    """The process of :func:`run_rank_cases`: import once, fork the ranks, wait for them.

    Exits non-zero when a rank did (after killing the others) or a case name is unknown.
    """
    # As before the rank runner was a package: no warning printed in a timed call (FSDP1's
    # ShardedTensor views warn of its deprecation on every DCP operation).
    warnings.filterwarnings("ignore")
    args = parser().parse_args(argv)
    args.async_repeats = args.async_repeats or args.repeats
    args.verify_cycles = args.verify_cycles or args.cycles
    unknown = [case for case in args.cases if case not in cases]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {sorted(cases)}")
    for name in PRELOAD:
        importlib.import_module(name)
    from lightning_sharded._launch import free_port

    port = free_port()
    children: dict[int, int] = {}  # pid -> rank
    for rank in range(args.world):
        pid = os.fork()
        if pid == 0:
            _become_rank(rank, port, args, cases)
        children[pid] = rank
    failed = 0
    while children:
        pid, status = os.wait()
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code if code > 0 else 1
            print(f"rank {rank} exited with {code}; stopping the other ranks", flush=True)
            for other in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGKILL)
    sys.exit(failed)


def redirect_output(path: Path | str) -> None:
    """Send this process's stdout and stderr (the file descriptors) to the file ``path``."""
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def exit_after(run: Callable[[], int]) -> NoReturn:
    """End a forked child with ``run()``'s exit status (1, its traceback printed, if it raised), its
    output flushed: ``os._exit``, so nothing of the parent's (``atexit`` handlers, buffers) runs twice."""
    code = 1
    try:
        code = run()
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _become_rank(rank: int, port: int, args: argparse.Namespace, cases: Mapping[str, Case]) -> NoReturn:
    """In a forked child: become rank ``rank`` and run the cases."""

    def run() -> int:
        redirect_output(args.out / f"rank{rank}.log")
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        from lightning_sharded._launch import rank_env

        env = rank_env(rank, args.world, port, ROOT)
        env.pop("PL_TRAINER_GPUS", None)
        os.environ.clear()
        os.environ.update(env)
        rank_zero_only.rank = rank  # type: ignore[attr-defined]  # read from the environment at import
        run_cases(args, cases)
        return 0

    exit_after(run)


def run_cases(args: argparse.Namespace, cases: Mapping[str, Case]) -> None:
    """This rank's run: every case of ``args.cases`` in one process group, the figures after each."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    out = args.out / f"rank{rank}.json"
    for case in args.cases:
        torch.manual_seed(0)
        start = time.perf_counter()
        try:
            results[case] = cases[case](case, args)
        except Exception as ex:  # record it; the other cases still run
            results[case] = {"error": f"{ex!r}", "traceback": traceback.format_exc()[-4000:]}
        results[case]["case s"] = time.perf_counter() - start
        out.write_text(json.dumps(results, indent=1))
        print(f"rank {rank}: {case} done in {time.perf_counter() - start:.1f} s", flush=True)
    dist.destroy_process_group()
