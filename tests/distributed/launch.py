"""Start the ranks of a multi-process scenario as real processes, as torchrun would.

Each rank is ``python SCRIPT ARGS...`` with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
(loopback) and ``MASTER_PORT`` (a free port, new for every launch) set, so ``init_process_group("gloo")``
works and Lightning uses this environment instead of relaunching ``sys.argv``. Scenario scripts report
results through files in a folder the test gives them; a rank that fails, hangs past the timeout or
exits non-zero fails the test with every rank's output.

Ranks are forked from a process that has imported torch and Lightning once (``tests/distributed/zygote.py``:
still one real process per rank, without the import cost of a cold start); ``LIGHTNING_SHARDED_TEST_COLD=1``
starts every rank cold instead.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.ranks import launcher_env
from lightning_sharded._launch import free_port
from lightning_sharded._launch import rank_env as _rank_env
from tests.distributed.zygote import COLD_ENV, ForkedRank, Zygote

REPO = Path(__file__).resolve().parents[2]

Rank = subprocess.Popen[str] | ForkedRank
_zygote: Zygote | None = None
_outputs: Path | None = None


def rank_env(rank: int, world_size: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The package's rank environment with this repository first on ``PYTHONPATH``, plus ``extra``."""
    env = _rank_env(rank, world_size, port, REPO)
    env.pop("PL_TRAINER_GPUS", None)
    if extra:
        env.update(extra)
    return env


def run_ranks(
    script: str | Path,
    world_size: int,
    *args: str,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run ``script`` once per rank and wait for all of them; returns each rank's combined output.

    Raises:
        AssertionError: a rank exited non-zero or the ranks did not finish within ``timeout`` seconds
            (all ranks are then killed); the message holds every rank's output.
    """
    port = free_port()
    procs = [start_rank([str(script), *args], rank_env(r, world_size, port, env)) for r in range(world_size)]
    return wait_all(procs, timeout, f"{Path(script).name} x{world_size}", "rank")


def start_rank(argv: list[str], env: dict[str, str]) -> Rank:
    """``python ARGV`` with ``env`` in a session of its own, output captured: forked from the session's
    zygote, or a cold process when ``LIGHTNING_SHARDED_TEST_COLD=1``."""
    global _zygote, _outputs
    if os.environ.get(COLD_ENV) == "1":
        return subprocess.Popen(
            [sys.executable, *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    if _zygote is None:
        _outputs = Path(tempfile.mkdtemp(prefix="ls-ranks-"))
        _zygote = Zygote(launcher_env(), REPO)
        atexit.register(_zygote.close)
    assert _outputs is not None
    out = Path(tempfile.mkstemp(dir=_outputs, suffix=".out")[1])
    return _zygote.start(argv, env, out)


def wait_all(procs: list[Rank], timeout: float, label: str, what: str) -> list[str]:
    """Wait for every process; kill all of them (their process groups) at ``timeout`` seconds.

    Returns each process's combined output. Raises ``AssertionError`` with every output when one
    exited non-zero or the timeout struck.
    """
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    timed_out = False
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        outputs.append(out)
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0]
    if timed_out or failed:
        report = "\n".join(
            f"----- {what} {i} (exit {procs[i].returncode}) -----\n{out[-6000:]}"
            for i, out in enumerate(outputs)
        )
        reason = f"timed out after {timeout:.0f}s" if timed_out else f"{what}s {failed} failed"
        raise AssertionError(f"{label} {reason}:\n{report}")
    return outputs


def shell_env() -> dict[str, str]:
    """A user's shell for a command the docs show: this interpreter's scripts (lightning-sharded,
    torchrun) first on ``PATH``, no rank variables, terminal width 80."""
    env = launcher_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["COLUMNS"] = "80"
    return env
