"""``inspect_checkpoint``: what a checkpoint holds, without reading its tensors, after checking its files."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_sharded.checkpoint import hf_layout, names, unpickling
from lightning_sharded.checkpoint.backends import join
from lightning_sharded.checkpoint.dcp_index import (
    model_key,
    object_archives,
    read_index,
    tensor_entries,
    top_level_keys,
)
from lightning_sharded.checkpoint.detect import (
    CheckpointKind,
    Found,
    checkpoint_files,
    detect,
    not_a_checkpoint,
)
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.integrity import check_found
from lightning_sharded.checkpoint.lightning_meta import read_meta
from lightning_sharded.checkpoint.problems import damaged
from lightning_sharded.checkpoint.unpickling import without_torch

if TYPE_CHECKING:
    import torch

# A sharded checkpoint of tensors and plain data is described without importing torch (1.3 s on a
# 2-core machine): its `.metadata`, values and meta.pt are read by `unpickling.without_torch` where it
# can. torch and the readers that need it are imported where they are used.

__all__ = ["CheckpointInfo", "EntryInfo", "inspect_checkpoint"]

log = logging.getLogger(__name__)

#: Longest value representation ``inspect`` shows for a non-tensor entry.
VALUE_WIDTH = 60


@dataclass
class EntryInfo:
    """One entry of a checkpoint.

    Attributes:
        key: DCP's flattened key (``state_dict.layer.weight``) or, in a full file, the dotted path.
        shape: Global shape, or ``None`` for a non-tensor value.
        dtype: ``torch.float32``..., or the type of a non-tensor value (``float``, ``list``...).
        size: Bytes of the full tensor; 0 for a non-tensor value.
        shards: Number of chunks stored (1 in a full file).
        value: A non-tensor value, as ``repr`` shows it (cut at :data:`VALUE_WIDTH` characters);
            ``None`` for a tensor.
    """

    key: str
    shape: list[int] | None
    dtype: str
    size: int
    shards: int
    value: str | None = None


@dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` found.

    Attributes:
        path: The checkpoint read.
        kind: ``"sharded"``, ``"full"`` or ``"safetensors"`` (Hugging Face weights: a directory of
            ``.safetensors`` files, or one; their tensors are listed from the headers).
        entries: Every entry, sorted by key.
        total_size: Bytes of all tensor entries.
        files: Files of the checkpoint, the manifest included (1 for a full file), counted as ``verify``
            counts them (:func:`~lightning_sharded.checkpoint.detect.checkpoint_files`).
        disk_size: Bytes of those files.
        world_size: Ranks that wrote it (manifest, else the shard file names), ``None`` for a full file.
        epoch: Lightning epoch, when recorded.
        global_step: Lightning global step, when recorded.
        has_manifest: It has a lightning_sharded manifest.
        rank_state_ranks: Number of ranks whose own state (RNG, train dataloader) the checkpoint holds
            (``save_rank_state``); ``None`` when it holds none. Not listed in ``entries``.
        not_unpickled: Entries that hold a type a safe load refuses, by key (dotted path in the
            Lightning checkpoint dict), with that type; they are listed in ``entries`` with dtype
            ``"not unpickled"`` and nothing of them was unpickled. Empty when everything opened.
        frozen: A trainable-only checkpoint (``save_trainable_only``): the model keys it does not hold
            and where a load reads them from (``{"source", "keys", "prefix"}``); ``None`` for a
            complete checkpoint.
    """

    path: str
    kind: str
    entries: list[EntryInfo] = field(default_factory=list)
    total_size: int = 0
    files: int = 0
    disk_size: int = 0
    world_size: int | None = None
    epoch: int | None = None
    global_step: int | None = None
    has_manifest: bool = False
    rank_state_ranks: int | None = None
    not_unpickled: dict[str, str] = field(default_factory=dict)
    frozen: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for ``lightning-sharded inspect --json``)."""
        return asdict(self)


def _value_entry(key: str, value: Any, shards: int = 1) -> EntryInfo:
    text = repr(value)
    if len(text) > VALUE_WIDTH:
        text = text[: VALUE_WIDTH - 3] + "..."
    return EntryInfo(key, None, type(value).__name__, 0, shards, text)


def _tensor_entry(key: str, tensor: torch.Tensor) -> EntryInfo:
    return EntryInfo(key, list(tensor.shape), str(tensor.dtype), tensor.numel() * tensor.element_size(), 1)


def inspect_checkpoint(path: str | os.PathLike[str], *, weights_only: bool | None = True) -> CheckpointInfo:
    """Describe a checkpoint without reading its tensors, after checking that its files are whole.

    Sharded: checks every file's presence and size (from the manifest, or from ``.metadata``), then
    reads ``.metadata``, the manifest, ``meta.pt`` and the small non-tensor entries (the optimizers'
    ``param_groups``), which are shown as values. Full: memory-mapped, so the tensors are not read.
    Hugging Face weights (a ``.safetensors`` file or a directory of them): names, dtypes and shapes
    from the headers (and the index), after checking that every file is as long as its header says.

    A ``meta.pt`` or full file that holds a type a safe load refuses is still described: it is read
    again with every refused object left as a placeholder (no code runs), and those entries are
    listed in ``not_unpickled``.

    Args:
        path: A sharded checkpoint directory, a full checkpoint file, or Hugging Face weights.
        weights_only: ``True`` (or ``None``): pickles are read safely, as in ``load_checkpoint``;
            ``False`` unpickles anything, running the file's code.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: not a checkpoint; a file missing or of another size (named, with its rank);
            ``.metadata`` or ``meta.pt`` unreadable; or (with ``weights_only``) ``.metadata`` holds a
            type that is not allowed.
    """
    started = time.perf_counter()
    found = detect(path, safetensors=True)
    if found.kind is CheckpointKind.FULL:
        info = _inspect_full(found, weights_only)
    elif found.kind is CheckpointKind.SAFETENSORS:
        info = _inspect_safetensors(found)
    else:
        info = _inspect_sharded(found, weights_only)
    info.entries.sort(key=lambda e: e.key)
    info.total_size = sum(e.size for e in info.entries)
    log.info(
        "Inspected %s (%d entries) in %.2fs", found.data, len(info.entries), time.perf_counter() - started
    )
    return info


def _inspect_sharded(found: Found, weights_only: bool | None) -> CheckpointInfo:
    check_found(found, alone=True, weights_only=weights_only)  # presence and sizes: cheap, no data read
    files = checkpoint_files(found)
    backend, root = found.backend, found.data
    metadata = read_index(backend, root, weights_only=weights_only, standins=True)
    model_key(top_level_keys(metadata), root)  # the one rule: neither model key, or both, is refused
    chunks = Counter(index.fqn for index in metadata.storage_data or {})
    tensors = tensor_entries(metadata)
    info = CheckpointInfo(
        path=str(root),
        kind=found.kind.value,
        entries=[
            EntryInfo(
                key,
                list(md.size),
                str(md.properties.dtype),
                math.prod(md.size) * md.properties.dtype.itemsize,
                len(md.chunks),
            )
            for key, md in tensors.items()
        ],
        files=len(files),
        disk_size=sum(files.values()),
        has_manifest=found.manifest is not None,
        rank_state_ranks=sum(1 for name in files if names.RANK_STATE_FILE.match(name)) or None,
    )
    values = {  # the plain entries (the optimizers' param groups), read without torch
        fqn: value
        for fqn, _, _, archive in object_archives(backend, root, metadata)
        if (value := without_torch.read_plain(archive)) is not without_torch.NOT_READ
    }
    reader = None
    # One at a time, so a refused entry leaves the others shown.
    for key in sorted(k for k in metadata.state_dict_metadata if k not in tensors):
        if key in values:
            info.entries.append(_value_entry(key, values[key], chunks.get(key, 1)))
            continue
        if reader is None:
            from lightning_sharded.checkpoint.tools.reader import OfflineReader

            reader = OfflineReader(backend, root, weights_only)
        try:
            value = reader.read_objects([key])[key]
        except unpickling.RefusedPickleError as err:
            info.not_unpickled[key] = err.name
            info.entries.append(EntryInfo(key, None, "not unpickled", 0, chunks.get(key, 1)))
        else:
            info.entries.append(_value_entry(key, value, chunks.get(key, 1)))
    manifest = found.manifest
    if manifest is not None:
        info.frozen = manifest.frozen.to_dict() if manifest.frozen is not None else None
        info.world_size = manifest.world_size
        info.epoch, info.global_step = manifest.epoch, manifest.global_step
    else:
        ranks = {r for name in files if (r := names.shard_rank(name)) is not None}
        info.world_size = max(ranks) + 1 if ranks else None
    if info.epoch is None and names.LIGHTNING_METADATA in files:
        meta_file = join(root, names.LIGHTNING_METADATA)
        meta = without_torch.NOT_READ  # plain data (no tensor) is read without torch; else by read_meta
        with contextlib.suppress(OSError), backend.open_file(meta_file) as f:
            meta = without_torch.read_plain(f)
        try:
            if not isinstance(meta, dict):
                meta = read_meta(backend, meta_file, weights_only, safe=True)
        except unpickling.RefusedPickleError:
            meta = unpickling.inert_load(meta_file, load=backend.torch_load, map_location="cpu")
            _mark_not_unpickled(info, meta)
        info.epoch, info.global_step = meta.get("epoch"), meta.get("global_step")
    return info


def _mark_not_unpickled(info: CheckpointInfo, checkpoint: Any) -> None:
    """List the placeholders of an :func:`unpickling.inert_load` result in ``info``."""
    from lightning_sharded.checkpoint.tools.reader import leaves

    for p, leaf in leaves(checkpoint):
        if isinstance(leaf, unpickling.NotUnpickled):
            key = ".".join(map(str, p))
            info.not_unpickled[key] = leaf.name
            info.entries.append(EntryInfo(key, None, "not unpickled", 0, 1))


def _inspect_full(found: Found, weights_only: bool | None) -> CheckpointInfo:
    import torch

    from lightning_sharded.checkpoint.load.checks import frozen_of
    from lightning_sharded.checkpoint.tools.reader import leaves, load_full, safe_torch_load

    backend, file = found.backend, found.data
    refused = False
    try:  # memory-mapped: the tensors are not read (an object is read whole)
        checkpoint = safe_torch_load(backend, file, weights_only, map_location="cpu", mmap=True)
    except unpickling.RefusedPickleError:
        refused = True
        checkpoint = unpickling.inert_load(file, load=backend.torch_load, map_location="cpu", mmap=True)
    except CheckpointError:
        raise
    except Exception:
        checkpoint = load_full(backend, file, "cpu", weights_only)
    if not isinstance(checkpoint, dict):
        raise not_a_checkpoint(file, "file", f"it holds a {type(checkpoint).__name__}, not a checkpoint dict")
    # The state a sharded checkpoint keeps in DCP (a list of plain values is one value), then the
    # tensors of the rest (a callback's best score...).
    model = {key: checkpoint[key] for key in ("state_dict", "optimizer_states") if key in checkpoint}
    skipped = (*model, names.RANK_STATE_KEY, names.FROZEN_KEY)
    rest = {k: v for k, v in checkpoint.items() if k not in skipped}
    entries = [
        _tensor_entry(".".join(map(str, path)), leaf)
        if isinstance(leaf, torch.Tensor)
        else _value_entry(".".join(map(str, path)), leaf)
        for path, leaf in leaves(model, plain=True)
    ]
    entries += [
        _tensor_entry(".".join(map(str, p)), leaf)
        for p, leaf in leaves(rest)
        if isinstance(leaf, torch.Tensor)
    ]
    rank_state = checkpoint.get(names.RANK_STATE_KEY)
    ranks = rank_state.get("ranks") if isinstance(rank_state, dict) else None
    frozen = frozen_of(checkpoint, str(file))
    info = CheckpointInfo(
        path=str(file),
        kind=CheckpointKind.FULL.value,
        entries=entries,
        files=1,
        disk_size=sum(checkpoint_files(found).values()),
        epoch=checkpoint.get("epoch"),
        global_step=checkpoint.get("global_step"),
        rank_state_ranks=len(ranks) if isinstance(ranks, list) and ranks else None,
        frozen=frozen.to_dict() if frozen is not None else None,
    )
    if refused:
        _mark_not_unpickled(info, checkpoint)
    return info


def _inspect_safetensors(found: Found) -> CheckpointInfo:
    """Hugging Face weights: every tensor's key, dtype and shape from the headers; no tensor read."""
    from lightning_sharded.checkpoint.tools.safetensors_format import TORCH_NAMES

    listing = hf_layout.list_weights(found.backend, found.data)
    error = damaged(found.data, listing.problems)
    if error is not None:
        raise error
    entries = [  # a dtype torch does not have keeps its safetensors name
        EntryInfo(key, list(t.shape), _torch_name(t.dtype, TORCH_NAMES), t.end - t.begin, 1)
        for key, (_, t) in sorted(listing.tensors.items())
    ]
    files = checkpoint_files(found)
    return CheckpointInfo(
        path=str(found.data),
        kind=CheckpointKind.SAFETENSORS.value,
        entries=entries,
        files=len(files),
        disk_size=sum(files.values()),
        has_manifest=found.manifest is not None,
    )


def _torch_name(dtype: str, names: dict[str, str]) -> str:
    """``"torch.bfloat16"`` for the safetensors dtype ``"BF16"``; one torch lacks keeps its name."""
    return f"torch.{names[dtype]}" if dtype in names else dtype
