"""A DCP storage reader that reads each tensor's bytes straight into the tensor it loads into.

torch's ``FileSystemReader`` loads every stored tensor with ``torch.load`` (a new tensor, its pages
faulted in, the bytes copied from the page cache) and then copies it into the target: two copies and
a fresh allocation per tensor, which caps a resume at about half the disk's read bandwidth here.
DCP stores each tensor as a small ``torch.save`` zip archive whose storage record is kept
uncompressed; :class:`DirectReader` finds the storage record and ``readinto``-s its bytes into the
target's memory: one copy, no allocation. Items it cannot do exactly that way (byte items, views,
narrowed reads, dtype or layout differences, extensions) go through torch's own path, item by item.

A resume reads each byte once, so a direct read drops the page cache's pages of what it read behind
it (``POSIX_FADV_DONTNEED``, piece by piece): the reads recycle a few MiB of page cache instead of
taking a shard's worth of fresh memory (on a VM that gives free memory back to its host, a host fault
per page). Bytes that more than one rank reads (a replicated tensor saved once, an HSDP shard) keep
their pages for the other ranks of the machine: :meth:`DirectReader.prepare_global_plan` counts the
readers of every stored item across all ranks' plans. Measured here (2 ranks, 2 GB of model and Adam,
interleaved runs): a ``ShardedModelParallelStrategy`` resume 0.95 and 1.26 GB/s without it, 1.49 and
1.44 GB/s with it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import operator
import os
import queue
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, Protocol, TypeVar, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType

from lightning_sharded._compat import create_file_view, fsspec_filesystem
from lightning_sharded.checkpoint import libc, unpickling
from lightning_sharded.checkpoint.checksum import crc32

__all__ = [
    "DirectReader",
    "GivenMetadata",
    "ReadRecorder",
    "SafeBytesPlanner",
    "SharedReads",
    "fsspec_reader",
]

_T = TypeVar("_T")

# Smaller tensors are not worth the zip parsing: torch's path.
_DIRECT_FROM = 1 << 20
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = b"PK\x03\x04"
_DESCRIPTOR_MAGIC = b"PK\x07\x08"
# Threads reading at once, each its contiguous part. Here (2 ranks reading their 1 GB shards at once,
# cold) one sequential reader per rank got 1.14 GB/s in all (median of 4; 0.98-1.67), two per rank
# 2.56 (2.53-2.60), four 1.85: the disk rewards a second stream, not more.
_STREAMS = 2
# With checksums on, bytes are read this many at a time, each piece hashed right after its read, while
# it is still in the CPU's cache (a hash of the whole tensor afterwards reads it again from memory).
_CRC_PIECE = 4 << 20
# How much of an archive's start to read to find its storage record (the pickle comes first).
_HEAD_BYTES = 1 << 16


def _storage_location(file: Any, base: int, length: int, nbytes: int, check_tail: bool = True) -> int | None:
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
            # The descriptor is checked here, or by the caller once the bytes are read (_archive_fits).
            if check_tail and not _descriptor_fits(file, base + data, nbytes):
                return None
            return int(base + data)
        position = head.find(_LOCAL_HEADER_MAGIC, position + 4)
    return None


def _descriptor_fits(file: Any, offset: int, nbytes: int) -> bool:
    """Whether the data descriptor right after the ``nbytes`` bytes at ``offset`` says that size."""
    tail = os.pread(file.fileno(), 24, offset + nbytes)
    if tail[:4] != _DESCRIPTOR_MAGIC:
        return False
    size32 = struct.unpack_from("<I", tail, 8)[0]
    size64 = struct.unpack_from("<Q", tail, 8)[0] if len(tail) >= 16 else -1
    return nbytes in (size32, size64)


# Fresh memory (an optimizer state template made with `torch.empty`) is faulted in page by page as a
# read fills it, in the reading thread: here that took a resume from 2.2 GB/s (targets already
# touched) to 0.98. A thread that populates the targets ahead of the readers (`MADV_POPULATE_WRITE`:
# the pages are made present, their bytes untouched, so it cannot race with a read) got 1.44.
def _prefault(jobs: list[Any]) -> None:
    """Make the pages of every job's target present, in order (whole pages inside each target)."""
    for job in jobs:
        libc.madvise(job.target.data_ptr(), job.nbytes, libc.MADV_POPULATE_WRITE)


def _readinto(
    file: Any, offset: int, target: torch.Tensor, crc: bool = False, drop: bool = False
) -> tuple[bool, int]:
    """Read ``target``'s bytes from ``offset``; returns whether the file had them all, and (with
    ``crc``) their CRC-32, computed piece by piece as each :data:`_CRC_PIECE` arrives (still in cache).
    With ``drop``, the page cache's folios wholly inside what was read are dropped after each piece;
    those the read shares with its neighbours in the file stay."""
    view = memoryview(cast(Any, target.view(torch.uint8).reshape(-1).numpy())).cast("B")
    file.seek(offset)
    done = 0
    checksum = 0
    step = _CRC_PIECE if crc or drop else len(view)
    while done < len(view):
        n = file.readinto(view[done : done + step])
        if not n:
            return False, checksum
        if crc:
            checksum = crc32(view[done : done + n], checksum)
        done += n
        if drop:
            # From the read's start every time: the kernel drops only whole (large) folios, so one that
            # began before the last call's end goes once the read has passed its end.
            _drop_behind(file, offset, done)
    return True, checksum


def _drop_behind(file: Any, offset: int, nbytes: int) -> None:
    """In a reading thread: drop the pages read so far from the page cache (timed apart by the
    benchmarks' profile: ``libc.fadvise`` also runs in the training thread)."""
    libc.fadvise(file.fileno(), offset, nbytes, "DONTNEED")


def _archive_fits(file: Any, job: _Job) -> bool:
    """In a reading thread, once the record's bytes are read: whether the archive holds exactly a
    contiguous tensor of the target's dtype and shape in that record (its data descriptor and its
    metadata, both right after the bytes just read). If not, torch's path reads the item again."""
    assert job.archive is not None
    base, length = job.archive
    if not _descriptor_fits(file, job.offset, job.nbytes):
        return False
    view = cast(IO[bytes], create_file_view(file, base, length))
    try:
        meta = torch.load(view, map_location="meta", weights_only=True)
    except Exception:
        return False
    return (
        isinstance(meta, torch.Tensor)
        and meta.storage_offset() == 0
        and meta.is_contiguous()
        and meta.untyped_storage().nbytes() == job.nbytes
        and meta.dtype == job.target.dtype
        and meta.shape == job.target.shape
    )


class SafeBytesPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that the entries saved as bytes (pickled objects: optimizer
    settings, anything not a tensor) are unpickled as ``weights_only`` says, as ``meta.pt`` and a full
    file are: DCP's own ``load_bytes`` unpickles them with ``weights_only=False``, running a hostile
    file's code (torch/distributed/checkpoint/default_planner.py). ``weights_only``: ``torch.load``'s
    (``None``: its default, ``True``); ``what``: a read item's entry in words, for a refusal's message.
    """

    def __init__(
        self, *args: Any, weights_only: bool | None, what: Callable[[Any], str], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.weights_only = weights_only
        self.what = what

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = unpickling.safe_load(value, what=self.what(read_item), weights_only=self.weights_only)
        fqn = read_item.dest_index.fqn
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        # Where the flattened key sits in the nested state (it is there: the plan comes from it).
        container: Any = self.original_state_dict
        *parents, last = self.mappings[fqn]
        for key in parents:
            container = container[key]
        container[last] = obj


class GivenMetadata:
    """A DCP ``StorageReader`` mixin: ``read_metadata`` returns the ``Metadata`` given at construction.

    DCP calls ``read_metadata`` on every rank of every ``dcp.load`` (the model, then each optimizer): N
    reads of ``.metadata`` per call, a metadata storm on a parallel file system, N GET (and as many HEAD)
    requests on S3. A load reads it once, on rank 0, and broadcasts it
    (:func:`~lightning_sharded.checkpoint.load.sharded.restore_sharded`) and gives the readers that
    (``metadata=``; ``None`` reads ``.metadata`` from storage as the reader would).
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


class ReadRecorder(Protocol):
    """Where a reader records the CRC-32 of each byte range it read straight into a tensor (``verify=True``
    without a second read): :class:`~lightning_sharded.checkpoint.integrity.ReadChecksums`."""

    def add(self, relative: str, offset: int, length: int, crc: int) -> None:
        """Record the range ``[offset, offset + length)`` of the file ``relative`` (to the checkpoint)."""
        ...


@dataclass(frozen=True)
class SharedReads:
    """What :meth:`DirectReader.prepare_global_plan` puts in each rank's plan (``storage_data``): the
    stored items (DCP ``MetadataIndex``) read more than once in the load, by any ranks."""

    indices: frozenset[Any]


@dataclass
class _Job:
    """One item to read directly: its bytes at ``offset`` of ``path`` go into ``target``."""

    req: Any
    path: str
    relative: str
    offset: int
    target: torch.Tensor
    #: Whether its pages leave the page cache once read: not when another rank reads the same bytes.
    drop: bool = True
    #: ``(start, length)`` of the item's ``torch.save`` archive when ``offset`` is not known yet (-1): the
    #: reading thread finds the storage record as it reaches the item, in file order, and checks the
    #: archive's metadata once the bytes are in (an item that does not fit goes to torch's path, which
    #: reads it again over what was read).
    archive: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return self.target.numel() * self.target.element_size()


class DirectReader(GivenMetadata, FileSystemReader):
    """``FileSystemReader`` that reads large tensors directly into their targets (see the module doc).

    The items it reads directly are read by :data:`_STREAMS` threads at once, each its own contiguous
    part of the bytes in file order (its own file descriptors, so the kernel's read-ahead sees a
    sequential reader, and is all the reading ahead there is). Each item's target is resolved, and
    committed once its bytes are in, in the calling thread; the threads find the storage records and
    move bytes. A plan that this reader's :meth:`prepare_global_plan` did not mark keeps its pages cached.

    ``metadata=``: see :class:`GivenMetadata`. ``checksums=``: a :class:`ReadRecorder` that gets the
    CRC-32 of every range read directly, computed as the bytes arrive.
    """

    def __init__(self, *args: Any, checksums: ReadRecorder | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._checksums = checksums

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """On the coordinator, with every rank's plan: mark in each plan the stored items read more than
        once (by several ranks: a replicated tensor, an HSDP shard), whose pages stay in the page cache."""
        plans = super().prepare_global_plan(plans)
        readers: dict[Any, int] = {}  # reads of each stored item: by several ranks, or twice by one
        for plan in plans:
            for item in plan.items:
                readers[item.storage_index] = readers.get(item.storage_index, 0) + 1
        shared = frozenset(index for index, count in readers.items() if count > 1)
        return [dataclasses.replace(plan, storage_data=SharedReads(shared)) for plan in plans]

    def read_data(self, plan: Any, planner: Any) -> Any:
        # Each item's storage record is found by the thread that reads it, as it reaches the item in file
        # order (the archive's start, then its bytes, then its descriptor and metadata, all sequential):
        # located first, in this thread, every item cost a cold read at its start and one at its end
        # before the first byte moved (30 items: 0.03-0.07 s of a 1.2 s resume here), and torch's path
        # for the small items ran after the large ones. Now it runs meanwhile, in this thread.
        shared = plan.storage_data.indices if isinstance(plan.storage_data, SharedReads) else None
        fallback: list[Any] = []
        jobs: list[_Job] = []
        in_file_order = operator.attrgetter("relative_path", "offset")
        for req in sorted(plan.items, key=lambda r: in_file_order(self.storage_data[r.storage_index])):
            job = self._prelocate(req, planner)
            if job is None:
                fallback.append(req)
            else:
                job.drop = shared is not None and req.storage_index not in shared
                jobs.append(job)

        def small() -> None:  # torch's path, in this thread while the threads read the large items
            super(DirectReader, self).read_data(
                type(plan)(fallback, plan.storage_data, plan.planner_data), planner
            )

        late = self._read_jobs(jobs, planner, meanwhile=small if fallback else None)
        return super().read_data(type(plan)(late, plan.storage_data, plan.planner_data), planner)

    def _prelocate(self, req: Any, planner: Any) -> _Job | None:
        """The direct read of ``req`` with its storage record still to find (no I/O), or ``None`` for
        torch's path."""
        info = self.storage_data[req.storage_index]
        if req.type == LoadItemType.BYTE_IO or info.transform_descriptors or info.length < _DIRECT_FROM:
            return None
        if any(req.storage_offsets):
            return None
        target = planner.resolve_tensor(req).detach()
        if (
            target.device.type != "cpu"
            or list(req.lengths) != list(target.shape)
            or not target.is_contiguous()
            or target.dim() == 0
        ):
            return None
        path = os.fspath(self.fs.concat_path(self.path, info.relative_path))
        return _Job(req, path, info.relative_path, -1, target, archive=(info.offset, info.length))

    def _read_jobs(
        self, jobs: list[_Job], planner: Any, meanwhile: Callable[[], None] | None = None
    ) -> list[Any]:
        """Read every job's bytes (in :data:`_STREAMS` contiguous parts at once) and commit each;
        returns the requests of jobs whose file ended early or whose archive did not fit a direct read
        (for torch's path). ``meanwhile`` runs in the calling thread while the threads read."""
        if not jobs:
            if meanwhile is not None:
                meanwhile()
            return []
        parts = split_parts(jobs, lambda job: job.nbytes)
        finished: _Finished = queue.SimpleQueue()
        checksums = self._checksums
        threads = [
            threading.Thread(target=_read_part, args=(part, finished, checksums is not None), daemon=True)
            for part in parts
        ]
        if libc.populate_write_works():  # the targets' pages in ahead of the readers
            order = [job for row in itertools.zip_longest(*parts) for job in row if job is not None]
            threads.append(threading.Thread(target=_prefault, args=(order,), daemon=True))
        for thread in threads:
            thread.start()
        error: BaseException | None = None
        short: list[Any] = []
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException as failed:  # raised once the threads are done
                error = failed
        for _ in range(len(jobs) if error is None else 0):
            item, whole, crc, err = finished.get()
            if err is not None:
                error = err
                break
            assert item is not None
            if whole:
                if checksums is not None:
                    checksums.add(item.relative, item.offset, item.nbytes, crc)
                planner.commit_tensor(item.req, item.target)
            else:  # the file ended early (or no direct read): torch's path reads it, says what is wrong
                short.append(item.req)
        for thread in threads:
            thread.join()
        if error is not None:
            raise error
        return short


#: A reading thread's reports: ``(job, whole, crc, None)`` per job, ``(None, False, 0, error)`` if it fails.
_Finished = queue.SimpleQueue[tuple[_Job | None, bool, int, BaseException | None]]


def split_parts(items: list[_T], nbytes: Callable[[_T], int], streams: int = _STREAMS) -> list[list[_T]]:
    """``items`` in at most ``streams`` contiguous parts of about the same bytes each (whole items; no
    empty part): what each reading thread reads. ``benchmarks/faithful/reads.py`` cuts its reads so."""
    total = sum(map(nbytes, items))
    cut: list[list[_T]] = [[]]
    done = 0
    for item in items:
        if done >= total * len(cut) / streams and len(cut) < streams:
            cut.append([])
        cut[-1].append(item)
        done += nbytes(item)
    return [part for part in cut if part]


def _read_part(part: list[_Job], finished: _Finished, hashing: bool) -> None:
    """A reading thread: each job of ``part`` in order, each file opened once (see :data:`_Finished`)."""
    try:
        with contextlib.ExitStack() as stack:
            files: dict[str, Any] = {}
            # No `POSIX_FADV_WILLNEED` for the next items: on top of the kernel's read-ahead it made a
            # resume slower here (2 ranks x 1 GB: 1.23-1.41 s with the next 2 items requested,
            # 0.82-0.85 s without; FSDP2 resume 1.52-1.69 GB/s against 2.18-2.33).
            for job in part:
                if job.path not in files:
                    files[job.path] = stack.enter_context(open(job.path, "rb", buffering=0))
                file = files[job.path]
                if job.archive is not None:  # its storage record, from the archive's start: read next anyway
                    offset = _storage_location(file, *job.archive, job.nbytes, check_tail=False)
                    if offset is None:
                        finished.put((job, False, 0, None))
                        continue
                    job.offset = offset
                whole, crc = _readinto(file, job.offset, job.target, hashing, job.drop)
                if whole and job.archive is not None and not _archive_fits(file, job):
                    whole = False
                finished.put((job, whole, crc, None))
    except BaseException as err:  # reported to the calling thread, which raises it
        finished.put((None, False, 0, err))


_fsspec_reader_class: Any = None


def fsspec_reader(url: str, metadata: Any = None) -> Any:
    """torch's ``FsspecReader`` for ``url``, returning ``metadata`` (when given) from ``read_metadata``;
    its class made on first use (importing torch's fsspec reader imports fsspec)."""
    global _fsspec_reader_class
    if _fsspec_reader_class is None:
        reader = fsspec_filesystem().FsspecReader
        _fsspec_reader_class = type("SharedMetadataFsspecReader", (GivenMetadata, reader), {})
    return _fsspec_reader_class(url, metadata=metadata)
