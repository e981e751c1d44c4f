"""Starting rank processes on this machine as torchrun would: a free port and each rank's environment.

Used by the demo (and by the tests' launcher): with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set, ``init_process_group("gloo")`` works and Lightning uses this
environment instead of relaunching ``sys.argv``.
"""

from __future__ import annotations

import os
import socket
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
