"""A sharded checkpoint's tensor bytes moved straight into output files, without torch: what
``consolidate`` (:mod:`.consolidate_direct`, a Lightning file) and the safetensors export
(:mod:`.export_direct`) share.

Each DCP tensor entry is a ``torch.save`` archive of one contiguous chunk; its bytes belong at a known
place of the output (its chunk's offsets in the full tensor), in one run for a chunk of whole rows
(FSDP's, the usual) or in a run per row otherwise.

- Planning: :func:`tensor_chunks` checks that every tensor's chunks are plain stored bytes that cover it,
  and :func:`segments` finds each chunk's bytes in its shard file (its entry's zip directory and pickle,
  the head and tail read, several at a time) and where they go (:class:`Placed`). Anything else raises
  :class:`Declined`: the caller then takes the torch path, which gives every other answer and error.
- Copying (:class:`Copy`): each shard file read in :data:`BLOCK` pieces, in contiguous parts on
  :data:`~..checksum.STREAMS` threads, the page cache dropped behind; two buffers per part, a thread
  placing one block's chunk pieces (``pwrite``, write-back started behind) while the next is read. Each
  byte is checksummed once: the pieces' CRC-32s give the files' (with ``verify``) and the outputs'
  (:meth:`Copy.crc`, ``crc32_combine``). Memory: two blocks per part, whatever the tensors' sizes.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import itertools
import math
import os
import threading
import zipfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lightning_sharded.checkpoint import libc, names
from lightning_sharded.checkpoint.backends import Location
from lightning_sharded.checkpoint.backends.paths import local_path
from lightning_sharded.checkpoint.checksum import STREAMS, crc32, crc32_combine, cuts, pieces_crc
from lightning_sharded.checkpoint.dcp_index import tiling_problem
from lightning_sharded.checkpoint.detect import CheckpointKind, Found
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.integrity import ReadVerification
from lightning_sharded.checkpoint.libc import pwrite_all
from lightning_sharded.checkpoint.progress import progress_bar
from lightning_sharded.checkpoint.unpickling.without_torch import (
    read_dcp_metadata,
    record_start,
    stored_record,
    tensor_record,
    type_name,
)
from lightning_sharded.checkpoint.writeback import WINDOW, RangedWriteBehind

__all__ = [
    "BLOCK",
    "DCP",
    "MAX_RUNS",
    "Copy",
    "Declined",
    "Files",
    "Placed",
    "Segment",
    "attempt",
    "local_index",
    "segments",
    "tensor_chunks",
]

T = TypeVar("T")

#: Bytes read per call from a shard file (two buffers of it per part being read).
BLOCK = 8 << 20
#: The most runs (rows of chunks that are not whole rows) written one ``pwrite`` each; more leave the
#: checkpoint to the torch path, which places them in memory.
MAX_RUNS = 1 << 16
#: The module of DCP's index classes, as the index's pickle names them.
DCP = "torch.distributed.checkpoint.metadata."
# The head and the tail of a tensor entry read to find its bytes: its pickle and zip directory.
_PEEK = 4096
# Without verify, ranges to read closer than this are read as one (a gap costs less than a seek).
_GAP = 1 << 20


class Declined(Exception):
    """Why a checkpoint is left to the torch path."""


@dataclass(frozen=True)
class Placed:
    """A tensor of the output: its DCP key, shape, dtype (torch's name, ``"float32"``) and bytes per element,
    and where its bytes go: output ``target``, its number there (``storage``) and first byte (``start``)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    target: int
    storage: int
    start: int


@dataclass
class Segment:
    """A chunk's bytes in a shard file (``start``, ``nbytes``), written to output ``target`` at ``outs[j]``
    for run ``j`` of ``run`` bytes."""

    start: int
    nbytes: int
    target: int
    storage: int
    run: int
    outs: list[int]

    @property
    def end(self) -> int:
        return self.start + self.nbytes


#: Each shard file read, by its path relative to the checkpoint: (local path, size, its segments in order).
Files = dict[str, tuple[Path, int, list[Segment]]]


def attempt(make: Callable[[], T]) -> T | str:
    """``make()``, or why it declined (a :class:`Declined`, or anything unforeseen, damage included: the
    torch path then reads the checkpoint and says what is wrong); raises nothing."""
    try:
        return make()
    except Declined as why:
        return str(why)
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def local_index(found: Found) -> tuple[Path, Any]:
    """The local directory of a sharded checkpoint and its DCP index, read by the stand-ins; a
    :class:`Declined` for object storage, a trainable-only checkpoint, or an index of types only torch
    reads."""
    root = local_path(found.data)
    if found.kind is not CheckpointKind.SHARDED:
        raise Declined("a full checkpoint file (torch reads it)")
    if root is None:
        raise Declined("not local files")
    if found.manifest is not None and found.manifest.frozen is not None:
        raise Declined("a trainable-only checkpoint (its frozen part is read by torch)")
    with open(root / names.DCP_METADATA, "rb") as f:
        metadata = read_dcp_metadata(f)
    if metadata is None or type_name(metadata) != f"{DCP}Metadata":
        raise Declined("its index holds types only torch reads")
    return root, metadata


def tensor_chunks(metadata: Any, keys: Iterable[str]) -> dict[str, list[tuple[Any, Any]]]:
    """Each tensor's ``(chunk, storage info)`` from a DCP index read by the stand-ins, for the tensor
    entries ``keys``; a :class:`Declined` unless every chunk is plain stored bytes inside its tensor and
    the chunks cover it."""
    entries = metadata.state_dict_metadata
    storage = {
        (index.fqn, tuple(index.offset or ())): info for index, info in (metadata.storage_data or {}).items()
    }
    found: dict[str, list[tuple[Any, Any]]] = {}
    for key in keys:
        md = entries[key]
        if type_name(md) != f"{DCP}TensorStorageMetadata":
            raise Declined(f"the entry {key!r} is not a tensor")
        if str(md.properties.layout) != "torch.strided":
            raise Declined(f"the tensor {key!r} is {md.properties.layout}")
        if problem := tiling_problem(md.size, md.chunks):  # damage: the torch path says what is wrong
            raise Declined(f"for the tensor {key!r}, {problem}")
        found[key] = []
        for chunk in md.chunks:
            info = storage.get((key, tuple(chunk.offsets)))
            if info is None or info.transform_descriptors:
                raise Declined(f"a chunk of {key!r} has no plain stored bytes")
            found[key].append((chunk, info))
    return found


def segments(root: Path, placed: list[Placed], chunks: dict[str, list[tuple[Any, Any]]]) -> Files:
    """Every shard file's segments (each chunk of the ``placed`` tensors: where its bytes are, where they
    go); a :class:`Declined` for an entry that is not a plain contiguous chunk, for entries that overlap,
    or for too many runs."""
    items = [(tensor, chunk, info) for tensor in placed for chunk, info in chunks[tensor.key]]
    with ThreadPoolExecutor(8, thread_name_prefix="lightning-sharded-peek") as pool:
        starts = list(pool.map(lambda item: _chunk_start(root, *item), items))
    files: Files = {}
    runs = 0
    for (tensor, chunk, info), data_start in zip(items, starts, strict=True):
        run, outs = _runs(tensor, chunk)
        if len(outs) > 1:
            runs += len(outs)
        rel = str(info.relative_path)
        if rel not in files:
            path = root / rel
            files[rel] = (path, path.stat().st_size, [])
        nbytes = math.prod(int(n) for n in chunk.sizes) * tensor.itemsize
        if nbytes:
            segment = Segment(int(info.offset) + data_start, nbytes, tensor.target, tensor.storage, run, outs)
            files[rel][2].append(segment)
    if runs > MAX_RUNS:
        raise Declined(f"its chunks would be written in {runs} pieces")
    for rel, (_, size, found) in files.items():
        found.sort(key=lambda s: s.start)
        if any(a.end > b.start for a, b in itertools.pairwise(found)) or (found and found[-1].end > size):
            raise Declined(f"the entries of {rel!r} overlap or run past its end")
    return files


def _runs(tensor: Placed, chunk: Any) -> tuple[int, list[int]]:
    """Where a chunk's bytes go in the output: ``(run bytes, start of each run)``, one run for a chunk of
    whole rows."""
    shape, itemsize = tensor.shape, tensor.itemsize
    offsets, sizes = tuple(int(n) for n in chunk.offsets), tuple(int(n) for n in chunk.sizes)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    # the last dimension the chunk cuts: from there on, it is contiguous in the tensor
    cut = max((d for d in range(len(shape)) if sizes[d] != shape[d]), default=0)
    run = (sizes[cut] if shape else 1) * (strides[cut] if shape else 1) * itemsize
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    rows = itertools.product(*(range(n) for n in sizes[:cut]))  # C order; one empty row for none
    return run, [
        tensor.start + itemsize * (first + sum(i * s for i, s in zip(row, strides, strict=False)))
        for row in rows
    ]


def _chunk_start(root: Path, tensor: Placed, chunk: Any, info: Any) -> int:
    """Where a chunk's bytes start in its entry, from the entry's zip directory and pickle."""
    key, offset, length = tensor.key, int(info.offset), int(info.length)
    with open(root / str(info.relative_path), "rb", buffering=0) as f:
        entry = _Entry(f.fileno(), offset, length)
        with zipfile.ZipFile(entry) as archive:
            infos = {i.filename: i for i in archive.infolist()}
            pickles = [name for name in infos if name.count("/") == 1 and name.endswith("/data.pkl")]
            if len(pickles) != 1 or any(name.endswith("/constants.pkl") for name in infos):
                raise Declined(f"the entry {key!r} is not a torch.save archive")
            prefix = pickles[0][: -len("data.pkl")]
            if stored_record(archive, infos.get(prefix + "byteorder")) != b"little":
                raise Declined(f"the entry {key!r} is not little-endian")
            found = tensor_record(stored_record(archive, infos[pickles[0]]) or b"")
        sizes = tuple(int(n) for n in chunk.sizes)
        if found is None or found.dtype != tensor.dtype or found.shape != sizes:
            raise Declined(f"a chunk of {key!r} is not its contiguous {tensor.dtype} bytes")
        nbytes = found.nbytes
        record = infos.get(f"{prefix}data/{found.key}")
        if record is None or record.compress_type != zipfile.ZIP_STORED or record.file_size != nbytes:
            raise Declined(f"the entry {key!r} has no stored record of its bytes")
        start = record_start(entry, record)
        if start is None:
            raise Declined(f"the entry {key!r} has a damaged zip record")
        if start + nbytes > length:
            raise Declined(f"the entry {key!r} is cut short")
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


# ------------------------------------------------------------------------------------------ copying


@dataclass
class Copy:
    """The copy of ``files``' segments into the open outputs ``fds`` (by target), from ``root``."""

    root: Location
    files: Files
    fds: list[int]
    #: Each ``(target, storage)``'s pieces as written: ``(output offset, length, crc32)``; a chunk
    #: written in runs of rows has none, so its storage's pieces leave a gap (its CRC-32 is read back).
    pieces: dict[tuple[int, int], list[tuple[int, int, int]]] = field(default_factory=dict)

    def run(self, verification: ReadVerification | None, progress: bool | None, desc: str) -> None:
        """Every segment at its place: each shard file read whole with a ``verification``, whose checksums
        the reads complete and which is then checked (a ``CheckpointError`` naming a damaged file, before
        the caller publishes anything); else only the ranges that hold segments."""
        behinds = [RangedWriteBehind(fd, limit=STREAMS * WINDOW) for fd in self.fds]
        parts = [
            (rel, path, start, end)
            for rel, (path, size, found) in sorted(self.files.items())
            for start, end in (cuts(0, size) if verification is not None else _ranges(found))
        ]
        total = sum(end - start for _, _, start, end in parts)
        stop = threading.Event()
        lock = threading.Lock()
        with (
            progress_bar(total, progress, desc) as tick,
            ThreadPoolExecutor(STREAMS, thread_name_prefix="lightning-sharded-copy") as pool,
        ):

            def ticked(n: int) -> None:
                with lock:
                    tick(n)

            def copy(part: tuple[str, Path, int, int]) -> None:
                try:
                    self._copy_part(*part, behinds, verification, ticked, stop)
                except BaseException:
                    stop.set()
                    raise

            context = verification.reading() if verification is not None else contextlib.nullcontext()
            with context:
                for _ in pool.map(copy, parts):
                    pass
        for behind in behinds:
            behind.finish()
        if verification is not None:
            verification.check()

    def crc(self, target: int, storage: int, start: int, size: int) -> int | None:
        """The CRC-32 of bytes ``start`` to ``start + size`` of output ``target`` holding ``storage``, from
        its pieces; ``None`` where they do not cover it (a chunk written in runs of rows: read it back)."""
        return pieces_crc(self.pieces.get((target, storage), []), start, size)

    def pieces_of(self, target: int) -> list[tuple[int, int, int]]:
        """Every piece written to output ``target``: ``(offset, length, crc32)``."""
        return [piece for (t, _), found in self.pieces.items() if t == target for piece in found]

    def _copy_part(
        self,
        rel: str,
        path: Path,
        start: int,
        end: int,
        behinds: list[RangedWriteBehind],
        verification: ReadVerification | None,
        tick: Callable[[int], None],
        stop: threading.Event,
    ) -> None:
        """Bytes ``start`` to ``end`` of the shard file ``rel``, read in blocks into two buffers: each block's
        chunk pieces written to their places (and every byte checksummed once) by a thread, while the
        next block is read. No ``POSIX_FADV_SEQUENTIAL``: its larger read-ahead made these reads 5-15%
        slower on the project's machine (as ``verify``'s)."""
        blocks = _Blocks(self, self.files[rel][2], start, behinds, verification is not None)
        size = min(BLOCK, max(end - start, 1))
        buffers = [memoryview(bytearray(size)) for _ in range(2)]
        position = start
        with (
            open(path, "rb", buffering=0) as f,
            ThreadPoolExecutor(1, thread_name_prefix="lightning-sharded-place") as placing,
        ):
            fd = f.fileno()
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
        self, segment: Segment, at: int, data: memoryview, crc: int, behind: RangedWriteBehind
    ) -> None:
        """Bytes ``at`` onwards of ``segment`` (``data``, whose CRC-32 is ``crc``) into its output."""
        out = self.fds[segment.target]
        if len(segment.outs) == 1:
            pwrite_all(out, data, segment.outs[0] + at)
            behind.wrote(segment.outs[0] + at, len(data))
            pieces = self.pieces.setdefault((segment.target, segment.storage), [])
            pieces.append((segment.outs[0] + at, len(data), crc))
            return
        run, done = segment.run, 0
        while done < len(data):
            j, into = divmod(at + done, run)
            n = min(run - into, len(data) - done)
            pwrite_all(out, data[done : done + n], segment.outs[j] + into)
            behind.wrote(segment.outs[j] + into, n)
            done += n


class _Blocks:
    """The blocks of one part of a shard file, in order: each chunk piece to its place in its output, every
    byte checksummed once (``crc``: the part's CRC-32, with ``verify``)."""

    def __init__(
        self, copy: Copy, segments: list[Segment], start: int, behinds: list[RangedWriteBehind], verify: bool
    ) -> None:
        self._copy, self._segments, self._behinds, self._verify = copy, segments, behinds, verify
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
                self._copy._place(segment, cursor - segment.start, data, piece, self._behinds[segment.target])
                if upto == segment.end:
                    self._index += 1
            else:
                piece = crc32(data) if self._verify else 0
            if self._verify:
                self.crc = crc32_combine(self.crc, piece, upto - cursor)
            cursor = upto


def _ranges(found: list[Segment]) -> list[tuple[int, int]]:
    """The ranges of a file that hold its (sorted) segments, those closer than :data:`_GAP` read as one,
    each cut into parts as a whole file is."""
    merged: list[list[int]] = []
    for segment in found:
        if merged and segment.start - merged[-1][1] < _GAP:
            merged[-1][1] = max(merged[-1][1], segment.end)
        else:
            merged.append([segment.start, segment.end])
    return [cut for start, end in merged for cut in cuts(start, end)]
