"""Errors raised for invalid or corrupt checkpoints."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is invalid, incomplete or corrupt, or does not fit the model it is loaded into.

    The message names what was wrong (the key, the file or the rank) and what to do about it.
    """
