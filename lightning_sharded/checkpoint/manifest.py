"""The manifest of a sharded checkpoint: plain dataclasses and their JSON, nothing else.

The manifest (:data:`~lightning_sharded.checkpoint.names.MANIFEST_NAME`) lists every other file of
the checkpoint with its size and checksum, and records who wrote it (format, library, torch and
Lightning versions, world size) and the Lightning progress (epoch, global step). It is written last,
by rank 0, once every rank has written and fsynced its files, so a directory with a valid manifest is
complete. Reading it needs neither ``torch.distributed`` nor torch: the standard library only. Where a
manifest is read from (a local directory, an object store) is the backends' business.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from importlib import metadata as importlib_metadata
from typing import Any

from lightning_sharded.checkpoint.errors import CheckpointError

__all__ = [
    "CHECKSUM_ALGORITHM",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "OBJECT_STORE_FORMAT_VERSION",
    "PARTIAL_FORMAT_VERSION",
    "FileEntry",
    "FrozenPart",
    "Manifest",
]

#: Name of the manifest file inside a sharded checkpoint directory.
MANIFEST_NAME = "lightning_sharded.json"
#: The checksum algorithm written into manifests (``zlib.crc32``, see :mod:`~.checksum`).
CHECKSUM_ALGORITHM = "crc32"
#: Version of the on-disk layout described by :class:`Manifest`; bumped on incompatible changes.
FORMAT_VERSION = 1
#: Manifest format version written on object storage (it adds ``data_dir``; older readers refuse it).
OBJECT_STORE_FORMAT_VERSION = 2
#: Manifest format version of a trainable-only checkpoint (it adds ``frozen``; older readers refuse it
#: instead of loading a model without its frozen part). Other checkpoints keep their version.
PARTIAL_FORMAT_VERSION = 3
#: The newest format version this library reads.
READABLE_FORMAT_VERSION = PARTIAL_FORMAT_VERSION


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


@dataclass(frozen=True)
class FrozenPart:
    """What a trainable-only checkpoint does not hold, and where a load takes it from.

    Attributes:
        source: Where the frozen weights are: a Hugging Face directory or ``.safetensors`` file, a full
            checkpoint file or a sharded checkpoint directory (an absolute local path, or a URL).
        keys: The model keys left out (parameters with ``requires_grad=False``), sorted.
        prefix: The part of those keys the source's keys lack: model key ``prefix + key`` is the
            source's ``key`` (``"model."`` for a LightningModule holding the model as ``self.model``).
    """

    source: str
    keys: tuple[str, ...]
    prefix: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The part as plain JSON values (for the manifest, and a full file's checkpoint dict)."""
        return {"source": self.source, "keys": list(self.keys), "prefix": self.prefix}

    @classmethod
    def from_dict(cls, data: Any) -> FrozenPart:
        """Read :meth:`to_dict`'s output; a ``TypeError`` or ``KeyError`` for anything else."""
        if not isinstance(data, dict) or not isinstance(data["keys"], (list, tuple)):
            raise TypeError(f"a frozen part is a dict with a list of keys, not {data!r}")
        return cls(str(data["source"]), tuple(str(k) for k in data["keys"]), str(data.get("prefix", "")))


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
        frozen: A trainable-only checkpoint: the model keys it does not hold and where they are read
            from; ``None`` for a complete checkpoint. Setting it raises :attr:`format_version` to at
            least :data:`PARTIAL_FORMAT_VERSION`.
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
    frozen: FrozenPart | None = None

    def __post_init__(self) -> None:
        if self.frozen is not None and self.format_version < PARTIAL_FORMAT_VERSION:
            self.format_version = PARTIAL_FORMAT_VERSION

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
        return next((entry for entry in self.files if entry.path == path), None)

    def to_json(self) -> str:
        """The manifest as indented JSON text, keys in a stable order."""
        # Field by field: `asdict` copies every entry twice, deeply (0.5 s for 8,000 entries, the
        # manifest of a 4,096-rank save).
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("files", "metadata")}
        data["metadata"] = copy.deepcopy(self.metadata)
        entry_fields = [f.name for f in fields(FileEntry)]
        data["files"] = [
            {k: getattr(e, k) for k in entry_fields} for e in sorted(self.files, key=lambda e: e.path)
        ]
        for optional in ("data_dir", "frozen"):  # complete, local manifests stay as they were
            if data[optional] is None:
                del data[optional]
        if self.frozen is not None:
            data["frozen"] = self.frozen.to_dict()
        return json.dumps(data, indent=1, sort_keys=True, default=str) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = MANIFEST_NAME) -> Manifest:
        """Parse a manifest written by :meth:`to_json`.

        Raises:
            CheckpointError: the text is not a manifest, or one written by a newer format version.
        """
        try:
            if isinstance(text, bytes):
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise CheckpointError(
                        f"The manifest {source!r} is not UTF-8 text. The checkpoint is damaged: restore it"
                        " from a copy, or delete the manifest to load it unchecked."
                    ) from err
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
            kwargs = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "files"}
            if kwargs.get("frozen") is not None:
                kwargs["frozen"] = FrozenPart.from_dict(kwargs["frozen"])
            return cls(files=files, **kwargs)
        except CheckpointError:
            raise
        except (ValueError, TypeError, KeyError) as err:
            raise CheckpointError(
                f"The manifest {source!r} is not valid JSON of a lightning_sharded manifest ({err}). The"
                " checkpoint directory is damaged: restore it from a copy, or delete the manifest to load it"
                " unchecked."
            ) from err
