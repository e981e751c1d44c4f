"""``consolidate`` without torch: the shard files read once, in order, their tensors' bytes written straight
into a full checkpoint file written without torch.

``import torch`` takes 2 s on a 2-core machine, as long as copying a 2 GB checkpoint; and a sharded
checkpoint's tensors are bytes that only need moving. Each DCP tensor entry is a ``torch.save`` archive
of one contiguous chunk; its bytes belong at a known place of the output (its chunk's offsets in the
full tensor), in one run for a chunk of whole rows (FSDP's, the usual) or in a run per row otherwise.

1. :func:`plan` decides, before anything is written, and only where the answer is certain to be the
   one the torch path (:mod:`.consolidate_mapped`) gives: a local checkpoint, its ``.metadata``,
   ``meta.pt`` and every non-tensor entry plain data (:mod:`~..unpickling.without_torch`), every tensor
   entry a chunk of a common dtype in a plain archive (checked from its own zip directory and pickle),
   the chunks covering every tensor, no frozen part. Anything else returns why, and the caller uses
   the torch path, which gives every other answer and error.
2. :meth:`Plan.write` writes the archive's frame (:mod:`.archive_writer`), then reads each shard file
   in :data:`BLOCK` pieces, in contiguous parts on :data:`~..checksum.STREAMS` threads, the page cache
   dropped behind; every chunk piece goes to its place with ``pwrite`` and write-back started behind
   it. Each byte is checksummed once: the pieces' CRC-32s give the files' (with ``verify``) and the
   output records' (``crc32_combine``); a record written in runs of rows is read back instead.
   Memory: one block per thread, whatever the tensors' sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sharded.checkpoint import libc, names
from lightning_sharded.checkpoint.backends import Location
from lightning_sharded.checkpoint.dcp_index import object_archives
from lightning_sharded.checkpoint.destination import write_error
from lightning_sharded.checkpoint.detect import Found
from lightning_sharded.checkpoint.integrity import ReadVerification
from lightning_sharded.checkpoint.tools import archive_writer
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
from lightning_sharded.checkpoint.tools.nested import drop_rank_state, to_lightning
from lightning_sharded.checkpoint.unpickling.without_torch import (
    NOT_READ,
    read_plain,
    type_name,
)

__all__ = ["Plan", "plan"]


@dataclass
class Plan:
    """What :func:`plan` found: the output archive's layout and every shard file's segments."""

    root: Location
    out: Location
    layout: archive_writer.Layout
    files: Files  # relative path: (local path, size, segments)
    tensors_bytes: int

    def write(
        self, tmp: Path, verification: ReadVerification | None, progress: bool | None, desc: str
    ) -> None:
        """The output at ``tmp``: its frame, every chunk at its place, the records' CRC-32s; with a
        ``verification``, every shard file's checksum compared before this returns."""
        unwritable: OSError | None = None
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as err:
            unwritable = write_error(self.out, err)
        if unwritable is not None:  # the torch path's error (torch.save's open fails with no errno), with
            unwritable.errno = None  # no OSError behind it: commit_file raises it as it is
            raise unwritable
        try:
            self.layout.write_frame(fd)
            libc.reserve(fd, self.layout.size)
            copy = Copy(self.root, self.files, [fd])
            copy.run(verification, progress, desc)  # checked before the caller publishes the output
            crcs = {
                i: copy.crc(0, i, record.start, record.size) for i, record in enumerate(self.layout.storages)
            }
            self.layout.patch_crcs(fd, {i: crc for i, crc in crcs.items() if crc is not None})
            os.fsync(fd)
            libc.fadvise(fd, 0, self.layout.size, "DONTNEED")
        finally:
            os.close(fd)


def plan(found: Found, out: Location) -> Plan | str:
    """The plan of a consolidation without torch of the sharded checkpoint ``found`` into ``out``, or why
    there is none (the torch path then does it). Reads the index, ``meta.pt``, the non-tensor entries and the
    head and tail of each tensor entry; writes nothing, raises nothing."""
    return attempt(lambda: _plan(found, out))


def _plan(found: Found, out: Location) -> Plan:
    root, metadata = local_index(found)
    meta = read_plain((root / names.LIGHTNING_METADATA).read_bytes(), lightning=True)
    if meta is NOT_READ or not isinstance(meta, dict):
        raise Declined(f"{names.LIGHTNING_METADATA} holds more than plain data")
    meta = drop_rank_state(meta, found.data)
    entries = metadata.state_dict_metadata
    objects: dict[str, Any] = {}
    for key, _, _, archive in object_archives(found.backend, found.data, metadata):
        objects[key] = read_plain(archive, lightning=True)
        if objects[key] is NOT_READ:
            raise Declined(f"the entry {key!r} holds more than plain data")
    tensors = {k: v for k, v in entries.items() if type_name(v) == f"{DCP}TensorStorageMetadata"}
    if set(entries) != set(objects) | set(tensors):
        raise Declined("an entry is stored transformed or is of an unknown kind")
    chunks = tensor_chunks(metadata, sorted(tensors))
    placeholders: dict[str, archive_writer.Tensor] = {}
    for key, md in sorted(tensors.items()):
        dtype = str(md.properties.dtype).removeprefix("torch.")
        if dtype not in archive_writer.DTYPES:
            raise Declined(f"the tensor {key!r} is {md.properties.dtype}")
        placeholders[key] = archive_writer.Tensor(key, tuple(int(n) for n in md.size), dtype)
    mapping = dict(metadata.planner_data or {})
    checkpoint = to_lightning(
        {**objects, **placeholders}, meta, lambda key: tuple(mapping.get(key, (key,))), found.data
    )
    data_pkl, order = archive_writer.pickle_with_tensors(checkpoint)
    layout = archive_writer.layout(data_pkl, order)
    placed = [
        Placed(t.key, t.shape, t.dtype, archive_writer.DTYPES[t.dtype][1], 0, i, layout.storages[i].start)
        for i, t in enumerate(order)
        if t.data is None and t.key in placeholders
    ]
    files = segments(root, placed, chunks)
    return Plan(found.data, out, layout, files, sum(t.nbytes for t in order if t.data is None))
