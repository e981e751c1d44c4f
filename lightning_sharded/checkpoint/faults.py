"""Fault-injection points of the commit and the load, for the crash and hang tests (standard library only).

Production code calls :func:`fault` at each :class:`FaultPoint`. It does nothing unless a test installed
:data:`hook` (``tests/fault_injection.py`` installs one that reads the test's environment variables).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

__all__ = ["FaultPoint", "fault", "hook"]


class FaultPoint(str, Enum):
    """Where a test may have a rank SIGKILL itself (or hang) during a commit or a load."""

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
    NO_EXCHANGE = "no_exchange"
    """A local publish asks whether to swap with ``renameat2(RENAME_EXCHANGE)``: a fault here makes it
    fall back to two renames, as on a filesystem without the exchange."""


#: Set by tests only: called with the point and the rank at every fault point; it may kill the process
#: there, or return ``True`` to have the caller act as if the point failed (:attr:`FaultPoint.NO_EXCHANGE`).
hook: Callable[[FaultPoint, int], bool] | None = None


def fault(point: FaultPoint, rank: int) -> bool:
    """Run the installed :data:`hook` at ``point`` on ``rank``; ``False`` (nothing) without one."""
    return hook is not None and hook(point, rank)
