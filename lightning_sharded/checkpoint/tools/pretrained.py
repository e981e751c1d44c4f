"""``load_pretrained``: weights into a model that is already sharded, each rank reading only its slices.

The sources: a Hugging Face directory (``model.safetensors``, or files and
``model.safetensors.index.json``) or one ``.safetensors`` file, read lazily through ``safetensors``'
``safe_open(...).get_slice``; a full torch / Lightning checkpoint file, memory-mapped (local) and
unpickled safely; the model part of a sharded checkpoint directory (ours, stock ``FSDPStrategy``'s or
``ModelParallelStrategy``'s), read through its DCP files with resharding.

The targets are the model's own sharded state dict (``get_model_state_dict``: ``DTensor`` parameters
of FSDP2 and tensor parallelism, FSDP1's sharded ``ShardedTensor`` views, plain tensors, sharded
attributes under their keys). One ``torch.distributed.checkpoint.load`` plans, on every rank, the reads
its local pieces need (offsets from the placements and the mesh, or the shards' metadata), so a rank
reads the rows and columns it holds and nothing else; values are copied into the shards, cast to their
dtype. What the source holds is listed once, on rank 0, and shared; keys and shapes are then compared
the same way on every rank, so every rank loads, or raises the same error, before anything is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from lightning_sharded.checkpoint import collective, names
from lightning_sharded.checkpoint.backends import Location, location
from lightning_sharded.checkpoint.detect import CheckpointKind, detect
from lightning_sharded.checkpoint.errors import CheckpointError, run_dcp
from lightning_sharded.checkpoint.load.checks import KeyReport, global_shape, set_model_state
from lightning_sharded.checkpoint.state_dicts import has_fsdp1, model_state_dict
from lightning_sharded.checkpoint.tools.reader import first_line, open_sharded, safe_torch_load
from lightning_sharded.checkpoint.tools.safetensors_format import (
    SUFFIX,
    is_weights_dir,
    read_header,
    weight_files,
)

__all__ = ["PretrainedKeys", "load_pretrained"]


class PretrainedKeys(NamedTuple):
    """What :func:`load_pretrained` did not load.

    Attributes:
        missing_keys: Keys of the module (with ``prefix``) that the source does not have.
        unexpected_keys: Keys of the source that the module does not have.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass
class _Listing:
    """What a source holds, found on rank 0 and sent to every rank (picklable).

    Attributes:
        kind: ``"safetensors"``, ``"full"`` or ``"sharded"``.
        shown: The source in words, for messages.
        shapes: Each key (as the source names it, without any model prefix) to its global shape.
        dtypes: Each key to its stored dtype.
        files: ``"safetensors"``: each key's file; ``"full"``: the file, under the key ``""``.
        data: ``"sharded"``: where its files are.
        model_key: ``"sharded"``: ``"model"`` or ``"state_dict"``.
        metadata: ``"sharded"``: the DCP index, read once, safely.
    """

    kind: str
    shown: str
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    data: Location | None = None
    model_key: str = ""
    metadata: Any = None


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
    listing = collective.decide(lambda: _list_source(path, prefix, weights_only))
    root = _root(module)
    state = model_state_dict(root, full=False)
    selected = {key: value for key, value in state.items() if key.startswith(prefix) and _is_tensor(value)}
    targets = {key[len(prefix) :]: value for key, value in selected.items()}
    report = KeyReport(list(targets), list(listing.shapes))
    tied = _tied_keys(root, prefix, set(report.common))
    missing = [prefix + key for key in report.missing if prefix + key not in tied]
    unexpected = report.unexpected
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"Missing key(s) in the weights: {_summary(missing)}.")
        if unexpected:
            parts.append(f"Unexpected key(s) in the weights: {_summary(unexpected)}.")
        hint = f" (with prefix={prefix!r})" if prefix else ""
        raise CheckpointError(
            f"Error(s) in loading the pretrained weights {listing.shown!r} into {type(module).__name__}"
            f"{hint} (strict): {' '.join(parts)} Pass the prefix under which the module holds the model"
            " (prefix='llm.' for self.llm), or strict=False to load only the keys both have."
        )
    bad = [
        f"size mismatch for {prefix + key}: the weights have shape {list(listing.shapes[key])}, the module"
        f" {list(shape)}"
        for key in report.common
        if (shape := global_shape(targets[key])) is not None and tuple(shape) != tuple(listing.shapes[key])
    ]
    if bad:
        raise CheckpointError(
            f"The pretrained weights {listing.shown!r} do not fit {type(module).__name__}: {'; '.join(bad)}."
            " Build the model from the configuration the weights were saved with."
        )
    to_load = {key: targets[key] for key in report.common}
    if to_load:
        _read(listing, to_load, weights_only)
        set_model_state(root, {prefix + key: value for key, value in to_load.items()})
    return PretrainedKeys(missing, unexpected)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or global_shape(value) is not None


def _summary(keys: list[str], limit: int = 10) -> str:
    keys = sorted(keys)
    shown = ", ".join(f'"{k}"' for k in keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


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


# -------------------------------------------------------------------------------------- sources


def _list_source(path: str | os.PathLike[str], prefix: str, weights_only: bool | None) -> _Listing:
    """Rank 0: what is at ``path`` and what it holds (keys, shapes, dtypes)."""
    given = location(path)
    if isinstance(given, Path) and (
        is_weights_dir(given) or (given.is_file() and given.name.endswith(SUFFIX))
    ):
        return _list_safetensors(given)
    found = detect(path)
    if found.kind is CheckpointKind.FULL:
        state = _full_state(found.backend, found.data, weights_only)
        listing = _Listing("full", str(given), files={"": str(found.data)})
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                listing.shapes[key] = tuple(value.shape)
                listing.dtypes[key] = value.dtype
        return listing
    reader = open_sharded(found, False, weights_only)
    tops = {reader.path_of(key)[0] for key in reader.tensors}
    model_key = next((k for k in names.MODEL_KEYS if k in tops), None)
    if model_key is None:
        raise CheckpointError(
            f"The sharded checkpoint {str(given)!r} has no model tensors (none of the keys"
            f" {list(names.MODEL_KEYS)} among its top-level keys {sorted(map(str, tops))})."
        )
    listing = _Listing("sharded", str(given), data=found.data, model_key=model_key, metadata=reader.metadata)
    for key, md in reader.tensors.items():
        where = reader.path_of(key)
        if where[0] == model_key:
            name = ".".join(str(p) for p in where[1:])
            listing.shapes[name] = tuple(md.size)
            listing.dtypes[name] = md.properties.dtype
    return listing


def _list_safetensors(path: Path) -> _Listing:
    try:
        files = weight_files(path)
        listing = _Listing("safetensors", str(path))
        headers: dict[Path, Any] = {}
        for key, file in sorted(files.items()):
            if file not in headers:
                headers[file] = read_header(file)
            entry = headers[file].get(key)
            if entry is None:
                raise CheckpointError(
                    f"The index of {str(path)!r} puts {key!r} in {file.name!r}, which does not hold it. Copy"
                    " the whole directory again."
                )
            listing.shapes[key] = entry.shape
            listing.dtypes[key] = entry.dtype
            listing.files[key] = str(file)
    except ValueError as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(str(err)) from None
    if not listing.shapes:
        raise CheckpointError(f"The weights {str(path)!r} hold no tensor.")
    return listing


def _full_state(backend: Any, file: Location, weights_only: bool | None) -> dict[str, Any]:
    """The ``state_dict`` of a full checkpoint file (or the file's dict of tensors), memory-mapped
    where local, so a tensor is read when it is copied out."""
    mmap = {"mmap": True} if isinstance(file, Path) else {}
    try:
        checkpoint = safe_torch_load(
            backend, file, "The checkpoint file", weights_only, map_location="cpu", **mmap
        )
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"The checkpoint file {str(file)!r} cannot be read ({first_line(err)}): it is truncated or"
            " corrupt, or not a checkpoint."
        ) from err
    state = checkpoint.get(names.STATE_DICT, checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not any(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"The checkpoint file {str(file)!r} holds no weights: neither a 'state_dict' of tensors (a"
            " Lightning checkpoint) nor a dict of tensors (a saved state_dict)."
        )
    return state


# -------------------------------------------------------------------------------------- reading


def _read(listing: _Listing, targets: dict[str, Any], weights_only: bool | None) -> None:
    """One DCP load of ``targets`` (source key to the module's sharded or plain tensor), in place."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load

    what = f"Loading the pretrained weights {listing.shown!r}"
    if listing.kind == "sharded":
        from lightning_sharded.checkpoint.backends import backend_for

        assert listing.data is not None
        reader = backend_for(listing.data).dcp_reader(listing.data)
        reader.read_metadata = lambda *args, **kwargs: listing.metadata  # read once, safely, on rank 0
        state: dict[str, Any] = {listing.model_key: targets}
        run_dcp(
            lambda: load(state, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True)),
            what,
        )
        return
    slicer = (
        _SafetensorsSlices(listing) if listing.kind == "safetensors" else _FullSlices(listing, weights_only)
    )
    try:
        run_dcp(
            lambda: load(
                dict(targets),
                storage_reader=_SliceReader(listing, slicer),
                planner=DefaultLoadPlanner(allow_partial_load=True),
            ),
            what,
        )
    finally:
        slicer.close()


class _SafetensorsSlices:
    """``get(key, slices)`` from the ``.safetensors`` files, lazily: only the slice is read."""

    def __init__(self, listing: _Listing) -> None:
        try:
            from safetensors import safe_open
        except ImportError:  # pragma: no cover - transformers installs it
            raise ImportError(
                "Loading safetensors weights needs the `safetensors` package: pip install safetensors"
            ) from None
        self._open = safe_open
        self.listing = listing
        self.handles: dict[str, Any] = {}

    def get(self, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        file = self.listing.files[key]
        handle = self.handles.get(file)
        if handle is None:
            handle = self.handles[file] = self._open(file, framework="pt", device="cpu")
        if not slices:
            return handle.get_tensor(key)  # type: ignore[no-any-return]
        return handle.get_slice(key)[slices]  # type: ignore[no-any-return]

    def close(self) -> None:
        self.handles.clear()


class _FullSlices:
    """``get(key, slices)`` from a full checkpoint file, memory-mapped where local."""

    def __init__(self, listing: _Listing, weights_only: bool | None) -> None:
        from lightning_sharded.checkpoint.backends import backend_for

        file = location(listing.files[""])
        self.state: dict[str, Any] | None = _full_state(backend_for(file), file, weights_only)

    def get(self, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        assert self.state is not None
        value: torch.Tensor = self.state[key]
        return value[slices] if slices else value

    def close(self) -> None:
        self.state = None


class _SliceReader(StorageReader):
    """A DCP ``StorageReader`` over a source whose tensors are whole (one chunk each): each read item
    is a slice, copied out of the source into the planner's target (cast to its dtype)."""

    def __init__(self, listing: _Listing, slicer: _SafetensorsSlices | _FullSlices) -> None:
        super().__init__()
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            Metadata,
            TensorProperties,
            TensorStorageMetadata,
        )

        self.slicer = slicer
        self.metadata = Metadata(
            state_dict_metadata={
                key: TensorStorageMetadata(
                    properties=TensorProperties(dtype=listing.dtypes[key]),
                    size=torch.Size(shape),
                    chunks=[
                        ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))
                    ],
                )
                for key, shape in listing.shapes.items()
            }
        )

    def reset(self, checkpoint_id: Any = None) -> None:
        pass  # Override to do nothing: the source is fixed at construction.

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self.metadata

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass  # Override to do nothing: the metadata was built from the listing every rank has.

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        for item in plan.items:
            slices = tuple(
                slice(int(offset), int(offset) + int(length))
                for offset, length in zip(item.storage_offsets, item.lengths, strict=True)
            )
            value = self.slicer.get(item.storage_index.fqn, slices)
            target = planner.resolve_tensor(item).detach()
            if tuple(target.shape) != tuple(value.shape):
                raise CheckpointError(
                    f"Reading {item.storage_index.fqn!r}: a slice of shape {list(value.shape)} for a target"
                    f" of shape {list(target.shape)}."
                )
            target.copy_(value)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()  # DCP waits on a torch future
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True
