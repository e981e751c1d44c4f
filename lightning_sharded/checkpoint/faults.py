"""Fault injection for the crash and hang tests of saves and loads (standard library only).

Set :data:`FAULT_ENV` to ``<point>`` or ``<point>@<rank>`` (a :class:`FaultPoint` value) and the
matching rank kills itself with SIGKILL when the save or load reaches that point; with ``:hang``
appended (``after_write@1:hang``) it sleeps there instead, for :data:`HANG_S` seconds, then kills
itself (a rank that hangs, then dies). Nothing happens when the variable is unset, which is always
the case outside the tests.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from enum import Enum

__all__ = ["FAULT_ENV", "HANG_S", "FaultPoint", "fault"]

log = logging.getLogger(__name__)

#: Environment variable naming a fault-injection point (tests only), see :class:`FaultPoint`.
FAULT_ENV = "LIGHTNING_SHARDED_FAULT"
#: Seconds a rank told to ``hang`` sleeps before it kills itself.
HANG_S = 60.0


class FaultPoint(str, Enum):
    """Where a rank may be told to SIGKILL itself (or hang) during a commit or a load (tests only, via
    :data:`FAULT_ENV`)."""

    AFTER_WRITE = "after_write"
    """``write(staging)`` returned on this rank; nothing checksummed yet."""
    BEFORE_MANIFEST = "before_manifest"
    """Every rank's files are checksummed and fsynced; rank 0 has not written the manifest."""
    BEFORE_PUBLISH = "before_publish"
    """The staged version is complete with its manifest (local) or about to be (object storage)."""
    BETWEEN_RENAMES = "between_renames"
    """Local fallback publish only: the target is renamed to ``old``; the staged one not yet in place."""
    AFTER_PUBLISH = "after_publish"
    """The new version is in place; the previous one is not yet removed."""
    DURING_REMOVE = "during_remove"
    """The previous version is renamed to ``trash`` (local) and partly deleted."""
    BEFORE_READ = "before_read"
    """A sharded load: the index and ``meta.pt`` are read and shared; DCP has not read the shards."""


def fault(point: FaultPoint, rank: int) -> None:
    """SIGKILL this process (or hang, then SIGKILL it) if :data:`FAULT_ENV` names ``point`` (for every
    rank, or for ``rank``)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    where, _, action = spec.partition(":")
    name, _, who = where.partition("@")
    if name == point.value and (not who or int(who) == rank):
        if action == "hang":
            log.warning("fault injection: rank %d hangs at %s", rank, point.value)
            time.sleep(HANG_S)
        log.warning("fault injection: rank %d kills itself at %s", rank, point.value)
        os.kill(os.getpid(), signal.SIGKILL)
