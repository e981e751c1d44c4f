"""Launch a scenario with ``torchrun`` agents, as a multi-node job would start: one agent per "node".

Every agent runs ``torchrun --nnodes N --nproc-per-node P`` with a c10d rendezvous on 127.0.0.1 and a
free port, so N agents on this machine form one job of N*P ranks exactly as N machines would; the
ranks see the TorchElastic environment (``TORCHELASTIC_RUN_ID``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``)
that Lightning detects.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.distributed.launch import REPO, free_port

_RANK_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_PORT",
)


def run_torchrun(
    script: str | Path, nnodes: int, nproc_per_node: int, *args: str, timeout: float = 240.0
) -> list[str]:
    """Start ``nnodes`` torchrun agents for ``script`` and wait for all; returns each agent's output."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    env.update(
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")])),
    )
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes),
        "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", uuid.uuid4().hex[:8],
        "--local-addr", "127.0.0.1",
        "--max-restarts", "0",
        str(script), *args,
    ]  # fmt: skip
    agents = [
        subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for _ in range(nnodes)
    ]
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    timed_out = False
    for agent in agents:
        try:
            out, _ = agent.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for a in agents:
                if a.poll() is None:
                    os.killpg(a.pid, signal.SIGKILL)
            out, _ = agent.communicate()
        outputs.append(out)
    if timed_out or any(a.returncode for a in agents):
        report = "\n".join(
            f"----- agent {i} (exit {a.returncode}) -----\n{out[-6000:]}"
            for i, (a, out) in enumerate(zip(agents, outputs, strict=True))
        )
        raise AssertionError(f"torchrun {Path(script).name} {nnodes}x{nproc_per_node} failed:\n{report}")
    return outputs
