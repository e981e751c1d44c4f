"""Errors raised for invalid or corrupt checkpoints, and DCP's errors turned into them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["CheckpointError", "run_dcp"]


class CheckpointError(ValueError):
    """A checkpoint is invalid, incomplete or corrupt, or does not fit the model it is loaded into.

    The message names what was wrong (the key, the file or the rank) and what to do about it.
    """


def run_dcp(call: Callable[[], Any], what: str) -> Any:
    """Run a DCP call; its ``CheckpointException`` (a ``BaseException``) becomes a ``CheckpointError``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return call()
    except CheckpointException as ex:
        failures = getattr(ex, "failures", {}) or {}
        detail = "; ".join(
            # DCP wraps each failure as (exception, stack summary)
            f"rank {rank}: {failure[0] if isinstance(failure, tuple) else failure!r}"
            for rank, failure in sorted(failures.items())
        )
        raise CheckpointError(
            f"{what} failed on rank(s) {sorted(failures)}: {detail or ex!r}. Check that the directory is"
            " complete and readable (every *.distcp file its .metadata names) and that there is disk space."
        ) from None
