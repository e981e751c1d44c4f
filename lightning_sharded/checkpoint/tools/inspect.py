"""``inspect_checkpoint``: what a checkpoint holds, without loading its tensors."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lightning_sharded.checkpoint import names
from lightning_sharded.checkpoint.detect import CheckpointKind, Found, detect
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.tools.reader import OfflineReader, leaves, load_full, read_meta

__all__ = ["CheckpointInfo", "EntryInfo", "inspect_checkpoint"]


# --------------------------------------------------------------------------------------- inspect


@dataclass
class EntryInfo:
    """One entry of a checkpoint.

    Attributes:
        key: DCP's flattened key (``state_dict.layer.weight``) or, in a full file, the dotted path.
        shape: Global shape, or ``None`` for a non-tensor object.
        dtype: ``torch.float32``... or ``"object"``.
        size: Bytes of the full tensor (or of the pickled object).
        shards: Number of chunks stored (1 in a full file).
    """

    key: str
    shape: list[int] | None
    dtype: str
    size: int
    shards: int


@dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` found.

    Attributes:
        path: The checkpoint read.
        kind: ``"sharded"`` or ``"full"``.
        entries: Every entry, sorted by key.
        total_size: Bytes of all entries.
        files: Files of the checkpoint (1 for a full file).
        disk_size: Bytes of those files.
        world_size: Ranks that wrote it (manifest, else the shard file names), ``None`` for a full file.
        epoch: Lightning epoch, when recorded.
        global_step: Lightning global step, when recorded.
        has_manifest: It has a lightning_sharded manifest.
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for ``lightning-sharded inspect --json``)."""
        return asdict(self)


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe a checkpoint without loading its tensors (sharded: ``.metadata`` and ``meta.pt`` only).

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: not a checkpoint, or ``.metadata`` / ``meta.pt`` unreadable.
    """
    found = detect(path)
    backend, real, kind = found.backend, found.data, found.kind
    if kind is CheckpointKind.FULL:
        return _inspect_full(found)
    reader = OfflineReader(backend, real)
    object_sizes: dict[str, int] = {}
    chunks: dict[str, int] = {}
    for index, info in (reader.metadata.storage_data or {}).items():
        object_sizes[index.fqn] = object_sizes.get(index.fqn, 0) + int(info.length)
        chunks[index.fqn] = chunks.get(index.fqn, 0) + 1
    entries = []
    for key, md in reader.tensors.items():
        numel = int(torch.Size(md.size).numel())
        itemsize = torch.empty((), dtype=md.properties.dtype).element_size()
        entries.append(
            EntryInfo(key, list(md.size), str(md.properties.dtype), numel * itemsize, len(md.chunks))
        )
    for key in reader.objects:
        entries.append(EntryInfo(key, None, "object", object_sizes.get(key, 0), chunks.get(key, 1)))
    entries.sort(key=lambda e: e.key)
    files = backend.list_files(real)
    info = CheckpointInfo(
        path=str(real),
        kind=kind.value,
        entries=entries,
        total_size=sum(e.size for e in entries),
        files=len(files),
        disk_size=sum(files.values()),
    )
    manifest = found.manifest
    if manifest is not None:
        info.has_manifest = True
        info.world_size, info.epoch, info.global_step = (
            manifest.world_size,
            manifest.epoch,
            manifest.global_step,
        )
    else:
        ranks = {r for name in files if (r := names.shard_rank(name)) is not None}
        info.world_size = max(ranks) + 1 if ranks else None
    if info.epoch is None and names.LIGHTNING_METADATA in files:
        meta = read_meta(backend, real, weights_only=False)
        info.epoch, info.global_step = meta.get("epoch"), meta.get("global_step")
    return info


def _inspect_full(found: Found) -> CheckpointInfo:
    backend, file = found.backend, found.data
    try:  # memory-mapped: the tensors are not read (an object is read whole)
        checkpoint = backend.torch_load(file, map_location="cpu", weights_only=False, mmap=True)
    except Exception:
        checkpoint = load_full(backend, file, "cpu", weights_only=False)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"The file {str(file)!r} holds a {type(checkpoint).__name__}, not a checkpoint dict."
        )
    entries = [
        EntryInfo(".".join(map(str, p)), list(t.shape), str(t.dtype), t.numel() * t.element_size(), 1)
        for p, t in leaves(checkpoint)
        if isinstance(t, torch.Tensor)
    ]
    entries.sort(key=lambda e: e.key)
    return CheckpointInfo(
        path=str(file),
        kind=CheckpointKind.FULL.value,
        entries=entries,
        total_size=sum(e.size for e in entries),
        files=1,
        disk_size=backend.size(file),
        epoch=checkpoint.get("epoch"),
        global_step=checkpoint.get("global_step"),
    )
