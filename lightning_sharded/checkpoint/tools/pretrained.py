"""``load_pretrained``: weights into a model that is already sharded, each rank reading only its slices
(``docs/huggingface.md``; the sources are :mod:`~lightning_sharded.checkpoint.tools.weight_sources`').

What the source holds is listed once, on rank 0, and shared; keys and shapes are then compared the same
way on every rank, so every rank loads, or raises the same error, before anything is read.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from torch import nn

from lightning_sharded.checkpoint import collective
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.load.checks import KeyReport, global_shape, set_model_state, summarize_keys
from lightning_sharded.checkpoint.manifest import FrozenPart
from lightning_sharded.checkpoint.state_dicts import has_fsdp1, model_state_dict
from lightning_sharded.checkpoint.tools.frozen import frozen_listing
from lightning_sharded.checkpoint.tools.weight_sources import Listing, list_source, read_weights

__all__ = ["PretrainedKeys", "load_frozen", "load_pretrained"]


class PretrainedKeys(NamedTuple):
    """What :func:`load_pretrained` did not load.

    Attributes:
        missing_keys: Keys of the module (with ``prefix``) that the source does not have.
        unexpected_keys: Keys of the source that the module does not have.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_pretrained(
    module: nn.Module,
    path: str | os.PathLike[str],
    *,
    prefix: str = "",
    strict: bool = True,
    weights_only: bool | None = True,
) -> PretrainedKeys:
    """Load weights into ``module``, already sharded, each rank reading only the slices it holds.

    Collective: call it on every rank, with the same arguments, after the model is sharded: at the end
    of ``configure_model`` (FSDP2 and tensor parallelism, after ``fully_shard`` / ``parallelize_module``)
    or in ``on_fit_start`` (FSDP1, once Lightning has wrapped the model: pass the LightningModule, its
    wrapped root is found). Without a process group it loads a plain module in this process.

    Args:
        module: The model, or a LightningModule; its parameters may be ``DTensor`` (FSDP2, tensor
            parallel), FSDP1-flattened or plain; sharded attributes count as their keys.
        path: A Hugging Face weights directory (``model.safetensors`` or an index and its files), one
            ``.safetensors`` file, a full torch / Lightning checkpoint file (its ``state_dict``, or a
            dict of tensors) or a sharded checkpoint directory (its model part); local, or (full and
            sharded checkpoints) an fsspec URL.
        prefix: The part of the module's keys that the source's keys lack: the module key
            ``prefix + key`` is loaded from the source's ``key``, and module keys without it are left
            alone (``"llm."`` loads a Hugging Face model into a LightningModule that holds it as
            ``self.llm``; the same ``prefix`` that ``consolidate_checkpoint`` strips).
        strict: Raise when a key of the module (with ``prefix``) is not in the source, or a source key
            is not in the module; ``False`` loads the keys both have and returns the others. A shape
            that differs is an error either way.
        weights_only: ``True`` (or ``None``): a full file and a sharded checkpoint's index are
            unpickled safely (tensors and plain data only); ``False`` unpickles anything, running the
            file's code.

    Returns:
        The missing and unexpected keys (empty lists after a strict load).

    Raises:
        FileNotFoundError: nothing at ``path``, or a file an index names is not there.
        CheckpointError: ``path`` holds no weights, keys differ under ``strict``, a shape differs, or a
            file is damaged; the same error on every rank, before anything of the module changed.
    """
    listing = collective.decide(lambda: list_source(path, weights_only))
    root = _root(module)
    state = model_state_dict(root, full=False)
    targets = {
        key[len(prefix) :]: value
        for key, value in state.items()
        if key.startswith(prefix) and global_shape(value) is not None  # a plain or a sharded tensor
    }
    report = KeyReport(list(targets), list(listing.shapes))
    tied = _tied_keys(root, prefix, set(report.common))
    missing = [prefix + key for key in report.missing if prefix + key not in tied]
    unexpected = report.unexpected
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"Missing key(s) in the weights: {summarize_keys(missing)}.")
        if unexpected:
            parts.append(f"Unexpected key(s) in the weights: {summarize_keys(unexpected)}.")
        hint = f" (with prefix={prefix!r})" if prefix else ""
        raise CheckpointError(
            f"Error(s) in loading the pretrained weights {listing.shown!r} into {type(module).__name__}"
            f"{hint} (strict): {' '.join(parts)} Pass the prefix under which the module holds the model"
            " (prefix='llm.' for self.llm), or strict=False to load only the keys both have."
        )
    _load(root, listing, {key: targets[key] for key in report.common}, prefix, module, weights_only)
    return PretrainedKeys(missing, unexpected)


def load_frozen(
    module: nn.Module, frozen: FrozenPart, *, checkpoint: str, weights_only: bool | None = True
) -> None:
    """Load the frozen part of the trainable-only ``checkpoint`` (``frozen.keys``) from ``frozen.source``.

    Collective, like :func:`load_pretrained`: the module key ``frozen.prefix + key`` is read from the
    source's ``key``, which must be there with the module's shape (else the same error on every rank,
    before anything of the module changed).
    """
    if not frozen.keys:
        return
    fix = "name where they are now with `frozen_source=` (and `frozen_prefix=`) on the strategy"
    listing = collective.decide(lambda: frozen_listing(frozen, checkpoint, weights_only, fix))
    root = _root(module)
    state = model_state_dict(root, full=False)
    targets = {key[len(frozen.prefix) :]: state[key] for key in frozen.keys}
    _load(root, listing, targets, frozen.prefix, module, weights_only)


def _load(
    root: nn.Module,
    listing: Listing,
    targets: dict[str, Any],
    prefix: str,
    module: nn.Module,
    weights_only: bool | None,
) -> None:
    """Read ``targets`` (source key to the module's tensor) into ``root``; first a ``CheckpointError``
    listing every key whose global shape the source does not have."""
    bad = [
        f"size mismatch for {prefix + key}: the weights have shape {list(listing.shapes[key])}, the module"
        f" {list(shape)}"
        for key in sorted(targets)
        if (shape := global_shape(targets[key])) is not None and tuple(shape) != tuple(listing.shapes[key])
    ]
    if bad:
        raise CheckpointError(
            f"The pretrained weights {listing.shown!r} do not fit {type(module).__name__}: {'; '.join(bad)}."
            " Build the model from the configuration the weights were saved with."
        )
    if targets:
        read_weights(listing, targets, weights_only)
        set_model_state(root, {prefix + key: value for key, value in targets.items()})


def _root(module: nn.Module) -> nn.Module:
    """The module to take the state dict of: a LightningModule that FSDP1 wrapped is its wrapper's."""
    trainer = module.__dict__.get("_trainer")
    wrapped = getattr(getattr(trainer, "strategy", None), "model", None)
    if (
        isinstance(wrapped, nn.Module)
        and wrapped is not module
        and has_fsdp1(wrapped)
        and any(m is module for m in wrapped.modules())
    ):
        return wrapped
    return module


def _tied_keys(root: nn.Module, prefix: str, loaded: set[str]) -> set[str]:
    """Module keys (with ``prefix``) of parameters tied to one that is loaded (the same ``Parameter``
    under two names, such as an output layer tied to the embedding): not missing."""
    by_param: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(name)
    tied: set[str] = set()
    for group in by_param.values():
        if len(group) > 1 and any(n.startswith(prefix) and n[len(prefix) :] in loaded for n in group):
            tied.update(group)
    return tied
