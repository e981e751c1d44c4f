"""Saving and loading Lightning checkpoints of sharded models, shared by both strategies.

Everything here works the same for FSDP1 (``FullyShardedDataParallel``; parameters come out of
``get_model_state_dict`` as ``ShardedTensor``), FSDP2 (``fully_shard``; ``DTensor``) and plain modules,
because it goes through torch's ``get_*_state_dict`` / ``set_*_state_dict`` helpers and moves single
tensors with the adapters of :mod:`lightning_sharded.tensors`. Sharded attributes (``DTensor`` or
``ShardedTensor`` held outside parameters) are part of ``model.state_dict()`` through the hooks of
:mod:`lightning_sharded.hooks`, so they travel with the model.

On disk:

- :func:`write_sharded_checkpoint` is the one function that writes a sharded directory (DCP shards, the
  DCP ``.metadata`` index, ``meta.pt`` and the manifest, committed atomically);
- :func:`write_full_checkpoint` is the one function that writes a full file (``torch.save`` on rank 0).

Loading (:func:`restore_checkpoint`) reads either layout into the live, already sharded model (and
optimizers when fitting), at any world size: a sharded directory through DCP (each rank reads only the
pieces of its shards), a full file memory-mapped, one tensor at a time cut into this rank's shard. Keys
and shapes are checked against the checkpoint's index before anything is loaded, so a strict load that
does not fit fails without touching the model, and no load ever writes to the checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_sharded._fqn import parameter_names
from lightning_sharded.checkpoint import storage
from lightning_sharded.checkpoint._pages import FileMapping
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.format import (
    META_FILENAME,
    OPTIMIZER_STATES,
    STATE_DICT,
    CheckpointFormat,
    ShardedLayout,
    detect_format,
    optimizer_key,
    read_sharded_layout,
    summarize_keys,
)
from lightning_sharded.checkpoint.storage import Location
from lightning_sharded.tensors import adapter_for

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "KeyReport",
    "Restored",
    "model_state_dict",
    "optimizer_state_dict",
    "remove_checkpoint",
    "restore_checkpoint",
    "save_checkpoint",
    "split_sharded_checkpoint",
    "write_full_checkpoint",
    "write_sharded_checkpoint",
]

#: DCP writer threads per rank (one shard file each). With 2 ranks on 2 cores, a second thread (plus
#: its hashing thread) only adds contention: 2 GB saves took 1.58 s with 2 threads, 1.13 s with 1
#: (stock ModelParallel in the same runs: 1.01 s and 1.26 s).
WRITER_THREADS = 1

_STATE = "state"
_PARAM_GROUPS = "param_groups"
_PARAMS = "params"


# --------------------------------------------------------------------------------------------- gather


def model_state_dict(model: nn.Module, *, full: bool) -> dict[str, Any]:
    """The model's state, sharded (each rank its shards, no copy) or full (gathered on rank 0, on CPU).

    Sharded attributes are included under their parameter-like keys. With ``full=True`` only rank 0 gets
    a non-empty dict when the model is on a GPU (on CPU, every rank gets it: nothing to offload).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(model, full))


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer, *, full: bool) -> dict[str, Any]:
    """An optimizer's state keyed by parameter name, sharded like the parameters; or full.

    With ``full=True`` the state is gathered (on rank 0 only for a GPU model) and keyed by parameter
    index, the form ``torch.optim.Optimizer.state_dict()`` and stock Lightning use, so a plain
    single-device Trainer can resume from it.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_options(model, full))
    if full and state:
        state = _key_by_index(state)
    return state


def _options(model: nn.Module, full: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # `cpu_offload` also makes a full state dict rank-0 only. On a CPU model there is nothing to offload,
    # and FSDP1 crashes (SIGSEGV, torch 2.13) offloading CPU parameters: every rank then gets the full dict.
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    return StateDictOptions(full_state_dict=full, cpu_offload=full and not on_cpu)


def _key_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """Name-keyed optimizer state to the index-keyed form of ``Optimizer.state_dict()``."""
    order = {name: index for index, name in enumerate(_param_names(state))}
    groups = [{**group, _PARAMS: [order[name] for name in group[_PARAMS]]} for group in state[_PARAM_GROUPS]]
    return {_STATE: {order[name]: value for name, value in state[_STATE].items()}, _PARAM_GROUPS: groups}


def _param_names(state: dict[str, Any]) -> list[str]:
    return [name for group in state[_PARAM_GROUPS] for name in group[_PARAMS]]


# ---------------------------------------------------------------------------------------------- write


def write_sharded_checkpoint(
    path: Location,
    state: dict[str, Any],
    metadata: dict[str, Any],
    *,
    rank: int,
    group: ProcessGroup | None = None,
) -> None:
    """Write a sharded checkpoint directory at ``path`` atomically: DCP shards and index, ``meta.pt``.

    Collective over ``group`` (the default group when ``None``): every rank calls it with its own shards
    in ``state`` (top-level keys such as ``"model"`` and ``"optimizer_0"``). ``metadata`` (the rest of
    the Lightning checkpoint) is written by rank 0. Everything goes to a staging directory next to
    ``path``, checksummed while it is written (:class:`~.writer.ChecksummingWriter`), then published
    with the manifest by :func:`~lightning_sharded.checkpoint.atomic.commit_directory`:
    a previous checkpoint (directory or file) at ``path`` stays whole until the new one is complete.

    Raises:
        IsADirectoryError: ``path`` is a non-empty directory that is not a checkpoint (it would be
            replaced as a whole).
        CheckpointError: DCP failed on some rank, or the commit did; the message names the ranks and
            their errors.
    """
    from torch.distributed.checkpoint.state_dict_saver import save

    if isinstance(path, str):  # an fsspec URL: versions and a manifest published last
        from lightning_sharded.checkpoint import object_store

        object_store.write_sharded_checkpoint(
            path,
            state,
            metadata,
            rank=rank,
            manifest_metadata=_manifest_metadata(metadata),
            run_dcp=_run_dcp,
            group=group,
        )
        return
    from lightning_sharded.checkpoint.atomic import commit_directory
    from lightning_sharded.checkpoint.writer import ChecksummingWriter, without_torch_crc32

    _refuse_foreign_directory(path)

    def write(staging: Path) -> dict[str, tuple[int, str]]:
        writer = ChecksummingWriter(staging, thread_count=WRITER_THREADS)
        with without_torch_crc32():
            _run_dcp(
                lambda: save(state, storage_writer=writer, process_group=group),
                f"Saving the sharded checkpoint to {str(path)!r}",
            )
        if rank == 0:
            torch.save(metadata, staging / META_FILENAME)
        return writer.checksums

    commit_directory(path, write, metadata=_manifest_metadata(metadata), group=group)


def split_sharded_checkpoint(
    checkpoint: dict[str, Any], model_key: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Lightning checkpoint dict as ``(state for DCP, the rest)``; consumes ``checkpoint``.

    The state holds the model under ``model_key`` and each optimizer state under ``optimizer_<i>``; the
    rest (loops, callbacks, epoch, step...) goes to ``meta.pt``.
    """
    state = {model_key: checkpoint.pop(STATE_DICT)}
    for index, optim_state in enumerate(checkpoint.pop(OPTIMIZER_STATES, [])):
        state[optimizer_key(index)] = optim_state
    return state, checkpoint


def write_full_checkpoint(path: Location, checkpoint: dict[str, Any], *, rank: int) -> None:
    """Write a full checkpoint file at ``path`` atomically with ``torch.save`` (rank 0; others return).

    The file is written next to ``path`` and published by rename
    (:func:`~lightning_sharded.checkpoint.atomic.commit_file`); a sharded checkpoint directory at
    ``path`` is replaced by it.

    Raises:
        IsADirectoryError: ``path`` is a non-empty directory that is not a checkpoint.
    """
    if rank != 0:
        return
    if isinstance(path, str):  # an fsspec URL: written locally, then one upload
        from lightning_sharded.checkpoint import object_store

        object_store.write_full_checkpoint(path, lambda local: torch.save(checkpoint, local))
        return
    from lightning_sharded.checkpoint.atomic import commit_file

    _refuse_foreign_directory(path)
    commit_file(path, lambda staged: torch.save(checkpoint, staged))


def _refuse_foreign_directory(path: Path) -> None:
    if path.is_dir() and any(path.iterdir()) and detect_format_or_none(path) is not CheckpointFormat.SHARDED:
        raise IsADirectoryError(
            f"The checkpoint path {str(path)!r} is a directory that is not a checkpoint; refusing to replace"
            " it and everything in it. Choose another path."
        )


def _manifest_metadata(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What the manifest records about the Lightning checkpoint (JSON values only)."""
    return {key: checkpoint[key] for key in ("epoch", "global_step") if isinstance(checkpoint.get(key), int)}


def save_checkpoint(
    path: Location,
    checkpoint: dict[str, Any],
    *,
    sharded: bool,
    model_key: str,
    rank: int,
) -> None:
    """Write a Lightning checkpoint dict (from ``Trainer._checkpoint_connector.dump_checkpoint``).

    Args:
        path: the target directory (``sharded=True``) or file.
        checkpoint: the dict; its ``"state_dict"`` and ``"optimizer_states"`` come from
            :func:`model_state_dict` and :func:`optimizer_state_dict` with ``full=not sharded``. It is
            consumed (those two keys are popped).
        sharded: write a sharded directory, or a full file.
        model_key: top-level key for the model state in a sharded directory (``"model"`` or
            ``"state_dict"``; see :mod:`lightning_sharded.checkpoint.format`).
        rank: this process's global rank.
    """
    if sharded:
        state, metadata = split_sharded_checkpoint(checkpoint, model_key)
        write_sharded_checkpoint(path, state, metadata, rank=rank)
    else:
        write_full_checkpoint(path, checkpoint, rank=rank)


def remove_checkpoint(path: Location, *, rank: int) -> None:
    """Remove a checkpoint file or directory and its save leftovers (rank 0 only); missing is fine."""
    if rank != 0:
        return
    if isinstance(path, str):
        from lightning_sharded.checkpoint import object_store

        with contextlib.suppress(FileNotFoundError):
            object_store.remove_checkpoint(path)
        return
    from lightning_sharded.checkpoint import atomic

    with contextlib.suppress(FileNotFoundError):
        atomic.remove_checkpoint(path)


def detect_format_or_none(path: Path) -> CheckpointFormat | None:
    """:func:`~lightning_sharded.checkpoint.format.detect_format`, ``None`` instead of raising."""
    try:
        return detect_format(path)
    except (CheckpointError, FileNotFoundError):
        return None


# ----------------------------------------------------------------------------------------------- load


class Restored(NamedTuple):
    """What :func:`restore_checkpoint` returns."""

    #: The rest of the Lightning checkpoint: loops, callbacks, epoch, step, hyperparameters...
    metadata: dict[str, Any]
    #: Model keys compared with the checkpoint's (non-empty only for a non-strict load).
    keys: KeyReport


class KeyReport:
    """Keys of the model (or an optimizer) compared with those of a checkpoint."""

    def __init__(self, expected: Sequence[str], found: Sequence[str]) -> None:
        expected_set, found_set = set(expected), set(found)
        self.missing = sorted(expected_set - found_set)
        self.unexpected = sorted(found_set - expected_set)
        self.common = sorted(expected_set & found_set)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected)

    def describe(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"Missing key(s) in the checkpoint: {summarize_keys(self.missing)}.")
        if self.unexpected:
            parts.append(f"Unexpected key(s) in the checkpoint: {summarize_keys(self.unexpected)}.")
        return " ".join(parts)


def restore_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    *,
    strict: bool = True,
    weights_only: bool | None = None,
    verify: bool = False,
) -> Restored:
    """Load a sharded directory or a full file into ``model`` (and ``optimizers``) where they live.

    Collective: every rank calls it, with the model already wrapped/sharded and the optimizers (if
    any) built over its parameters. The checkpoint may come from any world size.

    Args:
        path: a sharded checkpoint directory (written by this library or stock Lightning's
            ``FSDPStrategy`` / ``ModelParallelStrategy``) or a full checkpoint file.
        model: the model to load into (its ``state_dict`` keys are the checkpoint's ``state_dict`` keys).
        optimizers: the optimizers whose state to restore, in order; empty to load the model only.
        strict: if ``True``, the checkpoint must have exactly the model's keys; if ``False``, the keys both
            have are loaded and the others left alone (reported with a warning by the caller).
        weights_only: passed to ``torch.load`` for the Lightning metadata.
        verify: also compare every file's checksum with the manifest before reading (reads every byte
            once more); presence and sizes are always checked against it.

    Returns:
        The rest of the Lightning checkpoint (loops, callbacks, ...) without ``state_dict`` and
        ``optimizer_states``, and the comparison of model keys (what a non-strict load skipped).

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: not a checkpoint, keys (strict) or shapes that do not fit, a different number of
            optimizers, or a read that failed on some rank; the message names the key, file or rank.
    """
    if storage.is_url(path):
        return _restore_url(
            str(path), model, optimizers, strict=strict, weights_only=weights_only, verify=verify
        )
    from lightning_sharded.checkpoint.atomic import resolve

    # A crash between the two renames of a fallback publish leaves the checkpoint under an "old" name.
    path = resolve(path)
    fmt = detect_format(path)
    if fmt is CheckpointFormat.SHARDED:
        from lightning_sharded.checkpoint.manifest import read_manifest
        from lightning_sharded.checkpoint.verify import check_files

        check_files(path, read_manifest(path), verify=verify)  # a stock checkpoint has no manifest
        return _restore_sharded(path, model, optimizers, strict=strict, weights_only=weights_only)
    return _restore_full(path, model, optimizers, strict=strict, weights_only=weights_only)


def _restore_url(
    url: str,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    strict: bool,
    weights_only: bool | None,
    verify: bool,
) -> Restored:
    """Restore from an fsspec URL: the published version of a sharded checkpoint, or a full file."""
    from lightning_sharded.checkpoint import object_store

    located = object_store.locate(url)
    if located.kind is object_store.ObjectKind.SHARDED:
        object_store.check_files(located, verify=verify)
        return _restore_sharded(located.data, model, optimizers, strict=strict, weights_only=weights_only)
    # Read memory-mapped, one tensor at a time, like a local file: downloaded first (by each rank).
    with storage.local_copy(url) as local:
        try:
            return _restore_full(local, model, optimizers, strict=strict, weights_only=weights_only)
        except CheckpointError as err:
            raise CheckpointError(str(err).replace(str(local), url)) from err


def _restore_sharded(
    path: Location,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    strict: bool,
    weights_only: bool | None,
) -> Restored:
    layout = read_sharded_layout(path)
    if optimizers:
        _check_optimizer_count(path, len(optimizers), layout.optimizer_count)
    target = model_state_dict(model, full=False)
    report = KeyReport(list(target), list(layout.model_entries))
    _check_keys(path, report, strict)
    _check_shapes(path, {key: target[key] for key in report.common}, layout.model_entries)
    to_load = {key: target[key] for key in report.common}
    # Before the first read: a bad meta.pt must fail the load before the model changed.
    metadata = _load_meta(storage.join(path, META_FILENAME), weights_only)
    _dcp_load({layout.model_key: to_load}, path)
    _set_model_state(model, to_load)

    for index, optimizer in enumerate(optimizers):
        _restore_sharded_optimizer(path, layout, model, optimizer, index, strict=strict)
    return Restored(metadata, report)


def _restore_sharded_optimizer(
    path: Location, layout: ShardedLayout, model: nn.Module, optimizer: Optimizer, index: int, *, strict: bool
) -> None:
    key = optimizer_key(index)
    template = _optimizer_template_from_index(model, optimizer, layout, key)
    from_index = template is not None
    if template is None:
        # FSDP1's flat parameters: torch's helper builds the template (with one zero-lr step) and
        # FSDP's own optim_state_dict_to_load maps it onto the flat parameters.
        template = optimizer_state_dict(model, optimizer, full=False)
    groups_in_checkpoint = {
        int(k.split(".")[2]) for k in layout.entries if k.startswith(f"{key}.{_PARAM_GROUPS}.")
    }
    if len(groups_in_checkpoint) != len(template[_PARAM_GROUPS]):
        raise CheckpointError(
            f"The optimizer {key} in {str(path)!r} has {len(groups_in_checkpoint)} parameter group(s), the"
            f" optimizer configured now has {len(template[_PARAM_GROUPS])}. Resume with the same parameter"
            " groups as the run that saved the checkpoint."
        )
    state: dict[str, dict[str, Any]] = template[_STATE]
    if from_index:
        # The template holds what the checkpoint has. With any state at all (not a stateless optimizer),
        # a trainable parameter without state is missing from the checkpoint.
        trainable = [name for name, param in _named_optimizer_params(model, optimizer) if param.requires_grad]
        missing = [f"{key}.{_STATE}.{name}" for name in trainable if name not in state] if state else []
    else:
        flat = {f"{key}.{_STATE}.{name}.{entry}": (name, entry) for name in state for entry in state[name]}
        missing = [k for k in flat if k not in layout.entries]
        _check_shapes(
            path,
            {k: state[name][entry] for k, (name, entry) in flat.items() if k in layout.entries},
            layout.entries,
        )
        for k in missing:  # not strict (checked below): those parameters start with fresh state
            name, entry = flat[k]
            state[name].pop(entry)
        for name in [n for n, entries in state.items() if not entries]:
            state.pop(name)
    if missing and strict:
        raise CheckpointError(
            f"The optimizer state {key} in {str(path)!r} does not fit the optimizer (strict loading)."
            f" {KeyReport(missing, []).describe()} Resume with the same model and optimizer, or set"
            " `strict_loading = False` on the LightningModule to load the state both have."
        )
    own_params = [group[_PARAMS] for group in template[_PARAM_GROUPS]]
    _dcp_load({key: template}, path)
    for group, params in zip(template[_PARAM_GROUPS], own_params, strict=True):
        group[_PARAMS] = params
    if from_index:
        optimizer.load_state_dict(_key_by_index(template))
    else:
        _set_optimizer_state(model, optimizer, template)


def _has_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(module, FullyShardedDataParallel) for module in model.modules())


def _named_optimizer_params(model: nn.Module, optimizer: Optimizer) -> list[tuple[str, torch.Tensor]]:
    """``(clean FQN, parameter)`` in the optimizer's order; a ``KeyError`` for a parameter not in ``model``.

    Names are those of ``get_optimizer_state_dict`` (no ``_orig_mod.``, ``_checkpoint_wrapped_module.``...),
    so a checkpoint saved through one wrapping loads into another.
    """
    names = parameter_names(model)
    return [(names[id(param)], param) for group in optimizer.param_groups for param in group[_PARAMS]]


def _optimizer_template_from_index(
    model: nn.Module, optimizer: Optimizer, layout: ShardedLayout, key: str
) -> dict[str, Any] | None:
    """An empty, name-keyed optimizer state shaped like the checkpoint's; see :func:`_template_like`."""
    prefix = f"{key}.{_STATE}."
    stored: dict[str, dict[str, tuple[tuple[int, ...] | None, torch.dtype | None]]] = {}
    for flat_key in sorted(layout.entries):
        if flat_key.startswith(prefix):
            name, _, entry = flat_key[len(prefix) :].rpartition(".")
            stored.setdefault(name, {})[entry] = (layout.entries[flat_key], layout.dtypes.get(flat_key))
    return _template_like(model, optimizer, stored)


def _template_like(
    model: nn.Module,
    optimizer: Optimizer,
    stored: dict[str, dict[str, tuple[tuple[int, ...] | None, torch.dtype | None]]],
) -> dict[str, Any] | None:
    """An empty, name-keyed optimizer state with the entries ``stored`` describes, to load into; or ``None``.

    ``stored`` maps parameter name -> state entry -> (global shape, dtype), or ``(None, None)`` for a
    non-tensor entry. Each state tensor with its parameter's global shape is made like the parameter (a
    ``DTensor`` stays sharded the same way, so each rank holds only its piece); any other (``step``)
    is a plain tensor of the stored shape. Unlike ``get_optimizer_state_dict`` this runs no optimizer
    step. Only for models whose parameters are the optimizer's parameters (plain, FSDP2, tensor
    parallel); ``None`` for FSDP1 (flat parameters) or a parameter the model does not name.
    """
    if _has_fsdp1(model):
        return None
    try:
        named = _named_optimizer_params(model, optimizer)
    except KeyError:
        return None
    params = dict(named)
    state: dict[str, dict[str, Any]] = {}
    for name in sorted(stored):
        param = params.get(name)
        if param is None:
            continue  # state of a parameter this optimizer does not have: not loaded
        for entry, (shape, dtype) in sorted(stored[name].items()):
            value: Any = None  # a non-tensor entry: the loader puts the stored object here
            if shape is not None and dtype is not None:
                if len(shape) > 0 and tuple(shape) == tuple(param.shape):
                    value = torch.empty_like(param, dtype=dtype, requires_grad=False)
                else:
                    value = torch.empty(shape, dtype=dtype)
            state.setdefault(name, {})[entry] = value
    groups = []
    position = 0
    for group in optimizer.param_groups:
        count = len(group[_PARAMS])
        names = [name for name, _ in named[position : position + count]]
        position += count
        groups.append({**{k: v for k, v in group.items() if k != _PARAMS}, _PARAMS: names})
    return {_STATE: state, _PARAM_GROUPS: groups}


def _restore_full(
    path: Path, model: nn.Module, optimizers: Sequence[Optimizer], *, strict: bool, weights_only: bool | None
) -> Restored:
    try:
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    except Exception as ex:
        raise CheckpointError(
            f"Could not read the checkpoint file {str(path)!r}: {ex!r}. The file is not a checkpoint written"
            " by torch.save, or it is truncated or corrupt; resume from another checkpoint."
        ) from ex
    # Each tensor's pages are given back once copied: the peak stays one shard plus one tensor.
    mapping = FileMapping(path)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(STATE_DICT), dict):
        keys = sorted(map(str, checkpoint)) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(
            f"The checkpoint file {str(path)!r} is not a Lightning checkpoint: it has no {STATE_DICT!r}"
            f" dict (found {keys}). Pass a file written by `Trainer.save_checkpoint`."
        )
    source: dict[str, Any] = checkpoint.pop(STATE_DICT)
    optimizer_states = checkpoint.pop(OPTIMIZER_STATES, None)
    if optimizers:
        _check_optimizer_count(path, len(optimizers), len(optimizer_states or []))
    target = model_state_dict(model, full=False)
    report = KeyReport(list(target), list(source))
    _check_keys(path, report, strict)
    _check_shapes(
        path,
        {key: target[key] for key in report.common},
        {key: tuple(value.shape) for key, value in source.items() if isinstance(value, torch.Tensor)},
    )
    to_load: dict[str, Any] = {}
    for key in report.common:  # sorted: the same order on every rank
        to_load[key] = _copy_full_into(target[key], source[key])
        mapping.release(source[key])
    _set_model_state(model, to_load)
    del to_load, source

    for index, (optimizer, optim_state) in enumerate(zip(optimizers, optimizer_states or [], strict=True)):
        _restore_full_optimizer(path, model, optimizer, optim_state, index, strict=strict, mapping=mapping)
    return Restored(checkpoint, report)


def _restore_full_optimizer(
    path: Path,
    model: nn.Module,
    optimizer: Optimizer,
    source: dict[str, Any],
    index: int,
    *,
    strict: bool,
    mapping: FileMapping | None = None,
) -> None:
    where = f"optimizer_states[{index}] of {str(path)!r}"
    source_groups = source.get(_PARAM_GROUPS, [])
    if len(source_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"The optimizer state {where} has {len(source_groups)} parameter group(s), the optimizer"
            f" configured now has {len(optimizer.param_groups)}. Resume with the same parameter groups."
        )
    template = None
    if not _has_fsdp1(model):
        try:
            names = [name for name, _ in _named_optimizer_params(model, optimizer)]
        except KeyError:
            names = []
        if names:
            source_state = _name_keyed(where, source, names)
            stored: dict[str, dict[str, tuple[tuple[int, ...] | None, torch.dtype | None]]] = {
                name: {
                    entry: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (None, None)
                    for entry, v in entries.items()
                }
                for name, entries in source_state.items()
            }
            template = _template_like(model, optimizer, stored)
    with_helpers = template is None
    if template is None:
        # FSDP1's flat parameters: torch's helper builds the template (with one zero-lr step).
        template = optimizer_state_dict(model, optimizer, full=False)
        names = _param_names(template)
        source_state = _name_keyed(where, source, names)
    state: dict[str, dict[str, Any]] = template[_STATE]
    missing = []
    if with_helpers:
        missing = [f"{n}.{e}" for n in sorted(state) for e in state[n] if e not in source_state.get(n, {})]
    elif source_state:
        trainable = [n for n, p in _named_optimizer_params(model, optimizer) if p.requires_grad]
        missing = [n for n in trainable if n not in state]
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
                _check_shapes(path, {label: entries[entry]}, {label: tuple(value.shape)})
                entries[entry] = _copy_full_into(entries[entry], value)
                if mapping is not None:
                    mapping.release(value)  # its memory-mapped pages are not needed again
            else:
                entries[entry] = value
        if not entries:
            state.pop(name)
    for group, source_group in zip(template[_PARAM_GROUPS], source_groups, strict=True):
        params = group[_PARAMS]
        group.clear()
        group.update(source_group)
        group[_PARAMS] = params
    if with_helpers:
        _set_optimizer_state(model, optimizer, template)
    else:
        optimizer.load_state_dict(_key_by_index(template))


def _name_keyed(where: str, source: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A full file's optimizer state keyed by parameter name (stock files key it by index)."""
    source_state: dict[Any, Any] = source.get(_STATE, {})
    if not any(isinstance(k, int) for k in source_state):
        return source_state
    source_names = [p for group in source.get(_PARAM_GROUPS, []) for p in group[_PARAMS]]
    if all(isinstance(p, int) for p in source_names) and len(source_names) != len(names):
        raise CheckpointError(
            f"The optimizer state {where} covers {len(source_names)} parameters, the optimizer has"
            f" {len(names)}. Resume with the same model and optimizer."
        )
    by_position = dict(zip(source_names, names, strict=False))
    return {by_position.get(k, k): v for k, v in source_state.items()}


# -------------------------------------------------------------------------------------------- helpers


def _check_optimizer_count(path: Location, configured: int, saved: int) -> None:
    if configured == saved:
        return
    if saved == 0:
        raise CheckpointError(
            f"The checkpoint {str(path)!r} has no optimizer state but {configured} optimizer(s) are"
            " configured: it was probably saved with `ModelCheckpoint(save_weights_only=True)`. Resume"
            " from a full training checkpoint, or load the weights only (with `trainer.validate`, say)."
        )
    raise CheckpointError(
        f"You have configured {configured} optimizer(s) but the checkpoint {str(path)!r} contains {saved}"
        " optimizer state(s). Resume training with the same number of optimizers as the run that saved it."
    )


def _check_keys(path: Location, report: KeyReport, strict: bool) -> None:
    if report and strict:
        raise CheckpointError(
            f"Error(s) in loading the checkpoint {str(path)!r} into the model (strict loading). "
            f"{report.describe()} Make the model match the checkpoint, or set `self.strict_loading = False`"
            " in the LightningModule to load only the keys both have."
        )


def _global_shape(value: Any) -> tuple[int, ...] | None:
    adapter = adapter_for(value)
    if adapter is not None:
        return tuple(adapter.global_shape(value))
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return None


def _check_shapes(
    path: Location, targets: dict[str, Any], shapes: dict[str, tuple[int, ...] | None], prefix: str = ""
) -> None:
    bad = []
    for key in sorted(targets):
        expected = _global_shape(targets[key])
        stored = shapes.get(prefix + key)
        if expected is not None and stored is not None and tuple(stored) != expected:
            bad.append(
                f"size mismatch for {key}: the checkpoint has shape {list(stored)},"
                f" the model {list(expected)}"
            )
    if bad:
        raise CheckpointError(
            f"The checkpoint {str(path)!r} does not fit the model: {'; '.join(bad)}. Resume with the model"
            " configuration that saved it."
        )


def _copy_full_into(target: Any, full: Any) -> Any:
    """Put the global value ``full`` into ``target`` (a sharded or plain tensor); returns what to load."""
    adapter = adapter_for(target)
    if adapter is not None:
        adapter.copy_into(target, full)
        return target
    if isinstance(target, torch.Tensor) and isinstance(full, torch.Tensor):
        with torch.no_grad():
            target.copy_(full)
        return target
    return full


def _set_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # Keys were checked against the checkpoint already; `state` holds exactly the keys to load.
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def _set_optimizer_state(model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state)


def _dcp_load(state: dict[str, Any], path: Location) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load

    from lightning_sharded.checkpoint.reader import DirectReader

    _run_dcp(
        lambda: load(
            state,
            storage_reader=DirectReader(path) if isinstance(path, Path) else storage.dcp_reader(path),
            planner=DefaultLoadPlanner(allow_partial_load=True),
        ),
        f"Loading the sharded checkpoint {str(path)!r}",
    )


def _run_dcp(call: Any, what: str) -> None:
    """Run a DCP call; its ``CheckpointException`` (a ``BaseException``) becomes a ``CheckpointError``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        call()
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


def _load_meta(path: Location, weights_only: bool | None) -> dict[str, Any]:
    try:
        metadata = storage.torch_load(path, map_location="cpu", weights_only=weights_only)
    except Exception as ex:
        raise CheckpointError(
            f"Could not read the Lightning metadata {str(path)!r}: {ex!r}. The file is truncated or corrupt;"
            " resume from an earlier checkpoint."
        ) from ex
    if not isinstance(metadata, dict):
        raise CheckpointError(
            f"The Lightning metadata {str(path)!r} is a {type(metadata).__name__}, not a dict."
        )
    return metadata
