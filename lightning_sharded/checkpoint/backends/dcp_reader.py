"""A DCP storage reader that reads each tensor's bytes straight into the tensor it loads into.

torch's ``FileSystemReader`` loads every stored tensor with ``torch.load`` (a new tensor, its pages
faulted in, the bytes copied from the page cache) and then copies it into the target: two copies and
a fresh allocation per tensor, which caps a resume at about half the disk's read bandwidth here.
DCP stores each tensor as a small ``torch.save`` zip archive whose storage record is kept
uncompressed; :class:`DirectReader` reads the tensor's metadata only (``map_location="meta"``),
finds the storage record, and ``readinto``-s its bytes into the target's memory: one copy, no
allocation. Items it cannot do exactly that way (byte items, tensors that are views, narrowed
reads, dtype or layout differences, extensions) go through torch's own path, item by item.

Both readers here (:class:`DirectReader` locally, :func:`fsspec_reader` for URLs) can be given the
checkpoint's DCP ``Metadata`` (``.metadata``) already read: ``read_metadata``, which DCP calls on every
rank of every load, then returns it without touching storage. A load reads ``.metadata`` once, on rank
0, and broadcasts it (:func:`~lightning_sharded.checkpoint.load.sharded.restore_sharded`); without that,
N ranks each read it once per ``dcp.load`` call (the model, then each optimizer): a metadata storm on a
parallel file system, N GET requests (and as many HEAD) per call on S3.
"""

from __future__ import annotations

import contextlib
import copy
import os
import struct
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.utils import _create_file_view

__all__ = ["DirectReader", "GivenMetadata", "fsspec_reader"]

# Smaller tensors are not worth the zip parsing: torch's path.
_DIRECT_FROM = 1 << 20
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = b"PK\x03\x04"
_DESCRIPTOR_MAGIC = b"PK\x07\x08"
# Items whose reading is requested ahead of the one being copied, so the disk queue is not empty
# while an item's bytes are copied and the next one's header is parsed.
_AHEAD_ITEMS = 2
# How much of an archive's start to read to find its storage record (the pickle comes first).
_HEAD_BYTES = 1 << 16


def _storage_location(file: Any, base: int, length: int, nbytes: int) -> int | None:
    """Absolute file offset of the bytes of the storage record of a ``torch.save`` archive, or None.

    torch writes the small records first (the pickle, versions), then ``<archive>/data/0``, stored
    uncompressed, each followed by a data descriptor (sizes are not in the local headers). The record
    is found by its local header near the start, and confirmed by the descriptor right after its
    ``nbytes`` bytes (signature and size): anything unexpected returns None.
    """
    head = os.pread(file.fileno(), min(length, _HEAD_BYTES), base)
    position = head.find(_LOCAL_HEADER_MAGIC)
    while position != -1 and position + _LOCAL_HEADER.size <= len(head):
        fields = _LOCAL_HEADER.unpack_from(head, position)
        method, name_len, extra_len = fields[3], fields[9], fields[10]
        start = position + _LOCAL_HEADER.size
        if head[start : start + name_len].endswith(b"/data/0"):
            data = start + name_len + extra_len
            if method != 0 or data + nbytes + 16 > length:
                return None
            tail = os.pread(file.fileno(), 24, base + data + nbytes)
            if tail[:4] != _DESCRIPTOR_MAGIC:
                return None
            size32 = struct.unpack_from("<I", tail, 8)[0]
            size64 = struct.unpack_from("<Q", tail, 8)[0] if len(tail) >= 16 else -1
            return base + data if nbytes in (size32, size64) else None
        position = head.find(_LOCAL_HEADER_MAGIC, position + 4)
    return None


def _will_need(file: Any, info: Any) -> None:
    """Ask the kernel to start reading an item's bytes now (``POSIX_FADV_WILLNEED``; no-op elsewhere)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        with contextlib.suppress(OSError):
            advise(file.fileno(), info.offset, info.length, os.POSIX_FADV_WILLNEED)


def _readinto(file: Any, offset: int, target: torch.Tensor) -> bool:
    view = memoryview(cast(Any, target.view(torch.uint8).reshape(-1).numpy())).cast("B")
    file.seek(offset)
    done = 0
    while done < len(view):
        n = file.readinto(view[done:])
        if not n:
            return False
        done += n
    return True


class GivenMetadata:
    """A DCP ``StorageReader`` mixin: ``read_metadata`` returns the ``Metadata`` given at construction.

    Args:
        *args: the reader's own arguments (the checkpoint's path or URL...).
        metadata: the checkpoint's DCP ``Metadata``, read once elsewhere (rank 0) and shared; ``None``
            reads ``.metadata`` from storage as the reader would.
        **kwargs: the reader's own keyword arguments.
    """

    load_id: str

    def __init__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._given_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        given = self._given_metadata
        if given is None or kwargs.get("rank") is not None:  # per-rank metadata: the reader's own
            return super().read_metadata(*args, **kwargs)  # type: ignore[misc]
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = copy.copy(given)  # this load's id on a copy: the same Metadata serves every load
        storage_meta = getattr(given, "storage_meta", None)
        metadata.storage_meta = copy.copy(storage_meta) if storage_meta is not None else StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DirectReader(GivenMetadata, FileSystemReader):
    """``FileSystemReader`` that reads large tensors directly into their targets (see the module doc).

    ``metadata=`` (keyword): the checkpoint's DCP ``Metadata`` already read, see :class:`GivenMetadata`.
    """

    def read_data(self, plan: Any, planner: Any) -> Any:
        fallback = []
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            path = self.fs.concat_path(self.path, relative_path)
            with open(os.fspath(path), "rb", buffering=0) as file:
                ordered = sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset)
                advised = 0
                for position, req in enumerate(ordered):
                    # Read-ahead: the disk fetches the next items while this one is copied.
                    while advised < min(len(ordered), position + 1 + _AHEAD_ITEMS):
                        _will_need(file, self.storage_data[ordered[advised].storage_index])
                        advised += 1
                    if not self._read_direct(file, req, planner):
                        fallback.append(req)
        if fallback:
            return super().read_data(type(plan)(fallback, plan.storage_data, plan.planner_data), planner)
        return super().read_data(type(plan)([], plan.storage_data, plan.planner_data), planner)

    def _read_direct(self, file: Any, req: Any, planner: Any) -> bool:
        info = self.storage_data[req.storage_index]
        if req.type == LoadItemType.BYTE_IO or info.transform_descriptors or info.length < _DIRECT_FROM:
            return False
        view = cast(IO[bytes], _create_file_view(file, info.offset, info.length))
        try:
            meta = torch.load(view, map_location="meta", weights_only=True)
        except Exception:
            return False
        if not isinstance(meta, torch.Tensor) or meta.storage_offset() != 0 or not meta.is_contiguous():
            return False
        nbytes = meta.numel() * meta.element_size()
        if meta.untyped_storage().nbytes() != nbytes or any(req.storage_offsets):
            return False
        if list(req.lengths) != list(meta.shape):
            return False
        target = planner.resolve_tensor(req).detach()
        if (
            target.device.type != "cpu"
            or target.dtype != meta.dtype
            or target.shape != meta.shape
            or not target.is_contiguous()
            or target.dim() == 0
        ):
            return False
        offset = _storage_location(file, info.offset, info.length, nbytes)
        if offset is None or not _readinto(file, offset, target):
            return False
        planner.commit_tensor(req, target)
        return True


_fsspec_reader_class: Any = None


def fsspec_reader(url: str, metadata: Any = None) -> Any:
    """torch's ``FsspecReader`` for ``url``, returning ``metadata`` (when given) from ``read_metadata``.

    Made on first use: importing torch's fsspec reader imports fsspec.
    """
    global _fsspec_reader_class
    if _fsspec_reader_class is None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        _fsspec_reader_class = type("SharedMetadataFsspecReader", (GivenMetadata, FsspecReader), {})
    return _fsspec_reader_class(url, metadata=metadata)
