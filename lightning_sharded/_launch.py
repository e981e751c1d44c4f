"""Starting rank processes on this machine as torchrun would: a free port and each rank's environment.

Used by the demo (and by the tests' launcher): with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set, ``init_process_group("gloo")`` works and Lightning uses this
environment instead of relaunching ``sys.argv``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(rank: int, world_size: int, port: int, pythonpath: Path) -> dict[str, str]:
    """This process's environment for rank ``rank`` of a one-node job on loopback.

    ``pythonpath`` goes first on ``PYTHONPATH`` so the ranks import the same code as the launcher.
    """
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH", "")])),
        PYTHONUNBUFFERED="1",
    )
    return env


def _die_with_launcher() -> None:  # pragma: no cover - runs in the child, between fork and exec
    # Not Linux: no prctl, and a rank outlives a launcher that was killed, as before.
    with contextlib.suppress(OSError, AttributeError):
        # prctl(PR_SET_PDEATHSIG = 1, ...): Linux sends the rank this signal when its launcher dies.
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


@dataclass
class Outcome:
    """How the ranks of one launch ended: each one's combined stdout and stderr, and exit status (``-9``
    for a rank killed because another failed or at the deadline)."""

    outputs: list[str]
    returncodes: list[int]
    first_failed: int | None
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.first_failed is None and not self.timed_out


def run_ranks(
    command: Sequence[str], envs: Sequence[dict[str, str]], timeout: float, poll_s: float = 0.05
) -> Outcome:
    """Start one process of ``command`` per environment in ``envs`` and wait for all of them.

    Fails fast: as soon as one rank exits non-zero, the others are killed, since they would wait for
    it in their first collective (or rendezvous) until the process group's timeout. The ranks are
    killed too at ``timeout`` seconds, and when this process dies (Linux), so none is left behind.
    """
    with tempfile.TemporaryDirectory(prefix="lightning-sharded-ranks-") as folder:
        files = [open(Path(folder) / f"rank{r}.out", "w+") for r in range(len(envs))]  # noqa: SIM115
        try:
            procs = [
                subprocess.Popen(
                    list(command),
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_launcher,
                )
                for env, out in zip(envs, files, strict=True)
            ]
            deadline = time.monotonic() + timeout
            first_failed: int | None = None
            timed_out = False
            while None in (codes := [p.poll() for p in procs]):  # every rank polled, each time
                failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    first_failed = failed[0] if failed else None
                    timed_out = not failed
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                    break
                time.sleep(poll_s)
            for p in procs:
                p.wait()
            if first_failed is None and not timed_out:
                first_failed = next((r for r, p in enumerate(procs) if p.returncode != 0), None)
            outputs = [Path(out.name).read_text() for out in files]  # the ranks wrote to the files' fds
        finally:
            for out in files:
                out.close()
    return Outcome(outputs, [p.returncode for p in procs], first_failed, timed_out)
