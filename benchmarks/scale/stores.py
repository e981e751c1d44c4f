"""Where the simulated checkpoints go: a local directory or S3 (the moto server), one :class:`Store` each.

A store names the checkpoint of each run (``target``), puts the other ranks' shard files in place
(``replicate``, for :class:`benchmarks.scale.simworld.SimWorld`), and reads back the sizes of the
manifest and of ``.metadata``. A new backend is one class here and its branch in ``__main__``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


def copy_local(root: Path) -> Callable[[str, str], tuple[int, str]]:
    """A ``replicate`` for :class:`SimWorld` that copies shard files inside the staging directory ``root``."""
    from lightning_sharded.checkpoint.checksum import file_checksum

    figures: dict[str, tuple[int, str]] = {}

    def replicate(mine: str, other: str) -> tuple[int, str]:
        try:  # the same bytes: a hard link is enough, and fast
            os.link(root / mine, root / other)
        except OSError:
            shutil.copyfile(root / mine, root / other)
        if mine not in figures:
            figures[mine] = file_checksum(root / mine)
        return figures[mine]

    def put(rel: str, data: bytes) -> tuple[int, str]:  # another rank's own small file (its index)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        return len(data), f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"

    def read(rel: str) -> bytes | None:
        return (root / rel).read_bytes() if (root / rel).exists() else None

    replicate.put = put  # type: ignore[attr-defined]  # SimWorld writes the other ranks' index files
    replicate.read = read  # type: ignore[attr-defined]
    return replicate


class Store(Protocol):
    """What a run needs of where its checkpoints are."""

    name: str

    def target(self, label: str) -> Any:
        """The location of the checkpoint called ``label``."""

    def replicate(self, staging: Any) -> Callable[[str, str], tuple[int, str]]:
        """A copier of rank 0's shard files (relative paths) to other ranks' inside ``staging``."""

    def drop_index(self, target: Any) -> None:
        """Take the per-rank index out of the checkpoint at ``target`` (its files, manifest entries)."""

    def cleanup_strays(self, target: Any) -> None:
        """Remove what a replayed rank's save left beside ``target``."""

    def size(self, loc: Any) -> int:
        """Bytes of the object at ``loc`` (0 if absent)."""

    def manifest(self, target: Any) -> Any:
        """Where the manifest of the checkpoint at ``target`` is."""

    def index(self, target: Any, name: str = ".metadata") -> Any:
        """Where the ``.metadata`` (or another file ``name``) of the checkpoint at ``target`` is."""


def _without_index(manifest_text: str) -> str:
    from lightning_sharded.checkpoint import names
    from lightning_sharded.checkpoint.manifest import Manifest

    manifest = Manifest.from_json(manifest_text)
    kept = [e for e in manifest.files if not e.path.startswith(names.INDEX_DIR + "/")]
    return dataclasses.replace(manifest, files=kept).to_json()


class Local:
    """Checkpoints in a local directory; the other ranks' shards are hard links to rank 0's."""

    name = "local"

    def __init__(self, root: Path) -> None:
        self.root = root

    def target(self, label: str) -> Any:
        return self.root / label

    def replicate(self, staging: Any) -> Callable[[str, str], tuple[int, str]]:
        return copy_local(Path(staging))

    def drop_index(self, target: Any) -> None:
        """The per-rank index out of the checkpoint at ``target`` (its files and manifest entries)."""
        from lightning_sharded.checkpoint import names

        shutil.rmtree(Path(target) / names.INDEX_DIR)
        manifest = Path(target) / names.MANIFEST_NAME
        manifest.write_text(_without_index(manifest.read_text()))

    def cleanup_strays(self, target: Any) -> None:
        from lightning_sharded.checkpoint.backends.local import leftovers

        for stray in [*leftovers(target), *Path(target).parent.glob(f"{Path(target).name}-rank*")]:
            shutil.rmtree(stray, ignore_errors=True)

    def size(self, loc: Any) -> int:
        return os.path.getsize(loc) if os.path.exists(loc) else 0

    def manifest(self, target: Any) -> Any:
        return Path(target) / "lightning_sharded.json"

    def index(self, target: Any, name: str = ".metadata") -> Any:
        return Path(target) / name


class S3:
    """Checkpoints under an ``s3://`` prefix; the other ranks' shards are server-side copies."""

    name = "s3"

    def __init__(self, base: str) -> None:
        self.base = base
        self.prefix = base.removeprefix("s3://")

    def target(self, label: str) -> Any:
        return f"{self.base}/{label}"

    def _fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem()

    def replicate(self, staging: Any) -> Callable[[str, str], tuple[int, str]]:
        fs = self._fs()
        root = str(staging).removeprefix("s3://")

        figures: dict[str, tuple[int, str]] = {}
        pending: list[tuple[str, str]] = []

        def copy(mine: str, other: str) -> tuple[int, str]:
            pending.append((f"{root}/{mine}", f"{root}/{other}"))
            if mine not in figures:
                data = fs.cat_file(f"{root}/{mine}")
                figures[mine] = len(data), f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
            return figures[mine]

        def flush() -> None:  # server-side copies, many at a time
            if pending:
                fs.copy([a for a, _ in pending], [b for _, b in pending])
                pending.clear()

        def put(rel: str, data: bytes) -> tuple[int, str]:
            fs.pipe_file(f"{root}/{rel}", data)
            return len(data), f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"

        def read(rel: str) -> bytes | None:
            path = f"{root}/{rel}"
            return bytes(fs.cat_file(path)) if fs.exists(path) else None

        copy.flush = flush  # type: ignore[attr-defined]  # SimWorld calls it after a gather
        copy.put = put  # type: ignore[attr-defined]  # the other ranks' index files
        copy.read = read  # type: ignore[attr-defined]
        return copy

    def drop_index(self, target: Any) -> None:
        raise NotImplementedError("the runs without the per-rank index (ours-whole) are local only")

    def cleanup_strays(self, target: Any) -> None:
        return None  # a replayed rank's writes go beside the published version (data-<token>-rank<r>)

    def size(self, loc: Any) -> int:
        fs = self._fs()
        fs.invalidate_cache()
        path = str(loc).removeprefix("s3://")
        return int(fs.info(path)["size"]) if fs.exists(path) else 0

    def manifest(self, target: Any) -> Any:
        return f"{target}/lightning_sharded.json"

    def index(self, target: Any, name: str = ".metadata") -> Any:
        """Where the ``.metadata`` (or another file ``name``) of the checkpoint at ``target`` is (ours: in
        the published version)."""
        fs = self._fs()
        path = str(self.manifest(target)).removeprefix("s3://")
        if fs.exists(path):
            data_dir = json.loads(fs.cat_file(path)).get("data_dir")
            if data_dir:
                return f"{target}/{data_dir}/{name}"
        return f"{target}/{name}"
