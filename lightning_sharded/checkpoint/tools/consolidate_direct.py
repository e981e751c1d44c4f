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

import bisect
import contextlib
import errno
import io
import itertools
import logging
import math
import os
import threading
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sharded.checkpoint import libc, names
from lightning_sharded.checkpoint.backends import Location
from lightning_sharded.checkpoint.backends.paths import local_path
from lightning_sharded.checkpoint.checksum import STREAMS, crc32, crc32_combine, pieces_crc
from lightning_sharded.checkpoint.dcp_index import object_archives
from lightning_sharded.checkpoint.destination import write_error
from lightning_sharded.checkpoint.detect import Found
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.integrity import ReadVerification
from lightning_sharded.checkpoint.progress import progress_bar
from lightning_sharded.checkpoint.tools import archive_writer
from lightning_sharded.checkpoint.tools.nested import drop_rank_state, to_lightning
from lightning_sharded.checkpoint.unpickling.without_torch import (
    NOT_READ,
    read_dcp_metadata,
    read_plain,
    record_start,
    stored_record,
    tensor_record,
    type_name,
)
from lightning_sharded.checkpoint.writeback import WINDOW, RangedWriteBehind

__all__ = ["BLOCK", "MAX_RUNS", "Plan", "plan"]

log = logging.getLogger(__name__)

#: Bytes read per call from a shard file (two buffers of it per part being read).
BLOCK = 8 << 20
#: The most runs (rows of chunks that are not whole rows) written one ``pwrite`` each; more leave the
#: checkpoint to the torch path, which places them in memory.
MAX_RUNS = 1 << 16
# A shard file of this size or more is read by STREAMS threads, each a contiguous part.
_SPLIT_FROM = 64 << 20
# The head and the tail of a tensor entry read to find its bytes: its pickle and zip directory.
_PEEK = 4096
_DCP = "torch.distributed.checkpoint.metadata."


@dataclass
class _Segment:
    """A chunk's bytes in a shard file (``start``, ``nbytes``), written to the output at ``outs[j]`` for
    run ``j`` of ``run`` bytes."""

    start: int
    nbytes: int
    storage: int
    run: int
    outs: list[int]

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass
class Plan:
    """What :func:`plan` found: the output archive's layout and every shard file's segments."""

    root: Location
    out: Location
    layout: archive_writer.Layout
    files: dict[str, tuple[Path, int, list[_Segment]]]  # relative path: (local path, size, segments)
    scattered: set[int]  # storages written in runs of rows: their CRC-32 is read back
    tensors_bytes: int
    pieces: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)

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
            _reserve(fd, self.layout.size)
            behind = RangedWriteBehind(fd, limit=STREAMS * WINDOW)
            parts = [
                (rel, path, start, end)
                for rel, (path, size, _) in sorted(self.files.items())
                for start, end in _cuts(size)
            ]
            total = sum(size for _, size, _ in self.files.values())
            stop = threading.Event()
            with (
                progress_bar(total, progress, desc) as tick,
                ThreadPoolExecutor(STREAMS, thread_name_prefix="lightning-sharded-consolidate") as pool,
            ):
                lock = threading.Lock()

                def ticked(n: int) -> None:
                    with lock:
                        tick(n)

                def copy(part: tuple[str, Path, int, int]) -> None:
                    try:
                        self._copy_part(*part, fd, behind, verification, ticked, stop)
                    except BaseException:
                        stop.set()
                        raise

                context = verification.reading() if verification is not None else contextlib.nullcontext()
                with context:
                    for _ in pool.map(copy, parts):
                        pass
            behind.finish()
            if verification is not None:
                verification.check()  # before the output is published (the caller publishes it)
            self.layout.patch_crcs(fd, self._crcs())
            os.fsync(fd)
            libc.fadvise(fd, 0, self.layout.size, "DONTNEED")
        finally:
            os.close(fd)

    def _copy_part(
        self,
        rel: str,
        path: Path,
        start: int,
        end: int,
        out: int,
        behind: RangedWriteBehind,
        verification: ReadVerification | None,
        tick: Callable[[int], None],
        stop: threading.Event,
    ) -> None:
        """Bytes ``start`` to ``end`` of the shard file ``rel``, read in blocks into two buffers: each block's
        chunk pieces written to their places (and every byte checksummed once) by a thread, while the
        next block is read."""
        blocks = _Blocks(self, self.files[rel][2], start, out, behind, verification is not None)
        size = min(BLOCK, max(end - start, 1))
        buffers = [memoryview(bytearray(size)) for _ in range(2)]
        position = start
        with (
            open(path, "rb", buffering=0) as f,
            ThreadPoolExecutor(1, thread_name_prefix="lightning-sharded-place") as placing,
        ):
            fd = f.fileno()
            libc.fadvise(fd, start, end - start, "SEQUENTIAL")
            placed = None
            while position < end and not stop.is_set():
                buffer = buffers[0]
                n = os.preadv(fd, [buffer[: end - position]], position)
                if not n:
                    raise CheckpointError(
                        f"The shard file {str(path)!r} of {str(self.root)!r} ended at byte {position}; its"
                        f" index says it holds {end}: it is truncated. Restore the checkpoint from a copy."
                    )
                libc.fadvise(fd, start, position + n - start, "DONTNEED")  # read: its pages are not needed
                if placed is not None:
                    placed.result()  # the other buffer is free again
                placed = placing.submit(blocks.place, buffer[:n], position)
                tick(n)
                position += n
                buffers.reverse()
            if placed is not None:
                placed.result()
        if verification is not None and position == end:
            verification.checksums.add(rel, start, end - start, blocks.crc)

    def _place(
        self, segment: _Segment, at: int, data: memoryview, crc: int, out: int, behind: RangedWriteBehind
    ) -> None:
        """Bytes ``at`` onwards of ``segment`` (``data``, whose CRC-32 is ``crc``) into the output."""
        if len(segment.outs) == 1:
            _pwrite_all(out, data, segment.outs[0] + at)
            behind.wrote(segment.outs[0] + at, len(data))
            self.pieces.setdefault(segment.storage, []).append((segment.outs[0] + at, len(data), crc))
            return
        run, done = segment.run, 0
        while done < len(data):
            j, into = divmod(at + done, run)
            n = min(run - into, len(data) - done)
            _pwrite_all(out, data[done : done + n], segment.outs[j] + into)
            behind.wrote(segment.outs[j] + into, n)
            done += n

    def _crcs(self) -> dict[int, int]:
        """Each storage's CRC-32 from its pieces, where they cover it exactly once (not a scattered one's)."""
        crcs = {
            i: pieces_crc(self.pieces.get(i, []), record.start, record.size)
            for i, record in enumerate(self.layout.storages)
            if i not in self.scattered
        }
        return {i: crc for i, crc in crcs.items() if crc is not None}


class _Blocks:
    """The blocks of one part of a shard file, in order: each chunk piece to its place in the output, every
    byte checksummed once (``crc``: the part's CRC-32, with ``verify``)."""

    def __init__(
        self,
        plan: Plan,
        segments: list[_Segment],
        start: int,
        out: int,
        behind: RangedWriteBehind,
        verify: bool,
    ) -> None:
        self._plan, self._segments, self._out, self._behind, self._verify = (
            plan,
            segments,
            out,
            behind,
            verify,
        )
        self._index = bisect.bisect_right([s.end for s in segments], start)
        self.crc = 0

    def place(self, block: memoryview, position: int) -> None:
        """The block of the file's bytes from ``position``."""
        segments, cursor, stop_at = self._segments, position, position + len(block)
        while cursor < stop_at:
            segment = segments[self._index] if self._index < len(segments) else None
            if segment is None or segment.start >= stop_at:
                upto, inside = stop_at, False
            elif segment.start > cursor:
                upto, inside = segment.start, False
            else:
                upto, inside = min(segment.end, stop_at), True
            data = block[cursor - position : upto - position]
            if inside:
                assert segment is not None
                piece = crc32(data)
                self._plan._place(segment, cursor - segment.start, data, piece, self._out, self._behind)
                if upto == segment.end:
                    self._index += 1
            else:
                piece = crc32(data) if self._verify else 0
            if self._verify:
                self.crc = crc32_combine(self.crc, piece, upto - cursor)
            cursor = upto


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _reserve(fd: int, size: int) -> None:
    """The file's blocks allocated now: a full disk fails here (``ENOSPC``), before the copy."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def _cuts(size: int) -> list[tuple[int, int]]:
    n = STREAMS if size >= _SPLIT_FROM else 1
    return [(k * size // n, (k + 1) * size // n) for k in range(n)]


# ----------------------------------------------------------------------------------------- planning


class _Declined(Exception):
    """Why the checkpoint is left to the torch path."""


def plan(found: Found, out: Location) -> Plan | str:
    """The plan of a consolidation without torch of the sharded checkpoint ``found`` into ``out``, or why
    there is none (the torch path then does it). Reads the index, ``meta.pt``, the non-tensor entries and the
    head and tail of each tensor entry; writes nothing, raises nothing."""
    try:
        return _plan(found, out)
    except _Declined as why:
        return str(why)
    except Exception as err:  # damage, or anything unforeseen: the torch path reads it and says what
        return f"{type(err).__name__}: {err}"


def _plan(found: Found, out: Location) -> Plan:
    root = local_path(found.data)
    if root is None:
        raise _Declined("not local files")
    if found.manifest is not None and found.manifest.frozen is not None:
        raise _Declined("a trainable-only checkpoint (its frozen part is read by torch)")
    with open(root / names.DCP_METADATA, "rb") as f:
        metadata = read_dcp_metadata(f)
    if metadata is None or type_name(metadata) != f"{_DCP}Metadata":
        raise _Declined("its index holds types only torch reads")
    meta = read_plain((root / names.LIGHTNING_METADATA).read_bytes(), lightning=True)
    if meta is NOT_READ or not isinstance(meta, dict):
        raise _Declined(f"{names.LIGHTNING_METADATA} holds more than plain data")
    meta = drop_rank_state(meta, found.data)
    entries = metadata.state_dict_metadata
    storage = {
        (index.fqn, tuple(index.offset or ())): info for index, info in (metadata.storage_data or {}).items()
    }
    objects: dict[str, Any] = {}
    for key, _, _, archive in object_archives(found.backend, found.data, metadata):
        objects[key] = read_plain(archive, lightning=True)
        if objects[key] is NOT_READ:
            raise _Declined(f"the entry {key!r} holds more than plain data")
    tensors = {k: v for k, v in entries.items() if type_name(v) == f"{_DCP}TensorStorageMetadata"}
    if set(entries) != set(objects) | set(tensors):
        raise _Declined("an entry is stored transformed or is of an unknown kind")
    placeholders: dict[str, archive_writer.Tensor] = {}
    chunks: list[tuple[str, Any, Any]] = []  # (key, chunk, its storage info)
    for key, md in sorted(tensors.items()):
        dtype = str(md.properties.dtype).removeprefix("torch.")
        if dtype not in archive_writer.DTYPES or str(md.properties.layout) != "torch.strided":
            raise _Declined(f"the tensor {key!r} is {md.properties.dtype} ({md.properties.layout})")
        shape = tuple(int(n) for n in md.size)
        placeholders[key] = archive_writer.Tensor(key, shape, dtype)
        covered = 0
        for chunk in md.chunks:
            info = storage.get((key, tuple(chunk.offsets)))
            if info is None or info.transform_descriptors:
                raise _Declined(f"a chunk of {key!r} has no plain stored bytes")
            sizes, offsets = tuple(int(n) for n in chunk.sizes), tuple(int(n) for n in chunk.offsets)
            if len(sizes) != len(shape) or any(
                o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)
            ):
                raise _Declined(f"a chunk of {key!r} lies outside it")
            covered += math.prod(sizes)
            chunks.append((key, chunk, info))
        if covered != math.prod(shape):
            raise _Declined(f"the chunks of {key!r} do not cover it once")
    mapping = dict(metadata.planner_data or {})
    checkpoint = to_lightning(
        {**objects, **placeholders}, meta, lambda key: tuple(mapping.get(key, (key,))), found.data
    )
    data_pkl, order = archive_writer.pickle_with_tensors(checkpoint)
    layout = archive_writer.layout(data_pkl, order)
    number = {tensor.key: i for i, tensor in enumerate(order)}
    starts = _chunk_starts(root, [(key, info, placeholders[key], chunk) for key, chunk, info in chunks])
    files: dict[str, tuple[Path, int, list[_Segment]]] = {}
    scattered: set[int] = set()
    runs = 0
    for (key, chunk, info), data_start in zip(chunks, starts, strict=True):
        tensor = placeholders[key]
        i = number[key]
        run, outs = _runs(tensor, chunk, layout.storages[i].start)
        if len(outs) > 1:
            scattered.add(i)
            runs += len(outs)
        rel = str(info.relative_path)
        if rel not in files:
            path = root / rel
            files[rel] = (path, path.stat().st_size, [])
        nbytes = math.prod(int(n) for n in chunk.sizes) * archive_writer.DTYPES[tensor.dtype][1]
        if nbytes:
            files[rel][2].append(_Segment(int(info.offset) + data_start, nbytes, i, run, outs))
    if runs > MAX_RUNS:
        raise _Declined(f"its chunks would be written in {runs} pieces")
    for rel, (_, size, segments) in files.items():
        segments.sort(key=lambda s: s.start)
        if any(a.end > b.start for a, b in itertools.pairwise(segments)) or (
            segments and segments[-1].end > size
        ):
            raise _Declined(f"the entries of {rel!r} overlap or run past its end")
    return Plan(found.data, out, layout, files, scattered, sum(t.nbytes for t in order if t.data is None))


def _runs(tensor: archive_writer.Tensor, chunk: Any, base: int) -> tuple[int, list[int]]:
    """Where a chunk's bytes go in the output, whose storage of ``tensor`` starts at ``base``: ``(run
    bytes, start of each run)``, one run for a chunk of whole rows."""
    shape, itemsize = tensor.shape, archive_writer.DTYPES[tensor.dtype][1]
    offsets, sizes = tuple(int(n) for n in chunk.offsets), tuple(int(n) for n in chunk.sizes)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    # the last dimension the chunk cuts: from there on, it is contiguous in the tensor
    cut = max((d for d in range(len(shape)) if sizes[d] != shape[d]), default=0)
    run = (sizes[cut] if shape else 1) * (strides[cut] if shape else 1) * itemsize
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    rows = itertools.product(*(range(n) for n in sizes[:cut]))  # C order; one empty row for none
    return run, [
        base + itemsize * (first + sum(i * s for i, s in zip(row, strides, strict=False))) for row in rows
    ]


def _chunk_starts(root: Path, items: list[tuple[str, Any, archive_writer.Tensor, Any]]) -> list[int]:
    """Where each chunk's bytes start in its entry, from the entry's zip directory and pickle (its head and
    tail read, several at a time); a ``_Declined`` for any entry that is not a plain contiguous chunk."""
    with ThreadPoolExecutor(8, thread_name_prefix="lightning-sharded-peek") as pool:
        return list(pool.map(lambda item: _chunk_start(root, *item), items))


def _chunk_start(root: Path, key: str, info: Any, tensor: archive_writer.Tensor, chunk: Any) -> int:
    offset, length = int(info.offset), int(info.length)
    with open(root / str(info.relative_path), "rb", buffering=0) as f:
        entry = _Entry(f.fileno(), offset, length)
        with zipfile.ZipFile(entry) as archive:
            infos = {i.filename: i for i in archive.infolist()}
            pickles = [name for name in infos if name.count("/") == 1 and name.endswith("/data.pkl")]
            if len(pickles) != 1 or any(name.endswith("/constants.pkl") for name in infos):
                raise _Declined(f"the entry {key!r} is not a torch.save archive")
            prefix = pickles[0][: -len("data.pkl")]
            if stored_record(archive, infos.get(prefix + "byteorder")) != b"little":
                raise _Declined(f"the entry {key!r} is not little-endian")
            found = tensor_record(stored_record(archive, infos[pickles[0]]) or b"")
        sizes = tuple(int(n) for n in chunk.sizes)
        if found is None or found.dtype != tensor.dtype or found.shape != sizes:
            raise _Declined(f"a chunk of {key!r} is not its contiguous {tensor.dtype} bytes")
        nbytes = found.nbytes
        record = infos.get(f"{prefix}data/{found.key}")
        if record is None or record.compress_type != zipfile.ZIP_STORED or record.file_size != nbytes:
            raise _Declined(f"the entry {key!r} has no stored record of its bytes")
        start = record_start(entry, record)
        if start is None:
            raise _Declined(f"the entry {key!r} has a damaged zip record")
        if start + nbytes > length:
            raise _Declined(f"the entry {key!r} is cut short")
        return start


class _Entry(io.RawIOBase):
    """One entry of a shard file (bytes ``offset`` to ``offset + length``) as a file of its own, its head
    and tail read once, any other byte read when asked for."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self._at = fd, offset, length, 0
        self._head = os.pread(fd, min(_PEEK, length), offset)
        tail = min(_PEEK, length)
        self._tail_start = length - tail
        self._tail = os.pread(fd, tail, offset + self._tail_start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._at = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence] + offset
        return self._at

    def read(self, size: int | None = -1) -> bytes:
        end = self._length if size is None or size < 0 else min(self._length, self._at + size)
        start, self._at = self._at, max(self._at, end)
        if start >= end:
            return b""
        if end <= len(self._head):
            return self._head[start:end]
        if start >= self._tail_start:
            return self._tail[start - self._tail_start : end - self._tail_start]
        return os.pread(self._fd, end - start, self._offset + start)

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)
