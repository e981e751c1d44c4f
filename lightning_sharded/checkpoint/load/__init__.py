"""Loading a checkpoint into the live, already sharded model (and optimizers when fitting).

:func:`restore_checkpoint` reads either layout, from a local path or a URL, at any world size: a
sharded checkpoint through DCP (:mod:`.sharded`), a full file memory-mapped (:mod:`.full`). What is
at the path is decided once (:func:`~lightning_sharded.checkpoint.detect.detect`, on rank 0, shared),
the files are checked by every rank with the findings agreed
(:func:`~lightning_sharded.checkpoint.integrity.check_found`), so every rank takes the same branch or
raises the same error. No load ever writes to the checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from torch import nn
from torch.optim import Optimizer

from lightning_sharded.checkpoint import collective, names
from lightning_sharded.checkpoint.detect import CheckpointKind, Found, detect
from lightning_sharded.checkpoint.integrity import (
    AFTER_READ,
    UNCHANGED,
    ReadVerification,
    VerifyMode,
    check_found,
    verify_mode,
)
from lightning_sharded.checkpoint.load.checks import KeyReport
from lightning_sharded.checkpoint.load.full import restore_full
from lightning_sharded.checkpoint.load.sharded import restore_sharded
from lightning_sharded.checkpoint.manifest import FileEntry, FrozenPart
from lightning_sharded.checkpoint.presence import RanksLost
from lightning_sharded.checkpoint.state_dicts import CombinedView, plain_optimizer

__all__ = ["KeyReport", "Restored", "VerifyMode", "restore_checkpoint"]


class Restored(NamedTuple):
    """What :func:`restore_checkpoint` returns."""

    #: The rest of the Lightning checkpoint: loops, callbacks, epoch, step, hyperparameters...
    metadata: dict[str, Any]
    #: Model keys compared with the checkpoint's (non-empty only for a non-strict load).
    keys: KeyReport
    #: The checkpoint as the detector found it (on rank 0, shared): its kind, manifest, backend and where
    #: its files are. A later read of its files (each rank's own state) goes through ``found.backend``.
    #: Without ``verify``, the manifest of a rank other than 0 lists only that rank's own files (and the
    #: per-rank index's layout): a load does not send every rank every file's entry.
    found: Found
    #: A trainable-only checkpoint: the model keys it left out that the model has, and where they are.
    #: They were not loaded: the caller reads them from the source (``load_pretrained``'s machinery).
    frozen: FrozenPart | None = None


def restore_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    *,
    strict: bool = True,
    weights_only: bool | None = None,
    verify: bool | VerifyMode | None = False,
    read_metadata: bool = True,
) -> Restored:
    """Load a sharded directory or a full file into ``model`` (and ``optimizers``) where they live.

    Collective: every rank calls it, with the model already wrapped/sharded and the optimizers (if
    any) built over its parameters. The checkpoint may come from any world size.

    Args:
        path: a sharded checkpoint directory (written by this library or stock Lightning's
            ``FSDPStrategy`` / ``ModelParallelStrategy``) or a full checkpoint file; local or a URL.
        model: the model to load into (its ``state_dict`` keys are the checkpoint's ``state_dict`` keys).
        optimizers: the optimizers whose state to restore, in order; empty to load the model only.
        strict: if ``True``, the checkpoint must have exactly the model's keys; if ``False``, the keys both
            have are loaded and the others left alone (reported with a warning by the caller).
        weights_only: passed to ``torch.load`` for the Lightning metadata.
        verify: also compare every file's checksum with the manifest (presence and sizes are always
            checked, before the first read). Local files are checked from the load's own reads (one
            CRC-32 pass over the bytes in memory, no second read of every byte; :mod:`~.integrity`).
            ``True`` or ``"before"``: nothing of a damaged checkpoint is loaded: the model's values are
            read into CPU buffers beside it and copied in once every file matched (one more copy of
            the rank's model shard in host memory meanwhile); on object storage every file is
            checksummed before the first read. ``"during"``: read straight into the model; a damaged
            file is then found after its tensors reached the model, before the optimizers are set.
        read_metadata: read a sharded checkpoint's ``meta.pt`` (loops, callbacks...); ``False`` for a
            load of the model only (the returned metadata is then empty for a sharded checkpoint).

    Returns:
        The rest of the Lightning checkpoint, the comparison of keys, where it was found: :class:`Restored`.

    Raises:
        ValueError: ``verify`` is none of the values above.
        FileNotFoundError: nothing at ``path``.
        CheckpointError: not a checkpoint, keys (strict) or shapes that do not fit, a different number of
            optimizers, or a read that failed on some rank; the message names the key, file or rank.
            A :class:`~lightning_sharded.checkpoint.presence.RanksLost` when a rank died or did not
            reach a step of the load in time (the strategy's ``checkpoint_timeout``), naming it.
    """
    plain = [plain_optimizer(optimizer) for optimizer in optimizers]
    mode = verify_mode(verify)
    try:
        if mode is None:  # each rank gets its share of the manifest: its own files
            found = collective.decide_each(lambda n: _shares(detect(path), n), step="finding the checkpoint")
        else:  # checksums are checked by every rank, files split between them: every rank needs every entry
            found = collective.decide(lambda: detect(path), step="finding the checkpoint")
        if found.kind is CheckpointKind.SHARDED:
            metadata, report, frozen = restore_sharded(
                found,
                model,
                plain,
                strict=strict,
                weights_only=weights_only,
                verification=_verification(found, mode),
                keep_model=mode == "before",
                read_metadata=read_metadata,
            )
        else:
            metadata, report, frozen = restore_full(
                found, model, plain, strict=strict, weights_only=weights_only
            )
    except RanksLost as err:
        raise RanksLost(
            f"Loading the checkpoint {str(path)!r} failed: {err} Nothing on disk was changed; the model may"
            " hold part of the checkpoint.",
            err.ranks,
        ) from err
    _reattach(optimizers, plain)
    return Restored(metadata, report, found, frozen)


def _reattach(optimizers: Sequence[Optimizer], plain: Sequence[Optimizer]) -> None:
    """A wrapper's state and parameter groups made the loaded ones of the optimizer it wraps again
    (torch's ``load_state_dict`` replaces both objects; TorchRec's ``KeyedOptimizerWrapper`` shares them)."""
    for outer, inner in zip(optimizers, plain, strict=True):
        if isinstance(inner, CombinedView):
            inner.give_back()
        elif outer is not inner:
            outer.state = inner.state
            outer.param_groups = inner.param_groups


def _shares(found: Found, world_size: int) -> list[Found]:
    """``found`` as each rank of ``world_size`` needs it for a load without checksums: rank 0 with the
    whole manifest (it checks every file's size), another rank with the entries of its own files and of
    the per-rank index's layout (whether the checkpoint has one), not every rank's."""
    manifest = found.manifest
    if manifest is None or world_size == 1:
        return [found] * world_size
    own: dict[int, list[FileEntry]] = {}
    common = [e for e in manifest.files if e.path == names.INDEX_LAYOUT]
    for entry in manifest.files:
        if entry.rank != 0:
            own.setdefault(entry.rank, []).append(entry)
    return [found] + [
        dataclasses.replace(found, manifest=dataclasses.replace(manifest, files=common + own.get(rank, [])))
        for rank in range(1, world_size)
    ]


def _verification(found: Found, mode: VerifyMode | None) -> ReadVerification | None:
    """What checks the files before the first read: presence and sizes always, the checksums too with a
    verify ``mode``. Local files with a manifest are checked from the load's own reads (each byte read
    once; for "before" the model's values wait beside it until the checksums matched): the returned
    verification. Elsewhere (object storage), every file is checksummed before the first read."""
    if mode is not None and ReadVerification.applies(found):
        verification = ReadVerification(found, then=AFTER_READ if mode == "during" else UNCHANGED)
        verification.check_sizes()
        return verification
    check_found(found, verify=mode is not None)
    return None
