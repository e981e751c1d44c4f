"""The manifest of a sharded checkpoint directory: plain dataclasses, JSON on disk.

The manifest (:data:`MANIFEST_NAME` inside the checkpoint directory) lists every other file of the
checkpoint with its size and checksum, and records who wrote it (format, library, torch and Lightning
versions, world size) and the Lightning progress (epoch, global step). It is written last, by rank 0,
once every rank has written and fsynced its files, so a directory with a valid manifest is complete.

This module uses the standard library only: a manifest can be read and checked on a machine without
``torch.distributed`` (or without torch at all).

The checksum is CRC-32 (``zlib.crc32``). Measured on the project's machines it runs at about
4.2 GB/s, well above the 1.0-1.6 GB/s at which these disks write (blake2b: 0.9 GB/s, sha256:
1.8 GB/s), so checksumming adds little to a save; it catches every 1- and 2-bit error and every burst
up to 32 bits, which is what a checkpoint needs (protection against corruption, not against an
attacker). ``benchmarks/checksum_throughput.py`` reproduces the figures.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from lightning_sharded.checkpoint.errors import CheckpointError

__all__ = [
    "CHECKSUM_ALGORITHM",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "FileEntry",
    "Manifest",
    "file_checksum",
    "read_manifest",
]

#: Name of the manifest file inside a sharded checkpoint directory.
MANIFEST_NAME = "lightning_sharded.json"
#: Version of the on-disk layout described by :class:`Manifest`; bumped on incompatible changes.
FORMAT_VERSION = 1
#: The newest format version this library reads: 2 adds :attr:`Manifest.data_dir` (object storage).
READABLE_FORMAT_VERSION = 2
#: The only checksum algorithm written so far; recorded in each manifest so it can change later.
CHECKSUM_ALGORITHM = "crc32"
#: Bytes read per call while checksumming a file.
CHUNK_SIZE = 8 << 20


def file_checksum(
    path: str | os.PathLike[str], *, fsync: bool = False, on_chunk: Callable[[int], None] | None = None
) -> tuple[int, str]:
    """Size and CRC-32 of a file, read in chunks of :data:`CHUNK_SIZE` bytes.

    Args:
        path: The file.
        fsync: Also ``fsync`` the file, so its bytes are on disk before it is listed in a manifest.
        on_chunk: Called with the size of every chunk read (a progress bar).

    Returns:
        ``(size in bytes, checksum)`` with the checksum as 8 lowercase hex digits.
    """
    crc = 0
    size = 0
    buffer = bytearray(CHUNK_SIZE)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
            if on_chunk is not None:
                on_chunk(n)
        if fsync:
            os.fsync(f.fileno())
    return size, f"{crc & 0xFFFFFFFF:08x}"


def _version(distribution: str) -> str:
    try:
        return importlib_metadata.version(distribution)
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint directory.

    Attributes:
        path: Path relative to the checkpoint directory, with ``/`` separators.
        size: Size in bytes.
        checksum: :data:`CHECKSUM_ALGORITHM` of the content, as lowercase hex.
        rank: The rank that wrote (and checksummed) the file.
    """

    path: str
    size: int
    checksum: str
    rank: int = 0


@dataclass
class Manifest:
    """What a sharded checkpoint directory holds; serialized as :data:`MANIFEST_NAME`.

    Attributes:
        files: Every file of the checkpoint except the manifest itself, sorted by path.
        world_size: Number of ranks that wrote the checkpoint.
        metadata: Lightning progress and anything the writer adds: ``epoch``, ``global_step``.
        format_version: :data:`FORMAT_VERSION` at write time.
        checksum_algorithm: Algorithm of :attr:`FileEntry.checksum`.
        library_version: ``lightning-sharded`` version that wrote it.
        torch_version: torch version that wrote it.
        lightning_version: Lightning version that wrote it.
        created: Time of the commit, ISO 8601 in UTC.
        data_dir: Object storage only: the directory (next to the manifest) that holds the files of the
            published version; ``None`` when they sit next to the manifest.
    """

    files: list[FileEntry]
    world_size: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    library_version: str = field(default_factory=lambda: _version("lightning-sharded"))
    torch_version: str = field(default_factory=lambda: _version("torch"))
    lightning_version: str = field(default_factory=lambda: _version("lightning"))
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    data_dir: str | None = None

    @property
    def epoch(self) -> int | None:
        """The Lightning epoch recorded at save time, if any."""
        value = self.metadata.get("epoch")
        return int(value) if value is not None else None

    @property
    def global_step(self) -> int | None:
        """The Lightning global step recorded at save time, if any."""
        value = self.metadata.get("global_step")
        return int(value) if value is not None else None

    @property
    def total_size(self) -> int:
        """Bytes in all listed files."""
        return sum(entry.size for entry in self.files)

    def entry(self, path: str) -> FileEntry | None:
        """The entry for ``path`` (relative, ``/`` separators), or ``None``."""
        for entry in self.files:
            if entry.path == path:
                return entry
        return None

    def to_json(self) -> str:
        """The manifest as indented JSON text, keys in a stable order."""
        data = asdict(self)
        data["files"] = [asdict(entry) for entry in sorted(self.files, key=lambda e: e.path)]
        if data["data_dir"] is None:  # local manifests stay as they were
            del data["data_dir"]
        return json.dumps(data, indent=1, sort_keys=True, default=str) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str = MANIFEST_NAME) -> Manifest:
        """Parse a manifest written by :meth:`to_json`.

        Raises:
            CheckpointError: the text is not a manifest, or one written by a newer format version.
        """
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError("the top level is not an object")
            version = int(data.get("format_version", -1))
            if version > READABLE_FORMAT_VERSION:
                raise CheckpointError(
                    f"The manifest {source!r} has format version {version}, newer than the"
                    f" {READABLE_FORMAT_VERSION} this version of lightning_sharded reads. Upgrade"
                    " lightning_sharded to load this checkpoint."
                )
            files = [
                FileEntry(str(e["path"]), int(e["size"]), str(e["checksum"]), int(e.get("rank", 0)))
                for e in data["files"]
            ]
            known = {f for f in cls.__dataclass_fields__ if f != "files"}
            kwargs = {k: v for k, v in data.items() if k in known}
            return cls(files=files, **kwargs)
        except CheckpointError:
            raise
        except (ValueError, TypeError, KeyError) as err:
            raise CheckpointError(
                f"The manifest {source!r} is not valid JSON of a lightning_sharded manifest ({err}). The"
                " checkpoint directory is damaged: restore it from a copy, or delete the manifest to load it"
                " unchecked."
            ) from err


def read_manifest(directory: str | os.PathLike[str]) -> Manifest | None:
    """Read the manifest of a checkpoint directory.

    Args:
        directory: A sharded checkpoint directory.

    Returns:
        The manifest, or ``None`` when the directory has none (a checkpoint written by stock Lightning).

    Raises:
        CheckpointError: the manifest exists but cannot be parsed.
    """
    if isinstance(directory, str) and "://" in directory:
        from lightning_sharded.checkpoint import storage

        if storage.is_url(directory):  # the manifest that publishes this version, on object storage
            from lightning_sharded.checkpoint.object_store import manifest_for

            return manifest_for(directory)
    path = Path(directory) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as err:
        raise CheckpointError(
            f"The manifest {str(path)!r} is not UTF-8 text. The checkpoint directory is damaged: restore it"
            " from a copy, or delete the manifest to load it unchecked."
        ) from err
    return Manifest.from_json(text, source=str(path))
