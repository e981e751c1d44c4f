"""Loading a full checkpoint file into a live, already sharded model (and optimizers), at any world size.

The file is memory-mapped and read one tensor at a time, each cut into this rank's shard. Every page a
rank reads of it would stay in its resident memory until the mapping goes away at the end of the load:
on a 2-rank resume one more shard per rank (measured: peak 2x the shard). So once a tensor is copied,
:meth:`FileMapping.release` tells the kernel this process no longer needs its pages
(``madvise(MADV_DONTNEED)``); they stay in the page cache, and a later read maps them again.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_sharded.checkpoint import collective, libc
from lightning_sharded.checkpoint.detect import Found
from lightning_sharded.checkpoint.errors import CheckpointError, MissingCheckpointError, OptimizerCountError
from lightning_sharded.checkpoint.failures import read_failed
from lightning_sharded.checkpoint.lightning_meta import refused
from lightning_sharded.checkpoint.load.checks import (
    KeyReport,
    Stored,
    check_optimizer_count,
    check_shapes,
    copy_full_into,
    fit_model,
    frozen_of,
    named_optimizer_params,
    set_model_state,
    summarize_keys,
)
from lightning_sharded.checkpoint.load.sharded import make_template
from lightning_sharded.checkpoint.manifest import FrozenPart
from lightning_sharded.checkpoint.names import FROZEN_KEY, OPTIMIZER_STATES, STATE_DICT
from lightning_sharded.checkpoint.state_dicts import (
    PARAM_GROUPS,
    PARAMS,
    STATE,
    model_state_dict,
    param_names,
)

__all__ = ["restore_full"]


class FileMapping:
    """This process's memory mappings of one file, read from ``/proc/self/maps`` (Linux; else none).

    Build it after the file was memory-mapped (``torch.load(path, mmap=True)``).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.ranges: list[tuple[int, int]] = []
        if not sys.platform.startswith("linux"):
            return
        target = os.path.realpath(path)
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].rstrip("\n") == target:
                        start, end = (int(x, 16) for x in fields[0].split("-"))
                        self.ranges.append((start, end))
        except OSError:
            self.ranges = []

    def release(self, tensor: Any) -> None:
        """Drop this process's mapping of the whole pages under ``tensor`` if they are in this file's mapping
        (only there: on anonymous memory ``MADV_DONTNEED`` would discard data); else a no-op."""
        if not self.ranges or type(tensor) is not torch.Tensor or tensor.device.type != "cpu":
            return
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(lo <= start and end <= hi for lo, hi in self.ranges):
            return
        libc.madvise(start, end - start, libc.MADV_DONTNEED)


def _open_full(path: Path, weights_only: bool | None) -> dict[str, Any]:
    try:
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as ex:
        if "Weights only load failed" not in str(ex):  # damage, not a refusal: said below
            raise _unreadable(path, ex) from ex
        raise refused(f"The checkpoint file {str(path)!r}", ex, weights_only) from None
    except Exception as ex:
        storage = read_failed(ex, f"the checkpoint file {str(path)!r}")
        if storage is not None:
            raise storage from ex
        raise _unreadable(path, ex) from ex
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(STATE_DICT), dict):
        keys = sorted(map(str, checkpoint)) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(
            f"The checkpoint file {str(path)!r} is not a Lightning checkpoint: it has no {STATE_DICT!r}"
            f" dict (found {keys}). Pass a file written by `Trainer.save_checkpoint`."
        )
    return checkpoint


def _unreadable(path: Path, ex: BaseException) -> CheckpointError:
    return CheckpointError(
        f"Could not read the checkpoint file {str(path)!r}: {ex!r}. The file is not a checkpoint written"
        " by torch.save, or it is truncated or corrupt; resume from another checkpoint."
    )


def restore_full(
    found: Found,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    strict: bool,
    weights_only: bool | None,
) -> tuple[dict[str, Any], KeyReport, FrozenPart | None]:
    """Load the full checkpoint file ``found`` into ``model`` and ``optimizers``; collective. A URL is
    downloaded first (by each rank); the errors name it, not the download.

    Returns the rest of the checkpoint (without model and optimizer states), the comparison of keys,
    and for a trainable-only file its frozen part, limited to the keys the model has (not read here).
    """
    with found.backend.local_file(found.data) as local:
        try:
            return _restore_local(local, model, optimizers, strict=strict, weights_only=weights_only)
        except CheckpointError as err:
            if local == found.data:
                raise
            same = type(err) in (OptimizerCountError, MissingCheckpointError)
            kind = type(err) if same else CheckpointError
            raise kind(str(err).replace(str(local), str(found.data))) from err  # stock's type kept


def _restore_local(
    path: Path, model: nn.Module, optimizers: Sequence[Optimizer], *, strict: bool, weights_only: bool | None
) -> tuple[dict[str, Any], KeyReport, FrozenPart | None]:
    """:func:`restore_full` of the local file ``path``: memory-mapped, read one tensor at a time."""
    # Every rank reads the file (memory-mapped); whether it could is agreed, so none enters a
    # collective alone.
    checkpoint = collective.agree(lambda: _open_full(path, weights_only))
    # Each tensor's pages are given back once copied: the peak stays one shard plus one tensor.
    mapping = FileMapping(path)
    source: dict[str, Any] = checkpoint.pop(STATE_DICT)
    optimizer_states = checkpoint.pop(OPTIMIZER_STATES, None)
    frozen = frozen_of(checkpoint, path)
    checkpoint.pop(FROZEN_KEY, None)
    if optimizers:
        check_optimizer_count(path, len(optimizers), len(optimizer_states or []))
    target = model_state_dict(model, full=False)
    stored = {key: tuple(v.shape) if isinstance(v, torch.Tensor) else None for key, v in source.items()}
    report, to_load, frozen = fit_model(path, stored, target, frozen, strict=strict)
    for key in to_load:  # sorted: the same order on every rank
        to_load[key] = copy_full_into(to_load[key], source[key])
        mapping.release(source[key])
    set_model_state(model, to_load)
    del to_load, source

    # A load of the model only (`optimizers` empty: evaluation, a warm start) reads no optimizer state.
    states = optimizer_states or [] if optimizers else []
    for index, (optimizer, optim_state) in enumerate(zip(optimizers, states, strict=True)):
        _restore_full_optimizer(
            path, model, optimizer, optim_state, index, strict=strict, mapping=mapping, model_state=target
        )
    return checkpoint, report, frozen


def _restore_full_optimizer(
    path: Path,
    model: nn.Module,
    optimizer: Optimizer,
    source: dict[str, Any],
    index: int,
    *,
    strict: bool,
    mapping: FileMapping,
    model_state: dict[str, Any],
) -> None:
    where = f"optimizer_states[{index}] of {str(path)!r}"
    source_groups = source.get(PARAM_GROUPS, [])
    if len(source_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"The optimizer state {where} has {len(source_groups)} parameter group(s), the optimizer"
            f" configured now has {len(optimizer.param_groups)}. Resume with the same parameter groups."
        )
    try:
        named = named_optimizer_params(model, optimizer)
    except KeyError:  # FSDP1 without use_orig_params: the optimizer holds flat parameters
        named = []
    source_state = _name_keyed(where, source, [name for name, _ in named]) if named else {}
    stored: Stored = {
        name: {
            entry: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (None, None)
            for entry, v in entries.items()
        }
        for name, entries in source_state.items()
    }
    # A parameter that is this rank's piece of a sharded model value (TorchRec's tables): its full state
    # is cut into the piece through a sharded value of that layout.
    template, from_index, load = make_template(model, optimizer, stored, model_state, "", where)
    state: dict[str, dict[str, Any]] = template[STATE]
    missing: list[str] = []
    if not from_index:  # torch's template, keyed by the names of the flat parameters
        source_state = _name_keyed(where, source, param_names(template))
        missing = [f"{n}.{e}" for n in sorted(state) for e in state[n] if e not in source_state.get(n, {})]
    elif source_state:  # `named` then holds every parameter
        missing = [n for n, p in named if p.requires_grad and n not in state]
    if missing and strict:
        raise CheckpointError(
            f"The optimizer state {where} does not fit the optimizer (strict loading). Missing key(s) in"
            f" the checkpoint: {summarize_keys(missing)}. Resume with the same model and optimizer, or set"
            " `strict_loading = False` on the LightningModule."
        )
    for name in sorted(state):  # sorted: the same order on every rank
        entries = state[name]
        for entry in sorted(entries):
            if entry not in source_state.get(name, {}):
                entries.pop(entry)  # not strict: this parameter starts with fresh state
                continue
            value = source_state[name][entry]
            if isinstance(value, torch.Tensor):
                label = f"{name}.{entry}"
                check_shapes(path, {label: entries[entry]}, {label: tuple(value.shape)})
                entries[entry] = copy_full_into(entries[entry], value)
                mapping.release(value)  # its memory-mapped pages are not needed again
            else:
                entries[entry] = value
        if not entries:
            state.pop(name)
    template[PARAM_GROUPS] = [
        {**source_group, PARAMS: group[PARAMS]}
        for group, source_group in zip(template[PARAM_GROUPS], source_groups, strict=True)
    ]
    load()


def _name_keyed(where: str, source: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A full file's optimizer state keyed by parameter name (stock files key it by index)."""
    source_state: dict[Any, Any] = source.get(STATE, {})
    if not any(isinstance(k, int) for k in source_state):
        return source_state
    source_names = [p for group in source.get(PARAM_GROUPS, []) for p in group[PARAMS]]
    if all(isinstance(p, int) for p in source_names) and len(source_names) != len(names):
        raise CheckpointError(
            f"The optimizer state {where} covers {len(source_names)} parameters, the optimizer has"
            f" {len(names)}. Resume with the same model and optimizer."
        )
    by_position = dict(zip(source_names, names, strict=False))
    return {by_position.get(k, k): v for k, v in source_state.items()}
