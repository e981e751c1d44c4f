"""What a checkpoint path holds: a sharded directory, a full file, or neither.

A *sharded* checkpoint is a directory written by ``torch.distributed.checkpoint`` (DCP): shard files
``__R_0.distcp``..., the DCP index ``.metadata``, and ``meta.pt`` with the rest of the Lightning
checkpoint (loops, callbacks, hyperparameters...). The model state sits under one top-level key, which
depends on the writer:

============================================  ===================  =================
writer                                         model key            optimizer keys
============================================  ===================  =================
this library's ``ShardedFSDPStrategy``        ``model``            ``optimizer_N``
stock Lightning ``FSDPStrategy``               ``model``            ``optimizer_N``
this library's ``ShardedModelParallelStrategy``  ``state_dict``     ``optimizer_N``
stock Lightning ``ModelParallelStrategy``      ``state_dict``       ``optimizer_N``
============================================  ===================  =================

A *full* checkpoint is one ``torch.save`` file, as stock Lightning writes it (``state_dict``,
``optimizer_states``, loops...). Nothing here needs a process group.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_sharded.checkpoint import storage
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.storage import Location

__all__ = [
    "DCP_METADATA_FILENAME",
    "META_FILENAME",
    "MODEL",
    "OPTIMIZER",
    "OPTIMIZER_STATES",
    "STATE_DICT",
    "CheckpointFormat",
    "ShardedLayout",
    "detect_format",
    "optimizer_key",
    "read_sharded_layout",
]

#: Top-level key of the model state in directories written by ``FSDPStrategy`` (stock and ours).
MODEL = "model"
#: Top-level key of the model state in directories written by ``ModelParallelStrategy`` (stock and ours),
#: and the key of the model state in a full Lightning checkpoint file.
STATE_DICT = "state_dict"
#: Top-level key of the N-th optimizer in a sharded directory (``OPTIMIZER.format(N)``).
OPTIMIZER = "optimizer_{}"
#: Key of the list of optimizer states in a full Lightning checkpoint file.
OPTIMIZER_STATES = "optimizer_states"
#: The file with everything but model and optimizer state, in a sharded directory.
META_FILENAME = "meta.pt"
#: The index DCP writes last, in a sharded directory.
DCP_METADATA_FILENAME = ".metadata"

_OPTIMIZER_RE = re.compile(r"^optimizer_(\d+)$")


def optimizer_key(index: int) -> str:
    """The top-level key of the ``index``-th optimizer in a sharded directory."""
    return OPTIMIZER.format(index)


class CheckpointFormat(enum.Enum):
    """The two layouts a checkpoint path can have."""

    #: A directory of DCP shards plus ``meta.pt``.
    SHARDED = "sharded"
    #: One ``torch.save`` file.
    FULL = "full"


def detect_format(path: str | Path) -> CheckpointFormat:
    """Which layout ``path`` has, without reading more than directory entries.

    Raises:
        FileNotFoundError: nothing exists at ``path``.
        CheckpointError: ``path`` is a directory that is not a complete sharded checkpoint (no DCP
            ``.metadata`` or no ``meta.pt``), or something that is neither a directory nor a file.
    """
    path = Path(path)
    if path.is_file():
        return CheckpointFormat.FULL
    if path.is_dir():
        has_index = (path / DCP_METADATA_FILENAME).is_file()
        has_meta = (path / META_FILENAME).is_file()
        if has_index and has_meta:
            return CheckpointFormat.SHARDED
        if not any(path.iterdir()):
            raise CheckpointError(
                f"The checkpoint directory {str(path)!r} is empty. Point `ckpt_path` to a directory with"
                f" checkpoint shards ({DCP_METADATA_FILENAME}, *.distcp, {META_FILENAME}) or to a full"
                " checkpoint file."
            )
        if has_index:
            raise CheckpointError(
                f"The checkpoint directory {str(path)!r} has shards but no Lightning metadata file"
                f" {META_FILENAME!r} (loops, callbacks, epoch and step): the save that wrote it did not"
                " finish. Resume from an earlier checkpoint."
            )
        if has_meta:
            raise CheckpointError(
                f"The checkpoint directory {str(path)!r} has {META_FILENAME!r} but no DCP index"
                f" {DCP_METADATA_FILENAME!r}: the shards are incomplete. Resume from an earlier checkpoint."
            )
        raise CheckpointError(
            f"The path {str(path)!r} is a directory but not a sharded checkpoint (it has neither"
            f" {DCP_METADATA_FILENAME!r} nor {META_FILENAME!r}). Point `ckpt_path` to a directory with"
            " checkpoint shards or to a single file with a full checkpoint."
        )
    if path.exists():
        raise CheckpointError(
            f"The path {str(path)!r} is neither a directory with checkpoint shards nor a checkpoint file."
        )
    raise FileNotFoundError(
        f"No checkpoint at {str(path)!r}: the path does not exist. Check `ckpt_path` (a directory with"
        " checkpoint shards or a single checkpoint file)."
    )


@dataclass(frozen=True)
class ShardedLayout:
    """What a sharded directory's DCP index says it holds, read without a process group.

    Attributes:
        path: the directory.
        model_key: ``"model"`` or ``"state_dict"``, whichever the writer used.
        model_entries: model state key (relative, e.g. ``"layer.weight"``) to its global shape, or
            ``None`` for an entry stored as bytes (a non-tensor value).
        optimizer_count: how many ``optimizer_N`` keys there are (``0..N-1`` without gaps).
        entries: every flattened DCP key to its global shape, or ``None`` for bytes entries.
        dtypes: every flattened DCP key of a tensor to its element type.
    """

    path: Location
    model_key: str
    model_entries: dict[str, tuple[int, ...] | None]
    optimizer_count: int
    entries: dict[str, tuple[int, ...] | None] = field(repr=False)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict, repr=False)


def read_sharded_layout(path: str | Path) -> ShardedLayout:
    """Read the DCP index of a sharded directory and find the model key and the optimizers.

    Raises:
        CheckpointError: the index cannot be read, or it holds no model state under ``"model"`` or
            ``"state_dict"``, or its optimizer keys have gaps.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = storage.location(path)
    try:
        metadata = storage.dcp_reader(path).read_metadata()
    except Exception as ex:
        raise CheckpointError(
            f"Could not read the DCP index {str(storage.join(path, DCP_METADATA_FILENAME))!r}: {ex!r}. The"
            " file is truncated or corrupt; resume from an earlier checkpoint."
        ) from ex
    _check_shard_files(path, metadata)
    entries: dict[str, tuple[int, ...] | None] = {}
    dtypes: dict[str, torch.dtype] = {}
    for key, item in metadata.state_dict_metadata.items():
        entries[key] = tuple(item.size) if isinstance(item, TensorStorageMetadata) else None
        if isinstance(item, TensorStorageMetadata):
            dtypes[key] = item.properties.dtype

    tops = {key.split(".", 1)[0] for key in entries}
    model_keys = sorted(k for k in (MODEL, STATE_DICT) if k in tops)
    if not model_keys:
        raise CheckpointError(
            f"The sharded checkpoint {str(path)!r} holds no model state: expected the key {MODEL!r}"
            f" (FSDPStrategy) or {STATE_DICT!r} (ModelParallelStrategy), found {sorted(tops)}."
        )
    if len(model_keys) > 1:
        raise CheckpointError(
            f"The sharded checkpoint {str(path)!r} holds model state under both {MODEL!r} and"
            f" {STATE_DICT!r}; it was not written by Lightning and cannot be resumed unambiguously."
        )
    model_key = model_keys[0]
    prefix = model_key + "."
    model_entries = {key[len(prefix) :]: shape for key, shape in entries.items() if key.startswith(prefix)}

    indices = sorted(int(m.group(1)) for top in tops if (m := _OPTIMIZER_RE.match(top)))
    if indices != list(range(len(indices))):
        raise CheckpointError(
            f"The sharded checkpoint {str(path)!r} has optimizer keys {[optimizer_key(i) for i in indices]}"
            " with gaps; expected optimizer_0 ... optimizer_N-1."
        )
    return ShardedLayout(
        path=path,
        model_key=model_key,
        model_entries=model_entries,
        optimizer_count=len(indices),
        entries=entries,
        dtypes=dtypes,
    )


def _check_shard_files(path: Location, metadata: Any) -> None:
    """Every shard file the DCP index names exists and is long enough for the pieces it holds."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is None:
            continue
        needed[relative] = max(needed.get(relative, 0), int(info.offset) + int(info.length))
    problems = []
    sizes = storage.list_files(path)
    for relative in sorted(needed):
        size = sizes.get(relative)
        if size is None:
            problems.append(f"{relative!r} is missing")
        elif size < needed[relative]:
            problems.append(f"{relative!r} has {size} bytes, its index needs at least {needed[relative]}")
    if problems:
        raise CheckpointError(
            f"The sharded checkpoint {str(path)!r} is incomplete: " + "; ".join(problems) + ". The files were"
            " truncated or removed after the save; resume from an earlier checkpoint."
        )


def summarize_keys(keys: list[str], limit: int = 10) -> str:
    """``keys`` sorted and quoted, cut after ``limit`` with a count of the rest."""
    keys = sorted(keys)
    shown = ", ".join(f'"{k}"' for k in keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def describe_model_state(checkpoint: dict[str, Any]) -> str:
    """A short description of a full checkpoint's top-level keys, for error messages."""
    return ", ".join(sorted(str(k) for k in checkpoint)) or "no keys"
