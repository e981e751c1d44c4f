"""The tests' fault injection: a hook for :mod:`lightning_sharded.checkpoint.faults` driven by environment
variables, so subprocesses (scenario scripts, the CLI) are told where to fail by their environment.

:data:`FAULT_ENV` is ``<point>`` or ``<point>@<rank>`` (a :class:`FaultPoint` value): the matching rank
kills itself with SIGKILL when the save or load reaches that point; with ``:hang`` appended
(``after_write@1:hang``) it sleeps there first, for :data:`HANG_S` seconds. :data:`NO_EXCHANGE_ENV` set to
``"1"`` makes the local publish use two renames instead of ``renameat2(RENAME_EXCHANGE)``.

``tests/conftest.py`` installs it in the pytest process; a subprocess installs it with :func:`install`
(``python -m tests.fault_injection MODULE ARGS...`` runs a module's ``__main__`` with it installed).
"""

from __future__ import annotations

import logging
import os
import runpy
import signal
import sys
import time

from lightning_sharded.checkpoint import faults
from lightning_sharded.checkpoint.faults import FaultPoint

__all__ = ["FAULT_ENV", "HANG_S", "NO_EXCHANGE_ENV", "install"]

log = logging.getLogger(__name__)

#: Environment variable naming a fault-injection point, see the module's doc.
FAULT_ENV = "LIGHTNING_SHARDED_FAULT"
#: Environment variable that, set to ``"1"``, forces the local publish's two-rename fallback.
NO_EXCHANGE_ENV = "LIGHTNING_SHARDED_NO_RENAME_EXCHANGE"
#: Seconds a rank told to ``hang`` sleeps before it kills itself.
HANG_S = 60.0


def from_env(point: FaultPoint, rank: int) -> bool:
    """The hook: read the environment at each point (a forked process gets its own after import)."""
    if point is FaultPoint.NO_EXCHANGE:
        return os.environ.get(NO_EXCHANGE_ENV) == "1"
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return False
    where, _, action = spec.partition(":")
    name, _, who = where.partition("@")
    if name == point.value and (not who or int(who) == rank):
        if action == "hang":
            log.warning("fault injection: rank %d hangs at %s", rank, point.value)
            time.sleep(HANG_S)
        log.warning("fault injection: rank %d kills itself at %s", rank, point.value)
        os.kill(os.getpid(), signal.SIGKILL)
    return False


def install() -> None:
    """Make this process's saves and loads fail where its environment says."""
    faults.hook = from_env


if __name__ == "__main__":
    install()
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
