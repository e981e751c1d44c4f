"""Where checkpoint bytes live: one :class:`Backend` protocol, a local and an object-store implementation.

:func:`backend_for` is the one place that tells a local path from an fsspec URL (``s3://bucket/key``,
``memory://...``); everything above it asks the backend it returns (a
:class:`~lightning_sharded.checkpoint.detect.Found` carries it for every later read). A *location* is
either a :class:`pathlib.Path` (local) or a ``str`` URL; :func:`location` never turns a URL into a
``Path`` (``Path("s3://b/k")`` is ``s3:/b/k``, the bug stock Lightning has for sharded checkpoints).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from lightning_sharded._lazy import lazy_attributes
from lightning_sharded.checkpoint.backends.local import LocalBackend, leftovers, resolve
from lightning_sharded.checkpoint.backends.paths import (
    Location,
    absolute,
    basename,
    is_url,
    join,
    local_path,
    location,
    parent,
)

if TYPE_CHECKING:
    from lightning_sharded.checkpoint.backends.dcp_reader import ReadRecorder
    from lightning_sharded.checkpoint.backends.dcp_writer import ChecksummingWriter
    from lightning_sharded.checkpoint.backends.objstore import ObjectStoreBackend
    from lightning_sharded.checkpoint.manifest import FileEntry, Manifest

__all__ = [
    "Backend",
    "ChecksummingWriter",
    "LocalBackend",
    "Location",
    "ObjectStoreBackend",
    "absolute",
    "backend_for",
    "basename",
    "is_url",
    "join",
    "leftovers",
    "local_path",
    "location",
    "parent",
    "read_manifest",
    "resolve",
]

# Imported on first access: both import torch, which reading a local checkpoint (verify) does not need.
__getattr__ = lazy_attributes(
    __name__,
    {
        "ChecksummingWriter": "lightning_sharded.checkpoint.backends.dcp_writer",
        "ObjectStoreBackend": "lightning_sharded.checkpoint.backends.objstore",
    },
    globals(),
)


class Backend(Protocol):
    """The operations on one kind of storage that loads, saves, checks and tools need.

    Implementations: :class:`~.local.LocalBackend` (POSIX paths; publish by rename) and
    :class:`~.objstore.ObjectStoreBackend` (fsspec URLs; publish by writing the manifest last).
    Stateless and picklable, so a decision about a location can travel between ranks.

    Who calls what, in order (as DCP's ``StorageReader`` and ``StorageWriter`` document their steps):

    A load, or an offline tool:

    1. the detector (rank 0 of a load, its result shared): :meth:`locate` (the recovery rules of an
       interrupted save, the published version), :meth:`manifest_is_stale`, then :meth:`exists`,
       :meth:`is_file`, :meth:`list_files`, :meth:`list_dirs` and :meth:`open_file` (a file's first
       bytes) to tell what is there; :meth:`manifest_at` for a manifest alone;
    2. the checks before a read: :meth:`list_files` on rank 0 and :meth:`size` on the others (each its
       own files), :meth:`checksum` of a share of the files with ``verify=True``;
    3. the reads: :meth:`torch_load` (``meta.pt``, per-rank files), :meth:`open_file` and
       :meth:`read_bytes` (``.metadata`` read safely, headers), :meth:`local_file` (a full file,
       memory-mapped), :meth:`dcp_reader` (the shards, each rank its pieces);
    4. after reads that recorded their checksums: :meth:`checksum` with the ``known`` ranges (each rank
       the files it read most of).

    A sharded save (:func:`~lightning_sharded.checkpoint.commit.commit_directory`):

    1. rank 0: :meth:`prepare` (the recovery rules for real, leftovers removed, refusals, the free
       space), then :meth:`stage`;
    2. every rank: the caller's write, into the staging location through :meth:`dcp_writer` and
       :meth:`write_bytes`, then :meth:`seal_own`;
    3. rank 0, with every rank's entries: :meth:`seal` (durable, the manifest made and put where the
       publish needs it), then :meth:`publish`; :meth:`discard` instead after a failure before it.

    A full file (:func:`~lightning_sharded.checkpoint.commit.commit_file`, one process): :meth:`prepare`,
    :meth:`stage` (a local file name), the caller's write, then :meth:`publish_file` (or
    :meth:`discard`). A removal: :meth:`remove`.
    """

    #: What a sharded checkpoint is called on this storage in messages: "directory" or "prefix".
    noun: str
    #: What to check when nothing is at a location, for messages.
    hint: str
    #: What a location is called in messages: "path" or "URL".
    place: str
    #: Whether :meth:`dcp_reader` can record the checksums of what it reads (``checksums=``), so that
    #: ``verify=True`` needs no second read of the files.
    reads_checksums: bool

    # -- what is there ---------------------------------------------------------------------------
    def locate(self, target: Location) -> tuple[Location, Manifest | None]:
        """Where the files of the checkpoint published at ``target`` are, after the recovery rules of an
        interrupted save, and its manifest (read-only); ``CheckpointError`` for a manifest that cannot
        be parsed."""

    def manifest_at(self, data: Location) -> Manifest | None:
        """The manifest that describes the files under ``data``, or ``None`` (a stock checkpoint)."""

    def manifest_is_stale(self, target: Location, manifest: Manifest) -> bool:
        """Whether a stock save wrote over the checkpoint after ``manifest`` (which is then stale)."""

    # -- reading ---------------------------------------------------------------------------------
    def exists(self, loc: Location) -> bool:
        """Whether a file or directory (a key or a prefix) is at ``loc``."""

    def is_file(self, loc: Location) -> bool:
        """Whether ``loc`` is a file (an object)."""

    def size(self, loc: Location) -> int:
        """Size in bytes of the file at ``loc``; ``FileNotFoundError`` if there is none."""

    def list_files(self, loc: Location) -> dict[str, int]:
        """The files directly inside directory (prefix) ``loc``: ``{name: size}``; empty if none."""

    def list_dirs(self, loc: Location) -> list[str]:
        """The directories (common prefixes) directly inside ``loc``, sorted."""

    def open_file(self, loc: Location) -> AbstractContextManager[IO[bytes]]:
        """The file at ``loc``, open for reading, seekable."""

    def read_bytes(self, loc: Location) -> bytes:
        """The whole content of the file at ``loc``."""

    def torch_load(self, loc: Location, **kwargs: Any) -> Any:
        """``torch.load`` of the file at ``loc``; ``mmap=True`` memory-maps it where it is local (else
        the whole file is read)."""

    def local_file(self, loc: Location) -> AbstractContextManager[Path]:
        """A local path with the content of the file at ``loc`` (itself, or a temporary download)."""

    def checksum(self, loc: Location, known: Sequence[tuple[int, int, int]] | None = None) -> tuple[int, str]:
        """``(size, crc32 hex)`` of the file at ``loc``, read once; with ``known``, ``(offset, length,
        crc32)`` of ranges :meth:`dcp_reader` checksummed already, only the bytes between them (only
        where :attr:`reads_checksums`, else a ``ValueError`` for any range)."""

    def dcp_reader(
        self,
        data: Location,
        metadata: Any = None,
        checksums: ReadRecorder | None = None,
    ) -> Any:
        """A DCP ``StorageReader`` for the sharded checkpoint files under ``data``.

        ``metadata``: the checkpoint's DCP ``Metadata`` already read (once, on rank 0, and shared); the
        reader's ``read_metadata`` returns it instead of reading ``.metadata`` again on every rank.
        ``checksums``: where the reader records the CRC-32 of the byte ranges it reads; only where
        :attr:`reads_checksums` (else ``ValueError``).
        """

    # -- the steps of a commit, in order ---------------------------------------------------------
    def prepare(
        self, target: Location, *, directory: bool, measure: bool = False
    ) -> tuple[str | None, int | None]:
        """Rank 0, first: the recovery rules for real, leftovers of crashed saves removed, and a refusal
        of what must not be replaced. Returns the published version's name where versions are kept
        (else ``None``) and, with ``measure``, the bytes free for the save (``statvfs`` of the target's
        filesystem; ``None`` where there is no such limit, or unmeasured)."""

    def stage(self, target: Location, *, directory: bool) -> Location:
        """A fresh staging location for ``target`` (a directory, or for a full file a local file name)."""

    def dcp_writer(self, staging: Location, **kwargs: Any) -> Any:
        """A DCP ``StorageWriter`` into ``staging`` that checksums what it writes (``.checksums``)."""

    def write_bytes(self, loc: Location, data: bytes) -> None:
        """Write ``data`` as the file at ``loc`` (inside a staging location)."""

    def seal_own(
        self, staging: Location, rank: int, written: Mapping[str, tuple[int, str]]
    ) -> list[FileEntry]:
        """Every rank, after writing: make this rank's files durable; their manifest entries."""

    def seal(
        self,
        staging: Location,
        entries: list[FileEntry],
        written: Mapping[str, tuple[int, str]],
        manifest: Manifest,
    ) -> Manifest:
        """Rank 0, with every rank's entries: check and complete them (rank 0's files), make the staged
        version durable, and return ``manifest`` (the commit's: world size, metadata...) with every file
        and this storage's own fields, put where :meth:`publish` needs it (locally: the staging
        directory's manifest, written last)."""

    def publish(
        self, staging: Location, target: Location, manifest: Manifest, previous: str | None, *, rank: int
    ) -> None:
        """Rank 0: make the sealed version visible at ``target``, then drop the previous one."""

    def publish_file(self, staged: Path, target: Location) -> None:
        """Make a written, durable full checkpoint file visible at ``target``."""

    def discard(self, staging: Location) -> None:
        """Delete a staging location after a failed save."""

    def remove(self, target: Location) -> None:
        """Remove the checkpoint at ``target`` with every leftover; ``FileNotFoundError`` if none."""


def backend_for(loc: Location | str | os.PathLike[str]) -> Backend:
    """The backend of a location: object storage for an fsspec URL, the local filesystem otherwise (the
    only place that branches on path versus URL)."""
    if isinstance(loc, str) and is_url(loc):
        from lightning_sharded.checkpoint.backends.objstore import ObjectStoreBackend

        return ObjectStoreBackend()
    return LocalBackend()


def read_manifest(directory: str | os.PathLike[str]) -> Manifest | None:
    """The manifest of a sharded checkpoint directory (local path, URL, or a published version's prefix).

    Returns:
        The manifest, or ``None`` when there is none (a checkpoint written by stock Lightning).

    Raises:
        CheckpointError: the manifest exists but cannot be parsed, or ``directory`` is an unpublished
            version on object storage.
    """
    data = location(directory)
    return backend_for(data).manifest_at(data)
