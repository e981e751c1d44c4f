"""Where checkpoint bytes live: one :class:`Backend` protocol, a local and an object-store implementation.

:func:`backend_for` is the one place that tells a local path from an fsspec URL (``s3://bucket/key``,
``memory://...``); everything above it asks the backend it returns. A *location* is either a
:class:`pathlib.Path` (local) or a ``str`` URL; :func:`location` never turns a URL into a ``Path``
(``Path("s3://b/k")`` is ``s3:/b/k``, the bug stock Lightning has for sharded checkpoints).

The protocol's methods come in the order a load and a save use them: what is at a location and
where the published version's files are (:meth:`Backend.locate`, with the recovery rules of an
interrupted save), reading files, then the steps of a commit (:meth:`Backend.prepare`,
:meth:`Backend.stage`, :meth:`Backend.dcp_writer`, :meth:`Backend.seal_own`, :meth:`Backend.seal`,
:meth:`Backend.write_manifest`, :meth:`Backend.publish`, :meth:`Backend.discard`) and removal.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from lightning_sharded.checkpoint.backends.local import LocalBackend
from lightning_sharded.checkpoint.backends.objstore import ObjectStoreBackend
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
    from lightning_sharded.checkpoint.manifest import FileEntry, Manifest

__all__ = [
    "Backend",
    "LocalBackend",
    "Location",
    "ObjectStoreBackend",
    "absolute",
    "backend_for",
    "basename",
    "is_url",
    "join",
    "local_path",
    "location",
    "parent",
]


class Backend(Protocol):
    """The operations on one kind of storage that loads, saves, checks and tools need.

    Implementations: :class:`~.local.LocalBackend` (POSIX paths; publish by rename) and
    :class:`~.objstore.ObjectStoreBackend` (fsspec URLs; publish by writing the manifest last).
    Stateless and picklable, so a decision about a location can travel between ranks.
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
        """Where the files of the checkpoint published at ``target`` are, and its manifest (read-only).

        Applies the recovery rules of an interrupted save. Raises ``CheckpointError`` for a manifest
        that cannot be parsed.
        """
        ...

    def manifest_at(self, data: Location) -> Manifest | None:
        """The manifest that describes the files under ``data``, or ``None`` (a stock checkpoint)."""
        ...

    def manifest_is_stale(self, target: Location, manifest: Manifest) -> bool:
        """Whether a stock save wrote over the checkpoint after ``manifest`` (which is then stale)."""
        ...

    def unpublished(self, target: Location) -> list[str]:
        """Names of versions below ``target`` that a save staged but never published."""
        ...

    # -- reading ---------------------------------------------------------------------------------
    def exists(self, loc: Location) -> bool:
        """Whether a file or directory (a key or a prefix) is at ``loc``."""
        ...

    def is_file(self, loc: Location) -> bool:
        """Whether ``loc`` is a file (an object)."""
        ...

    def size(self, loc: Location) -> int:
        """Size in bytes of the file at ``loc``; ``FileNotFoundError`` if there is none."""
        ...

    def mtime(self, loc: Location) -> float | None:
        """Last modification time of the file at ``loc`` (seconds since the epoch), if known."""
        ...

    def list_files(self, loc: Location) -> dict[str, int]:
        """The files directly inside directory (prefix) ``loc``: ``{name: size}``; empty if none."""
        ...

    def list_dirs(self, loc: Location) -> list[str]:
        """The directories (common prefixes) directly inside ``loc``, sorted."""
        ...

    def open_file(self, loc: Location) -> AbstractContextManager[IO[bytes]]:
        """The file at ``loc``, open for reading, seekable."""
        ...

    def read_bytes(self, loc: Location) -> bytes:
        """The whole content of the file at ``loc``."""
        ...

    def torch_load(self, loc: Location, **kwargs: Any) -> Any:
        """``torch.load`` of the file at ``loc`` (memory-mapping allowed where it is local)."""
        ...

    def local_file(self, loc: Location) -> AbstractContextManager[Path]:
        """A local path with the content of the file at ``loc`` (itself, or a temporary download)."""
        ...

    def checksum(self, loc: Location, known: Sequence[tuple[int, int, int]] | None = None) -> tuple[int, str]:
        """``(size, crc32 hex)`` of the file at ``loc``, read once.

        ``known``: ``(offset, length, crc32)`` of byte ranges already checksummed (what :meth:`dcp_reader`
        recorded): only the bytes between them are read. Only where :attr:`reads_checksums` (else a
        ``ValueError`` for any range).
        """
        ...

    def dcp_reader(self, data: Location, metadata: Any = None, checksums: ReadRecorder | None = None) -> Any:
        """A DCP ``StorageReader`` for the sharded checkpoint files under ``data``.

        ``metadata``: the checkpoint's DCP ``Metadata`` already read (once, on rank 0, and shared); the
        reader's ``read_metadata`` returns it instead of reading ``.metadata`` again on every rank.
        ``checksums``: where the reader records the CRC-32 of the byte ranges it reads; only where
        :attr:`reads_checksums` (else ``ValueError``).
        """
        ...

    # -- the steps of a commit, in order ---------------------------------------------------------
    def prepare(self, target: Location, *, directory: bool) -> str | None:
        """Rank 0, first: recovery rules for real, leftovers of crashed saves removed, and a refusal of
        what must not be replaced; returns the published version's name where versions are kept."""
        ...

    def free_space(self, target: Location) -> int | None:
        """Bytes free for a save at ``target`` (its filesystem's, ``statvfs``), or ``None`` where there
        is no such limit to check (object storage)."""
        ...

    def stage(self, target: Location, *, directory: bool) -> Location:
        """A fresh staging location for ``target`` (a directory, or for a full file a local file name)."""
        ...

    def dcp_writer(self, staging: Location, **kwargs: Any) -> Any:
        """A DCP ``StorageWriter`` into ``staging`` that checksums what it writes (``.checksums``)."""
        ...

    def write_bytes(self, loc: Location, data: bytes) -> None:
        """Write ``data`` as the file at ``loc`` (inside a staging location)."""
        ...

    def seal_own(
        self, staging: Location, rank: int, written: Mapping[str, tuple[int, str]]
    ) -> list[FileEntry]:
        """Every rank, after writing: make this rank's files durable; their manifest entries."""
        ...

    def seal(
        self, staging: Location, entries: list[FileEntry], written: Mapping[str, tuple[int, str]]
    ) -> list[FileEntry]:
        """Rank 0, with every rank's entries: check and complete them (rank 0's files); all entries."""
        ...

    def manifest_fields(self, staging: Location) -> dict[str, Any]:
        """What this storage adds to the manifest of a version staged at ``staging``."""
        ...

    def write_manifest(self, staging: Location, manifest: Manifest) -> None:
        """Rank 0: put the manifest where :meth:`publish` needs it (inside the staging directory)."""
        ...

    def publish(
        self, staging: Location, target: Location, manifest: Manifest, previous: str | None, *, rank: int
    ) -> None:
        """Rank 0: make the staged, durable version visible at ``target``, then drop the previous one."""
        ...

    def publish_file(self, staged: Path, target: Location) -> None:
        """Make a written, durable full checkpoint file visible at ``target``."""
        ...

    def discard(self, staging: Location) -> None:
        """Delete a staging location after a failed save."""
        ...

    def remove(self, target: Location) -> None:
        """Remove the checkpoint at ``target`` with every leftover; ``FileNotFoundError`` if none."""
        ...


def backend_for(loc: Location | str | os.PathLike[str]) -> Backend:
    """The backend of a location: object storage for an fsspec URL, the local filesystem otherwise.

    The only place that branches on path versus URL.
    """
    if isinstance(loc, str) and is_url(loc):
        return ObjectStoreBackend()
    return LocalBackend()
