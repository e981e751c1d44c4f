"""Letting the collectives' worker threads finish before the interpreter shuts down.

A gloo process group runs each collective in a C++ worker thread, which drops its reference to the
collective's tensors only after the caller has been woken. When the caller goes straight on to the end
of the program (``assert torch.equal(table.full_tensor(), expected)`` as the last line), the worker
can be dropping them while Python finalizes: dropping a tensor that has a Python object takes the
interpreter lock, which a thread that is not the main one may not take then, and the process aborts
with ``terminate called without an active exception`` after everything succeeded (torch 2.13:
``PyInterpreter`` ``decref`` from ``ProcessGroupGloo::runLoop``; pytorch/pytorch#190489). It happened
in 2 of 30 runs of a 2-process script that ends with a ``full_tensor()``, and in 2 of 12 runs of the
quickstart. ``destroy_process_group()`` does not prevent it (2 of 60): a device mesh still holds the
group, and a group's shutdown does not wait for its workers.

:func:`drain_at_exit` registers, once per process, an ``atexit`` handler (``atexit`` runs before
finalization starts) that releases the interpreter lock until no other thread of the process is
running or waiting for a core, for at most :data:`LIMIT` seconds: with it, 0 of 100 runs aborted.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import time

__all__ = ["LIMIT", "drain_at_exit", "running_threads"]

#: The longest the handler waits (seconds): a thread that keeps computing does not hold the exit up.
LIMIT = 1.0
_POLL = 0.005
_TASKS = "/proc/self/task"


def running_threads() -> int | None:
    """How many threads of this process, other than the caller, are running or waiting for a core.

    Read from ``/proc/self/task/<tid>/stat`` (state ``R``); ``None`` where there is no ``/proc``.
    """
    try:
        tasks = os.listdir(_TASKS)
    except OSError:
        return None
    me = str(threading.get_native_id())
    running = 0
    for tid in tasks:
        if tid == me:
            continue
        try:
            with open(f"{_TASKS}/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
        if fields and fields[0] == "R":
            running += 1
    return running


def _drain(limit: float = LIMIT) -> None:
    """Sleep (the lock released) until no other thread runs, at most ``limit`` seconds."""
    deadline = time.monotonic() + limit
    time.sleep(_POLL)
    while time.monotonic() < deadline:
        if not running_threads():  # none runs, or no way to tell (then the one pause above is all)
            return
        time.sleep(_POLL)


@functools.cache
def drain_at_exit() -> None:
    """Register the exit handler described in the module doc (once per process; later calls do nothing)."""
    atexit.register(_drain)
