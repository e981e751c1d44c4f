"""The safetensors export without torch: a sharded checkpoint's model tensors moved straight from its shard
files into the weights files (:mod:`.direct_copy`), each shard file read once, in order.

A safetensors file is its header (every key's dtype, shape and place, known from the DCP index) and
then the tensors' bytes, uncast and contiguous: bytes a chunk of the checkpoint holds as they are.
:func:`plan` decides before anything is written, and only where the answer is certain to be the one the
torch path (:mod:`.hf_export_torch`) gives: local files, an index of plain data, every model tensor
(of those under the prefix) of a dtype safetensors stores in plain stored chunks that cover it, no
cast (``dtype`` given and a floating tensor of another dtype), no frozen part. Anything else returns
why, and the torch path gives every other answer and error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sharded.checkpoint import libc
from lightning_sharded.checkpoint.checksum import crc32, hex_crc, pieces_crc
from lightning_sharded.checkpoint.dcp_index import model_key, top_level_keys
from lightning_sharded.checkpoint.detect import Found
from lightning_sharded.checkpoint.integrity import ReadVerification
from lightning_sharded.checkpoint.tools.direct_copy import (
    DCP,
    Copy,
    Declined,
    Files,
    Placed,
    attempt,
    local_index,
    segments,
    tensor_chunks,
)
from lightning_sharded.checkpoint.tools.safetensors_format import (
    FLOATING,
    ST_DTYPES,
    Entry,
    encode_header,
    file_name,
    plan_files,
    storage_order,
)
from lightning_sharded.checkpoint.unpickling.without_torch import type_name

__all__ = ["DirectWeights", "plan"]


@dataclass
class DirectWeights:
    """What :func:`plan` found: each weights file's tensors in order and header, and every shard file's
    segments; :meth:`write` writes them, with a :attr:`verification` when it is set."""

    found: Found
    files: list[list[Entry]]
    headers: list[bytes]
    sizes: list[int]
    shards: Files
    skipped: list[str]
    verification: ReadVerification | None = None

    def write(
        self, staging: Path, progress: bool | None, desc: str
    ) -> tuple[dict[str, tuple[int, str]], dict[str, str]]:
        """Every weights file in ``staging``: its header, each chunk at its place; with a
        :attr:`verification`, every shard file's checksum compared before this returns. Returns each file's
        size and checksum (where its pieces give it; another is read back by the commit) and each key's
        file."""
        names_ = [file_name(i, len(self.files)) for i in range(1, len(self.files) + 1)]
        fds: list[int] = []
        try:
            for name, header, size in zip(names_, self.headers, self.sizes, strict=True):
                fds.append(os.open(staging / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
                os.ftruncate(fds[-1], size)
                libc.pwrite_all(fds[-1], header, 0)
                libc.reserve(fds[-1], size)
            copy = Copy(self.found.data, self.shards, fds)
            copy.run(self.verification, progress, desc)  # checked before the commit publishes the directory
            written: dict[str, tuple[int, str]] = {}
            for target, (name, header, size) in enumerate(zip(names_, self.headers, self.sizes, strict=True)):
                crc = pieces_crc([(0, len(header), crc32(header)), *copy.pieces_of(target)], 0, size)
                if crc is not None:
                    written[name] = (size, hex_crc(crc))
                os.fsync(fds[target])
                libc.fadvise(fds[target], 0, size, "DONTNEED")
        finally:
            for fd in fds:
                os.close(fd)
        weight_map = {e.key: name for name, group in zip(names_, self.files, strict=True) for e in group}
        return written, weight_map


def plan(found: Found, prefix: str, target: str | None, max_bytes: int) -> DirectWeights | str:
    """The export without torch of the model tensors under ``prefix`` of ``found`` (cast to ``target``:
    only where none needs a cast), in files of at most ``max_bytes``; or why there is none (the torch path
    then does it). Reads the index and the head and tail of each model tensor's entries; writes nothing,
    raises nothing."""
    return attempt(lambda: _plan(found, prefix, target, max_bytes))


def _plan(found: Found, prefix: str, target: str | None, max_bytes: int) -> DirectWeights:
    root, metadata = local_index(found)
    top = model_key(top_level_keys(metadata), found.data)
    mapping: dict[str, Any] = dict(metadata.planner_data or {})
    tensors: dict[str, Entry] = {}
    skipped: list[str] = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        path = tuple(mapping.get(key, (key,)))
        if str(path[0]) != top:
            continue
        if type_name(md) != f"{DCP}TensorStorageMetadata":
            skipped.append(key)
            continue
        name = ".".join(map(str, path[1:]))
        if not name.startswith(prefix):
            continue
        dtype = str(md.properties.dtype).removeprefix("torch.")
        if dtype not in ST_DTYPES:
            raise Declined(f"the tensor {key!r} is {md.properties.dtype}")
        if target is not None and dtype in FLOATING and dtype != target:
            raise Declined(f"the tensor {key!r} is cast from {dtype} to {target} (torch casts)")
        tensors[key] = Entry(name[len(prefix) :], tuple(int(n) for n in md.size), dtype)
    if not tensors:
        raise Declined("no model tensor to export")
    source = {entry.key: key for key, entry in tensors.items()}
    files = plan_files(list(tensors.values()), max_bytes)
    headers, sizes, placed = [], [], []
    for index, group in enumerate(files):
        ordered = storage_order(group)
        headers.append(encode_header(ordered))
        offset = len(headers[-1])
        for storage, entry in enumerate(ordered):
            itemsize = ST_DTYPES[entry.dtype][1]
            placed.append(
                Placed(source[entry.key], entry.shape, entry.dtype, itemsize, index, storage, offset)
            )
            offset += entry.nbytes
        sizes.append(offset)
    chunks = tensor_chunks(metadata, sorted(tensors))
    shards = segments(root, placed, chunks)
    return DirectWeights(found, files, headers, sizes, shards, skipped)
