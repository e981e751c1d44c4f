"""Trainable-only checkpoints, offline: what one leaves out, reading it back, and ``load_checkpoint``.

A trainable-only checkpoint (``save_trainable_only=True``) names where its frozen parameters come from
(:class:`~lightning_sharded.checkpoint.manifest.FrozenPart`); the offline tools read them from there.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lightning_sharded.checkpoint import names
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.load.checks import frozen_of
from lightning_sharded.checkpoint.manifest import FrozenPart
from lightning_sharded.checkpoint.tools.reader import read_checkpoint
from lightning_sharded.checkpoint.tools.weight_sources import Listing, list_source, read_weights

__all__ = ["frozen_listing", "load_checkpoint", "read_frozen"]


#: What an offline tool tells to do about a frozen source it cannot read.
OFFLINE_FIX = "pass `merge_frozen=False` to read the trainable weights alone"
#: Where a tool's output keys a frozen parameter (read from the source), apart from the DCP keys.
FROZEN_SLOT = "frozen:"


def frozen_listing(
    frozen: FrozenPart, path: str, weights_only: bool | None, fix: str = OFFLINE_FIX
) -> Listing:
    """What the frozen source of the checkpoint at ``path`` holds, checked to have every frozen key (less
    the prefix); ``fix``: what the messages tell to do besides restoring the source."""
    try:
        listing = list_source(frozen.source, weights_only)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"The checkpoint {path!r} holds only the trainable weights; its frozen weights are to be read"
            f" from {frozen.source!r}, which does not exist ({err}). Put them back there, or {fix}."
        ) from None
    missing = sorted(key for key in frozen.keys if key[len(frozen.prefix) :] not in listing.shapes)
    if missing:
        shown = ", ".join(f'"{key}"' for key in missing[:10]) + (", ..." if len(missing) > 10 else "")
        hint = f" (with prefix {frozen.prefix!r})" if frozen.prefix else ""
        raise CheckpointError(
            f"The checkpoint {path!r} holds only the trainable weights, and its frozen source"
            f" {listing.shown!r}{hint} lacks {len(missing)} of the frozen ones: {shown}. Restore the source"
            f" it names, or {fix}."
        )
    return listing


def read_frozen(
    frozen: FrozenPart, listing: Listing, targets: dict[str, torch.Tensor], weights_only: bool | None
) -> None:
    """Fill ``targets`` (model key -> a tensor of the source's shape) from the frozen source, in place."""
    read_weights(listing, {key[len(frozen.prefix) :]: value for key, value in targets.items()}, weights_only)


def load_checkpoint(
    path: str | os.PathLike[str],
    map_location: str | torch.device | None = "cpu",
    *,
    verify: bool = False,
    weights_only: bool | None = True,
    optimizer_states: bool = True,
    merge_frozen: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint in this process, without any process group, as a full Lightning checkpoint dict.

    A sharded directory (this library's, stock ``FSDPStrategy``'s or ``ModelParallelStrategy``'s) is
    read whole into memory and returned as :func:`torch.load` returns a full checkpoint: full tensors
    in ``state_dict``, ``optimizer_states`` in torch's index form, and the rest from ``meta.pt``. A full
    file is read with :func:`torch.load`. A trainable-only checkpoint (``save_trainable_only``) gets its
    frozen parameters from the source it names, so the dict is complete. Nothing on disk changes.

    Args:
        path: A sharded checkpoint directory or a full checkpoint file.
        map_location: Where to put the tensors (a device or device string).
        verify: Also compare every file's checksum with the manifest; computed from the bytes as they
            are read (each read once), so nothing is returned from a damaged checkpoint.
        weights_only: ``True`` (or ``None``, torch's default): every pickle of the checkpoint is read
            as ``torch.load(weights_only=True)`` reads, with what Lightning writes allowed
            (:data:`~lightning_sharded.checkpoint.unpickling.LIGHTNING_SAFE_GLOBALS`), so no code from
            the file runs. ``False`` unpickles anything, running the file's code: only for files you
            trust.
        optimizer_states: ``False`` skips the optimizer states of a sharded directory (nothing of them is
            read; the dict has no ``optimizer_states``): the model state and ``meta.pt`` only, as inference
            needs.
        merge_frozen: read a trainable-only checkpoint's frozen parameters from its source into
            ``state_dict`` (in the source's dtype); ``False`` returns what the checkpoint holds, with
            :data:`~lightning_sharded.checkpoint.names.FROZEN_KEY` saying what it left out and where that is.

    Returns:
        The checkpoint dict.

    Raises:
        FileNotFoundError: nothing at ``path``, or at the frozen source of a trainable-only checkpoint.
        CheckpointError: not a checkpoint, or a file missing, truncated or (with ``verify``) corrupted;
            the message names the file and the rank that wrote it. Also, with ``weights_only``, a
            checkpoint that holds a type that is not allowed; the message names it; or a frozen source
            that lacks a frozen parameter.
    """
    checkpoint = read_checkpoint(
        path, map_location, verify=verify, weights_only=weights_only, optimizer_states=optimizer_states
    )
    frozen = frozen_of(checkpoint, str(path))
    if frozen is None or not merge_frozen:
        return checkpoint
    listing = frozen_listing(frozen, str(path), weights_only)
    prefix = frozen.prefix
    targets = {
        key: torch.empty(listing.shapes[key[len(prefix) :]], dtype=listing.dtypes[key[len(prefix) :]])
        for key in frozen.keys
    }
    read_frozen(frozen, listing, targets, weights_only)
    if map_location is not None:
        targets = {key: value.to(map_location) for key, value in targets.items()}
    checkpoint[names.STATE_DICT].update(targets)
    del checkpoint[names.FROZEN_KEY]
    return checkpoint
