"""Where ``load_pretrained`` reads weights from: what a source holds, and a DCP reader of its slices.

:func:`read_weights` loads through one ``torch.distributed.checkpoint.load``: a sharded checkpoint by
its own DCP reader (resharding), a safetensors or full file by :class:`SliceReader`, which reads each
item's slice only (``safetensors``' ``get_slice``, a view of the memory-mapped tensor).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from lightning_sharded.checkpoint import hf_layout, names
from lightning_sharded.checkpoint.backends import Backend, Location, backend_for, local_path, location
from lightning_sharded.checkpoint.detect import CheckpointKind, Found, detect
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.failures import dcp_errors
from lightning_sharded.checkpoint.tools.reader import open_sharded, read_full
from lightning_sharded.checkpoint.tools.safetensors_format import TORCH_NAMES

__all__ = [
    "FullSlices",
    "Listing",
    "SafetensorsSlices",
    "SliceReader",
    "full_weights",
    "list_source",
    "read_weights",
]


@dataclass
class Listing:
    """What a source holds, found on rank 0 and sent to every rank (picklable).

    Attributes:
        kind: ``"safetensors"``, ``"full"`` or ``"sharded"``.
        shown: The source in words, for messages.
        shapes: Each key (as the source names it, without any model prefix) to its global shape.
        dtypes: Each key to its stored dtype.
        files: ``"safetensors"``: each key's file.
        found: ``"full"`` and ``"sharded"``: the source as the detector found it; every read of its
            files goes through ``found.backend``.
        model_key: ``"sharded"``: ``"model"`` or ``"state_dict"``.
        metadata: ``"sharded"``: the DCP index, read once, safely.
    """

    kind: str
    shown: str
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    found: Found | None = None
    model_key: str = ""
    metadata: Any = None


def list_source(path: str | os.PathLike[str], weights_only: bool | None) -> Listing:
    """Rank 0: what is at ``path`` and what it holds (keys, shapes, dtypes)."""
    given = location(path)
    on_disk = local_path(given)  # safetensors files are read with safetensors' own (local) reader
    if on_disk is not None and (
        (on_disk.is_dir() and hf_layout.is_weights_listing(os.listdir(on_disk)))
        or (on_disk.is_file() and on_disk.name.endswith(names.SAFETENSORS_SUFFIX))
    ):
        return _list_safetensors(on_disk)
    found = detect(path)
    if found.kind is CheckpointKind.FULL:
        _, state = full_weights(found.backend, found.data, weights_only)
        tensors = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
        shapes = {key: tuple(value.shape) for key, value in tensors.items()}
        return Listing("full", str(given), shapes, {k: v.dtype for k, v in tensors.items()}, found=found)
    reader = open_sharded(found, False, weights_only)
    listing = Listing(
        "sharded", str(given), found=found, model_key=reader.model_key(), metadata=reader.metadata
    )
    for _, name, md in reader.model_tensors():
        listing.shapes[name] = tuple(md.size)
        listing.dtypes[name] = md.properties.dtype
    return listing


def _list_safetensors(path: Path) -> Listing:
    weights = hf_layout.list_weights(backend_for(path), path)
    if weights.problems:
        also = "".join(f"; {p}" for p in weights.problems[1:])
        raise CheckpointError(
            f"The weights {str(path)!r} are damaged: {weights.problems[0]}{also}. Copy them again."
        )
    listing = Listing("safetensors", str(path))
    for key, (name, tensor) in sorted(weights.tensors.items()):
        dtype_name = TORCH_NAMES.get(tensor.dtype)
        if dtype_name is None:
            raise CheckpointError(
                f"{name!r} of {str(path)!r}: the tensor {key!r} has a dtype this library does not read:"
                f" {tensor.dtype!r}."
            )
        listing.shapes[key] = tensor.shape
        listing.dtypes[key] = getattr(torch, dtype_name)
        listing.files[key] = str(path / name if path.is_dir() else path)
    if not listing.shapes:
        raise CheckpointError(f"The weights {str(path)!r} hold no tensor.")
    return listing


def full_weights(
    backend: Backend, file: Location, weights_only: bool | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A full checkpoint file's dict and its model weights: its ``state_dict``, or the file's own dict of
    tensors (a saved ``state_dict``); a ``CheckpointError`` when it does not read or holds no tensors.
    Memory-mapped where the backend can (local files), so a tensor is read when it is copied out."""
    checkpoint = read_full(backend, file, weights_only, "", map_location="cpu", mmap=True)
    checkpoint = checkpoint if isinstance(checkpoint, dict) else {}
    state = checkpoint.get(names.STATE_DICT, checkpoint)
    if not isinstance(state, dict) or not any(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"The checkpoint file {str(file)!r} holds no weights: neither a 'state_dict' of tensors (a"
            " Lightning checkpoint) nor a dict of tensors (a saved state_dict)."
        )
    return checkpoint, state


# -------------------------------------------------------------------------------------- reading


def read_weights(listing: Listing, targets: dict[str, Any], weights_only: bool | None) -> None:
    """One DCP load of ``targets`` (source key to the module's sharded or plain tensor), in place."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load

    slicer: SafetensorsSlices | FullSlices | None = None
    if listing.kind == "sharded":
        assert listing.found is not None
        # The metadata was read once, safely, on rank 0.
        reader = listing.found.backend.dcp_reader(listing.found.data, listing.metadata)
        state: dict[str, Any] = {listing.model_key: targets}
    else:
        safetensors = listing.kind == "safetensors"
        slicer = SafetensorsSlices(listing) if safetensors else FullSlices(listing, weights_only)
        reader, state = SliceReader(listing, slicer), dict(targets)
    try:
        with dcp_errors(f"Loading the pretrained weights {listing.shown!r}"):
            load(state, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
    finally:
        if slicer is not None:
            slicer.close()


class SafetensorsSlices:
    """``get(key, slices)`` from the ``.safetensors`` files, lazily: only the slice is read."""

    def __init__(self, listing: Listing) -> None:
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


class FullSlices:
    """``get(key, slices)`` from a full checkpoint file, memory-mapped where local."""

    def __init__(self, listing: Listing, weights_only: bool | None) -> None:
        found = listing.found
        assert found is not None
        self.state: dict[str, Any] | None = full_weights(found.backend, found.data, weights_only)[1]

    def get(self, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        assert self.state is not None
        value: torch.Tensor = self.state[key]
        return value[slices] if slices else value

    def close(self) -> None:
        self.state = None


class SliceReader(StorageReader):
    """A DCP ``StorageReader`` over a source whose tensors are whole (one chunk each): each read item
    is a slice, copied out of the source into the planner's target (cast to its dtype)."""

    def __init__(self, listing: Listing, slicer: SafetensorsSlices | FullSlices) -> None:
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
