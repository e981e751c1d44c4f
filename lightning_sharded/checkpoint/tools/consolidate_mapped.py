"""``consolidate_checkpoint`` through torch: a sharded checkpoint into one full file, in one process, memory
bounded, for any checkpoint :mod:`.consolidate_direct` leaves to torch (its objects need torch to be read,
a trainable-only checkpoint, object storage...).

The output is written by ``torch.save`` with every tensor's space reserved (``skip_data``), mapped, and
filled batch by batch through DCP's reader, with a save's write-behind; its zip CRC-32s are fixed last.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import logging
import math
import mmap
import os
import queue
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from lightning_sharded.checkpoint import libc, names, unpickling
from lightning_sharded.checkpoint.backends import Location, basename
from lightning_sharded.checkpoint.checksum import crc32, pieces_crc
from lightning_sharded.checkpoint.commit import commit_file
from lightning_sharded.checkpoint.destination import write_error
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.progress import progress_bar
from lightning_sharded.checkpoint.tools.frozen import FROZEN_SLOT, frozen_listing, read_frozen
from lightning_sharded.checkpoint.tools.nested import drop_rank_state, get_path
from lightning_sharded.checkpoint.tools.reader import leaves, map_tensors, open_sharded
from lightning_sharded.checkpoint.writeback import WINDOW, WriteBehind

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from lightning_sharded.checkpoint.detect import Found
    from lightning_sharded.checkpoint.manifest import FrozenPart
    from lightning_sharded.checkpoint.tools.reader import OfflineReader
    from lightning_sharded.checkpoint.tools.weight_sources import Listing


__all__ = ["consolidate"]

log = logging.getLogger(__name__)

#: A fill reads the checkpoint's tensors into host buffers of this many bytes (or the largest tensor),
#: written into the output by a thread, in pieces of _PIECE bytes, while the next is read.
_BATCH = 32 << 20
_PIECE = 8 << 20


def consolidate(
    found: Found, out: Location, *, verify: bool, progress: bool | None, weights_only: bool | None
) -> int:
    """``format="lightning"`` through torch: the output planned, written by ``torch.save`` with its
    tensors' space reserved, memory-mapped and filled batch by batch (see the module doc); returns the
    bytes of its tensors."""
    reader = open_sharded(
        found, verify, weights_only, during=True, then=f"Nothing was written at {str(out)!r}."
    )
    output = _plan(found, reader, weights_only)
    try:  # written locally (memory-mapped while filled); a URL gets one upload
        commit_file(out, lambda tmp: _write(tmp, out, output, reader, weights_only, progress))
    except OSError as err:
        raise write_error(out, err) from err
    return output.total


@dataclass(frozen=True)
class _Slot:
    """Stands for a DCP tensor entry in the checkpoint structure until the output file exists."""

    key: str


@dataclass
class _Output:
    """What the output file holds: the checkpoint with a :class:`_Slot` for each tensor entry, each slot's
    shape and dtype, and a trainable-only checkpoint's frozen part with what its source holds."""

    skeleton: dict[str, Any]
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    frozen: tuple[FrozenPart, Listing] | None

    @property
    def total(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.shapes.values())


def _plan(found: Found, reader: OfflineReader, weights_only: bool | None) -> _Output:
    """The output's skeleton from the checkpoint's objects and ``meta.pt``, before anything is written."""
    meta = drop_rank_state(reader.read_meta(), found.data)
    skeleton = reader.to_lightning({**reader.read_objects(), **{k: _Slot(k) for k in reader.tensors}}, meta)
    shapes = {key: (tuple(md.size), md.properties.dtype) for key, md in reader.tensors.items()}
    # A trainable-only checkpoint: its frozen parameters come from the source it names (checked now,
    # before anything is written), so the output is a complete checkpoint, as any other consolidation.
    frozen = found.manifest.frozen if found.manifest is not None else None
    if frozen is None:
        return _Output(skeleton, shapes, None)
    listing = frozen_listing(frozen, str(found.data), weights_only, "consolidate from a copy that has it")
    for key in frozen.keys:
        stored = key[len(frozen.prefix) :]
        shapes[FROZEN_SLOT + key] = (listing.shapes[stored], listing.dtypes[stored])
        skeleton[names.STATE_DICT][key] = _Slot(FROZEN_SLOT + key)
    log.info(
        "%s holds the trainable weights only: its frozen part is read from %s", found.data, frozen.source
    )
    return _Output(skeleton, shapes, (frozen, listing))


def _write(
    tmp: Path,
    out: Location,
    output: _Output,
    reader: OfflineReader,
    weights_only: bool | None,
    progress: bool | None,
) -> None:
    """The skeleton with empty tensors at ``tmp``, then filled memory-mapped, chunk by chunk."""
    try:
        with _unbacked(output.shapes) as empty, torch.serialization.skip_data():
            torch.save(map_tensors(output.skeleton, lambda slot: empty[slot.key], _Slot), tmp)
    except RuntimeError as err:  # torch's writer reports I/O errors as RuntimeError
        raise write_error(out, err) from err
    _reserve(tmp)
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        loaded = unpickling.safe_load(
            tmp,
            what=f"The consolidated file {str(tmp)!r}",
            weights_only=weights_only,
            mmap=True,
            map_location="cpu",
        )
    sums = _FillChecksums(tmp, loaded)
    try:
        _fill(loaded, output, reader, sums, weights_only, progress)
    finally:  # the mapping's views go before the CRCs are fixed
        del loaded
        gc.collect()
        sums.close()
    _fix_zip_crcs(tmp, sums.crcs())


def _fill(
    loaded: Any,
    output: _Output,
    reader: OfflineReader,
    sums: _FillChecksums,
    weights_only: bool | None,
    progress: bool | None,
) -> None:
    """Every tensor of the mapped output ``loaded`` read into place: the DCP entries, the frozen part,
    then the tensors the checkpoint's objects hold themselves; with verify, the source checked last."""
    slots = {leaf.key: path for path, leaf in leaves(output.skeleton) if isinstance(leaf, _Slot)}
    targets = {key: get_path(loaded, path) for key, path in slots.items() if not key.startswith(FROZEN_SLOT)}
    with progress_bar(output.total, progress, f"consolidating {basename(reader.root)}") as tick:
        _copy_entries(targets, reader, sums, tick)
        if output.frozen is not None:
            frozen, listing = output.frozen
            into = {
                key[len(FROZEN_SLOT) :]: get_path(loaded, path)
                for key, path in slots.items()
                if key.startswith(FROZEN_SLOT)
            }
            read_frozen(frozen, listing, into, weights_only)
            for tensor in into.values():
                sums.filled(tensor)
                tick(tensor.numel() * tensor.element_size())
    for path, leaf in leaves(output.skeleton):
        if isinstance(leaf, torch.Tensor):  # held by the checkpoint's objects, not DCP entries
            target = get_path(loaded, path)
            target.copy_(leaf)
            sums.filled(target)
    reader.check()  # with verify: the source's checksums, from the reads, before it is published


def _copy_entries(
    targets: dict[str, torch.Tensor], reader: OfflineReader, sums: _FillChecksums, tick: Callable[[int], None]
) -> None:
    """The DCP entries into their ``targets`` (views of the mapped output), in the output's order: read
    into one of two host buffers, a batch of tensors at a time (about :data:`_BATCH` bytes, or the largest
    tensor), each batch written into the file with ``pwrite`` by a thread while the next is read.

    Reading into the mapping instead faulted in every page of the output, 4 KiB at a time, and the
    reading thread then waited on each region's write-back and drop (``sync_file_range``, ``madvise``,
    ``fadvise``: most of its time under py-spy). Writing each batch with one ``pwrite`` did no better
    (its write-back came in bursts); :data:`_PIECE` pieces, each handed to the disk as it is written,
    did. Interleaved cold runs here (one-rank checkpoints, in one process): 1.9 GB in 4.4-6.6 s through
    the mapping, 2.3-2.8 s now, a copy of the same bytes 1.9-2.1 s; 7.6 GB in 12.1-17.5 s, 9.8-10.6 s
    now, the copy 7.7-8.1 s.
    """
    order = sorted(targets, key=lambda key: targets[key].data_ptr())
    sizes = {key: _aligned(targets[key].numel() * targets[key].element_size()) for key in order}
    size = max(min(_BATCH, sum(sizes.values())), max(sizes.values(), default=0))
    batches: list[list[str]] = []
    filling = 0
    for key in order:
        if not batches or filling + sizes[key] > size:  # an empty tensor first has a batch too
            batches.append([])
            filling = 0
        batches[-1].append(key)
        filling += sizes[key]
    with _Writer(sums, size) as writer:
        for batch in batches:
            buffer = writer.buffer()
            places = list(itertools.accumulate((sizes[key] for key in batch), initial=0))
            views = {
                key: buffer[at : at + targets[key].numel() * targets[key].element_size()]
                .view(targets[key].dtype)
                .view(targets[key].shape)
                for key, at in zip(batch, places, strict=False)
            }
            chunks = _placed(sums, buffer.data_ptr(), places, [targets[key] for key in batch])
            reader.read_tensors(views, tick, chunks)
            writer.write(buffer, [(views[key], targets[key]) for key in batch])


def _placed(
    sums: _FillChecksums, base: int, places: list[int], targets: list[torch.Tensor]
) -> Callable[[torch.Tensor, int | None], None]:
    """``sums.filled`` for regions of the buffer at address ``base`` (views at byte ``places``), each
    recorded at its target's place in the output."""

    def filled(region: torch.Tensor, crc: int | None) -> None:
        at = region.data_ptr() - base
        index = bisect.bisect_right(places, at) - 1
        sums.filled(region, crc, at=targets[index].data_ptr() + at - places[index])

    return filled


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64  # every view of a buffer starts 64-byte aligned (any dtype's view)


# A filled buffer, and each (view of it, its mapped target in the output).
_Batch = tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]


class _Writer:
    """A thread that writes filled buffers into the output at their places (``pwrite``), in order, with a
    save's write-behind, and hands each buffer back once written (two buffers of ``size`` bytes: the
    output's memory, whatever the stale references to their views). Where the mapped output's storages
    could not be matched to the file's records, a buffer is copied into its mapped targets instead."""

    def __init__(self, sums: _FillChecksums, size: int) -> None:
        self._sums = sums
        self._fd = os.open(sums.file, os.O_WRONLY)
        self._behind = WriteBehind(self._fd, window=WINDOW)
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for _ in range(2):
            self._free.put(torch.empty(size, dtype=torch.uint8))
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="consolidate-writer", daemon=True)
        self._thread.start()

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._queue.put(None)
        self._thread.join()
        os.close(self._fd)
        if self._error is not None and exc[0] is None:
            raise self._error

    def buffer(self) -> torch.Tensor:
        """A free buffer; raises what the writer met."""
        buffer = self._free.get()
        if self._error is not None:
            raise self._error
        return buffer

    def write(self, buffer: torch.Tensor, places: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write each ``(view of buffer, mapped target)`` of ``places`` at the target's place."""
        self._queue.put((buffer, places))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            buffer, places = item
            try:
                if self._error is None:
                    for view, target in places:
                        start = self._sums.offset(target)
                        if start is None:
                            target.copy_(view)
                            continue
                        data = memoryview(cast(Any, view.reshape(-1).view(torch.uint8).numpy()))
                        while data:  # in pieces, each handed to the disk as it is written
                            written = os.pwrite(self._fd, data[:_PIECE], start)
                            data, start = data[written:], start + written
                            self._behind.advance(start)
            except BaseException as err:  # raised in the reading thread, at its next batch or the end
                self._error = err
            self._free.put(buffer)
        self._behind.finish()


def _reserve(file: Path) -> None:
    """Allocate the file's blocks now, so a full disk fails here with ENOSPC, not later in the mmap fill.

    (A write into a memory-mapped hole on a full disk kills the process with SIGBUS.)
    """
    fd = os.open(file, os.O_RDWR)
    try:
        libc.reserve(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _unbacked(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Iterator[dict[str, torch.Tensor]]:
    """Tensors of ``shapes`` that take no memory, for ``torch.save`` under ``skip_data`` (which writes
    their records' sizes, not their bytes): each a storage of its own, cut from one shared mapping of a
    sparse temporary file, never touched, so no page is read, written or committed (one mapping: a
    mapping each would stop at the kernel's ``vm.max_map_count``, 65,530 by default); the file is gone on
    exit. (Fake tensors would do, but ``FakeTensorMode()`` imports ``torch._dynamo``: 0.55 s.)
    """
    sizes = {key: math.prod(shape) * dtype.itemsize for key, (shape, dtype) in shapes.items()}
    fd, scratch = tempfile.mkstemp(prefix="lightning-sharded-unbacked-")
    try:
        total = max(sum(sizes.values()), 1)
        os.ftruncate(fd, total)
        mapped = torch.UntypedStorage.from_file(scratch, True, total)
        empty, start = {}, 0
        for key, (shape, dtype) in shapes.items():
            if not sizes[key]:  # no bytes: a storage of its own all the same
                empty[key] = torch.empty(shape, dtype=dtype)
                continue
            empty[key] = torch.empty(0, dtype=dtype).set_(mapped[start : start + sizes[key]]).view(shape)
            start += sizes[key]
        yield empty
    finally:
        os.close(fd)
        os.unlink(scratch)


def _data_start(f: Any, info: Any) -> int:
    """Where the bytes of the zip record ``info`` start in the open archive ``f``."""
    f.seek(info.header_offset)
    local = f.read(30)
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return int(info.header_offset) + 30 + int(name_len) + int(extra_len)


class _FillChecksums:
    """The CRC-32s of a consolidated file's storage records, from its regions as they are filled.

    ``loaded`` is the output memory-mapped: its storages are slices of one mapping, in the order of the
    archive's records, so matching their sizes gives the mapping's base, and each filled region a file
    range. A record its pieces do not cover exactly once, or a file whose storages do not match its
    records, is left to :func:`_fix_zip_crcs` to read back.
    """

    def __init__(self, file: Path, loaded: Any) -> None:
        import zipfile

        self.file = file
        self._pieces: dict[int, list[tuple[int, int, int]]] = {}
        self._base: int | None = None
        with zipfile.ZipFile(file) as archive, open(file, "rb") as f:
            records = sorted(
                (_data_start(f, info), int(info.file_size))
                for info in archive.infolist()
                if "/data/" in info.filename and info.file_size
            )
        self._starts = [start for start, _ in records]
        self._sizes = dict(records)
        storages = sorted(
            {
                leaf.untyped_storage().data_ptr(): leaf.untyped_storage().nbytes()
                for _, leaf in leaves(loaded)
                if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().nbytes()
            }.items()
        )
        if records and [n for _, n in storages] == [n for _, n in records]:
            base = storages[0][0] - records[0][0]
            if all(ptr - base == start for (ptr, _), (start, _) in zip(storages, records, strict=True)):
                self._base = base
        self._fd = os.open(file, os.O_RDONLY)
        self._behind: list[tuple[int, int]] = []  # filled regions still in the page cache, in order

    def offset(self, target: torch.Tensor) -> int | None:
        """Where the bytes of ``target`` (a view of the mapped output) are in the file, if known."""
        return None if self._base is None else target.data_ptr() - self._base

    def filled(self, region: torch.Tensor, crc: int | None = None, *, at: int | None = None) -> None:
        """Checksum a region just filled (``crc``: its CRC-32, if the read computed it): a view of the
        mapping, its write-back started here, or a buffer's bound for address ``at`` (the writer's)."""
        if self._base is None or not region.is_contiguous() or not region.numel():
            return
        start = (region.data_ptr() if at is None else at) - self._base
        nbytes = region.numel() * region.element_size()
        index = bisect.bisect_right(self._starts, start) - 1
        if index < 0 or start + nbytes > self._starts[index] + self._sizes[self._starts[index]]:
            return
        if crc is None:
            crc = crc32(memoryview(cast(Any, region.detach().reshape(-1).view(torch.uint8).numpy())))
        self._pieces.setdefault(self._starts[index], []).append((start, nbytes, crc))
        if at is not None:
            return
        libc.sync_file_range(self._fd, start, nbytes, libc.SYNC_FILE_RANGE_WRITE)  # advice: start writing
        # Write-behind, as a save's writer: once WINDOW bytes more are filled, the region's pages, on disk
        # by then, leave the mapping and the page cache (the output does not take its size in memory).
        self._behind.append((start, nbytes))
        while sum(n for _, n in self._behind) > WINDOW:
            self._drop(*self._behind.pop(0))

    def _drop(self, start: int, nbytes: int) -> None:
        # Not writeback.drop_written: a mapped page must leave the mapping before the page cache drops it.
        assert self._base is not None
        waits = (
            libc.SYNC_FILE_RANGE_WAIT_BEFORE | libc.SYNC_FILE_RANGE_WRITE | libc.SYNC_FILE_RANGE_WAIT_AFTER
        )
        libc.sync_file_range(self._fd, start, nbytes, waits)
        libc.madvise(self._base + start, nbytes, libc.MADV_DONTNEED)  # whole pages: from the mapping,
        libc.fadvise(self._fd, start, nbytes, "DONTNEED")  # then from the page cache

    def crcs(self) -> dict[int, int]:
        """``{record data start: CRC-32}`` of every record its filled pieces cover exactly."""
        crcs = {
            record: pieces_crc(pieces, record, self._sizes[record]) for record, pieces in self._pieces.items()
        }
        return {record: crc for record, crc in crcs.items() if crc is not None}

    def close(self) -> None:
        os.close(self._fd)


def _fix_zip_crcs(file: Path, known: dict[int, int]) -> None:
    """Set the CRC-32 of every record of a zip archive written by ``torch.save`` and filled later.

    torch.save computed them of the empty space (``skip_data``); each is patched in place, the ones
    ``known`` lacks (by where a record's bytes start) read back in 8 MiB chunks.
    """
    import zipfile

    with zipfile.ZipFile(file) as archive:
        infos = archive.infolist()
        start_dir = archive.start_dir  # type: ignore[attr-defined]
    with open(file, "r+b") as f:
        f.seek(start_dir)
        central = []
        for _ in infos:
            header = f.read(46)
            if header[:4] != b"PK\x01\x02":
                raise CheckpointError(f"Unexpected zip layout in {str(file)!r} while consolidating.")
            name_len, extra_len, comment_len = struct.unpack("<HHH", header[28:34])
            central.append(f.tell() - 46)
            f.seek(name_len + extra_len + comment_len, os.SEEK_CUR)
        for info, central_pos in zip(infos, central, strict=True):
            data_start = _data_start(f, info)
            crc = known.get(data_start)
            if crc is None:
                f.seek(data_start)
                crc, left = 0, info.compress_size
                while left:
                    chunk = f.read(min(left, 8 << 20))
                    if not chunk:
                        break
                    crc = crc32(chunk, crc)
                    left -= len(chunk)
            if crc == info.CRC:
                continue
            packed = struct.pack("<I", crc)
            f.seek(central_pos + 16)
            f.write(packed)
            if info.flag_bits & 0x08:  # data descriptor after the data, with an optional signature
                f.seek(data_start + info.compress_size)
                signature = f.read(4)
                f.seek(data_start + info.compress_size + (4 if signature == b"PK\x07\x08" else 0))
                f.write(packed)
            f.seek(info.header_offset + 14)
            if f.read(4) != b"\0\0\0\0" or not info.flag_bits & 0x08:
                f.seek(info.header_offset + 14)
                f.write(packed)
