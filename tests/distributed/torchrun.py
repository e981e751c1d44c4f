"""Launch a scenario with ``torchrun`` agents, as a multi-node job would start: one agent per "node".

Every agent runs ``torchrun --nnodes N --nproc-per-node P`` with a c10d rendezvous on 127.0.0.1 and a
free port, so N agents on this machine form one job of N*P ranks exactly as N machines would; the
ranks see the TorchElastic environment (``TORCHELASTIC_RUN_ID``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``)
that Lightning detects.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

from tests.distributed.launch import free_port, launcher_env, wait_all


def run_torchrun(
    script: str | Path, nnodes: int, nproc_per_node: int, *args: str, timeout: float = 240.0
) -> list[str]:
    """Start ``nnodes`` torchrun agents for ``script`` and wait for all; returns each agent's output."""
    port = free_port()
    env = launcher_env()
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
    return wait_all(agents, timeout, f"torchrun {Path(script).name} {nnodes}x{nproc_per_node}", "agent")
