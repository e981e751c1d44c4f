"""Checkpoints on object storage (S3 and other fsspec URLs), where there is no atomic rename: each
version under ``URL/data-<token>``, published by one ``PUT`` of the manifest ``URL/lightning_sharded.json``
that names it (``data_dir``), the previous version deleted only then. The layout, the steps and what
they assume of the store: ``docs/cluster.md``, "How a save is published where there is no rename".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from torch.utils.serialization import config as torch_save  # its settings: context variables

from lightning_sharded._compat import fsspec_filesystem
from lightning_sharded.checkpoint import names
from lightning_sharded.checkpoint.backends.dcp_writer import ChecksumsKept
from lightning_sharded.checkpoint.backends.paths import Location, basename, join, listed_sizes
from lightning_sharded.checkpoint.backends.retry import Retrying
from lightning_sharded.checkpoint.checksum import CHUNK_SIZE, HashingStream, stream_checksum
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.faults import FaultPoint, fault
from lightning_sharded.checkpoint.manifest import OBJECT_STORE_FORMAT_VERSION, FileEntry, Manifest

if TYPE_CHECKING:
    from lightning_sharded.checkpoint.backends.dcp_reader import ReadRecorder

__all__ = ["ObjectStoreBackend", "filesystem"]

log = logging.getLogger(__name__)

_NO_CHECKSUMS = "torch's fsspec reader records no checksums (reads_checksums is False)"


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url``, its requests :class:`~.retry.Retrying`, and the path in it (no
    protocol): ``(S3FileSystem, "b/k")``."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    # Other processes (the other ranks) write too: never trust a listing cached in this process.
    fs.invalidate_cache(str(path))
    return Retrying(fs), str(path)


def _url(loc: Location) -> str:
    assert isinstance(loc, str), loc
    return loc


def _listing(url: str) -> list[dict[str, Any]]:
    fs, path = filesystem(url)
    try:
        listing = fs.ls(path, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    return [e for e in listing if str(e["name"]).rstrip("/") != path.rstrip("/")]


def _hashing_filesystem() -> Any:
    class HashingFileSystem(ChecksumsKept, fsspec_filesystem().FileSystem):  # type: ignore[misc]
        """torch's fsspec filesystem for DCP, checksumming every file while it is written."""

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with super().create_stream(path, mode) as raw:
                stream = HashingStream(raw)  # type: ignore[arg-type]
                # No torch.save record CRC-32 in this file (only): the manifest's CRC-32 covers the file.
                with torch_save.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
                    yield stream
                figures = stream.result()
            with self._lock:
                self.checksums[basename(os.fspath(path))] = figures

    return HashingFileSystem()


class ObjectStoreBackend:
    """fsspec URLs: versions under ``data-<token>``, published by writing the manifest last."""

    noun = "prefix"
    place = "URL"
    reads_checksums = False
    hint = "Check the URL and the credentials/endpoint (AWS_* variables)."

    def _manifest(self, url: str) -> Manifest | None:
        key = _url(join(url, names.MANIFEST_NAME))
        try:
            text = self.read_bytes(key)
        except FileNotFoundError:
            return None
        return Manifest.from_json(text, source=key)

    def locate(self, target: Location) -> tuple[Location, Manifest | None]:
        url = _url(target).rstrip("/")
        if names.DATA_DIR.match(basename(url)):  # a version itself: only if its checkpoint publishes it
            return url, self.manifest_at(url)
        manifest = self._manifest(url)
        # No data_dir: a manifest of a local checkpoint copied to object storage, its files next to it.
        if manifest is None or not manifest.data_dir:
            return url, manifest
        if "/" in manifest.data_dir or not names.DATA_DIR.match(manifest.data_dir):
            raise CheckpointError(
                f"The manifest of {url!r} names the data directory {manifest.data_dir!r}, which is not one"
                " this library writes. The manifest is damaged: restore the checkpoint from a copy."
            )
        return join(url, manifest.data_dir), manifest

    def manifest_at(self, data: Location) -> Manifest | None:
        url = _url(data).rstrip("/")
        parent, _, name = url.rpartition("/")
        if not names.DATA_DIR.match(name):
            return self._manifest(url)
        manifest = self._manifest(parent)
        if manifest is None or manifest.data_dir != name:
            raise CheckpointError(
                f"{url!r} is a version of the checkpoint {parent!r} that is not published (a save that did"
                f" not finish, or a previous version being deleted). Load {parent!r} itself."
            )
        return manifest

    def manifest_is_stale(self, target: Location, manifest: Manifest) -> bool:
        # Ours keeps its files under data-<token> and deletes stock files at the top when it publishes:
        # a `.metadata` at the top, as new as the manifest or newer, is a stock save written since.
        if not manifest.data_dir:
            return False
        url = _url(target).rstrip("/")
        index, ours = self._mtime(join(url, names.DCP_METADATA)), self._mtime(join(url, names.MANIFEST_NAME))
        return index is not None and ours is not None and index >= ours

    def exists(self, loc: Location) -> bool:
        fs, path = filesystem(_url(loc))
        return bool(fs.exists(path))

    def is_file(self, loc: Location) -> bool:
        fs, path = filesystem(_url(loc))
        return bool(fs.isfile(path))

    def size(self, loc: Location) -> int:
        fs, path = filesystem(_url(loc))
        return int(fs.info(path)["size"])

    def _mtime(self, loc: Location) -> float | None:
        fs, path = filesystem(_url(loc))
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return None
        value = info.get("LastModified", info.get("created", info.get("mtime")))
        if isinstance(value, datetime):
            return value.timestamp()
        return float(value) if isinstance(value, int | float) else None

    def list_files(self, loc: Location) -> dict[str, int]:
        return {
            basename(str(e["name"])): int(e.get("size") or 0)
            for e in _listing(_url(loc))
            if e.get("type") == "file"
        }

    def list_dirs(self, loc: Location) -> list[str]:
        return sorted(basename(str(e["name"])) for e in _listing(_url(loc)) if e.get("type") == "directory")

    @contextlib.contextmanager
    def open_file(self, loc: Location) -> Iterator[IO[bytes]]:
        fs, path = filesystem(_url(loc))
        with fs.open(path, "rb") as f:
            yield f

    def read_bytes(self, loc: Location) -> bytes:
        fs, path = filesystem(_url(loc))
        return bytes(fs.cat_file(path))

    def torch_load(self, loc: Location, **kwargs: Any) -> Any:
        import torch

        kwargs.pop("mmap", None)
        with self.open_file(loc) as f:
            return torch.load(f, **kwargs)

    @contextlib.contextmanager
    def local_file(self, loc: Location) -> Iterator[Path]:
        fs, path = filesystem(_url(loc))
        with tempfile.TemporaryDirectory(prefix="lightning-sharded-") as tmp:
            local = Path(tmp) / basename(loc)
            fs.get_file(path, os.fspath(local))
            yield local

    def checksum(self, loc: Location, known: Sequence[tuple[int, int, int]] | None = None) -> tuple[int, str]:
        if known:
            raise ValueError(_NO_CHECKSUMS)
        fs, path = filesystem(_url(loc))
        with fs.open(path, "rb", block_size=CHUNK_SIZE) as f:
            return stream_checksum(f)

    def dcp_reader(
        self,
        data: Location,
        metadata: Any = None,
        checksums: ReadRecorder | None = None,
    ) -> Any:
        from lightning_sharded.checkpoint.backends.dcp_reader import fsspec_reader

        if checksums is not None:
            raise ValueError(_NO_CHECKSUMS)
        return fsspec_reader(_url(data), metadata)

    def prepare(
        self, target: Location, *, directory: bool, measure: bool = False
    ) -> tuple[str | None, int | None]:
        url = _url(target)
        manifest = self._manifest(url)
        if not directory:
            if manifest is not None or names.DCP_METADATA in self.list_files(url):
                raise CheckpointError(
                    f"{url!r} holds a sharded checkpoint; saving a full checkpoint file there would leave"
                    " both until the directory is deleted, which object storage cannot do atomically. Remove"
                    " it first, or save to another URL."
                )
            return None, None  # no filesystem to fill: object stores skip the space check
        if manifest is None and self.is_file(url):
            raise CheckpointError(
                f"{url!r} is a full checkpoint file (one object); saving a sharded checkpoint there would"
                " leave both until the file is deleted, which object storage cannot do atomically. Remove"
                " it first, or save to another URL."
            )
        current = manifest.data_dir if manifest is not None else None
        for name in self.list_dirs(url):
            if names.DATA_DIR.match(name) and name != current:
                log.info("Removing %s/%s left by an interrupted save", url, name)
                self._remove_tree(join(url, name))
        return current, None

    def stage(self, target: Location, *, directory: bool) -> Location:
        if directory:  # object storage has no directories to create
            return join(_url(target), names.data_dir_name())
        return Path(tempfile.mkdtemp(prefix="lightning-sharded-")) / basename(target)

    def dcp_writer(self, staging: Location, **kwargs: Any) -> Any:
        kwargs.pop("thread_count", None)
        writer = fsspec_filesystem().FsspecWriter(_url(staging), **kwargs)
        hashing = _hashing_filesystem()
        hashing.fs = writer.fs.fs  # type: ignore[attr-defined]
        writer.fs = hashing
        writer.checksums = hashing.checksums  # type: ignore[attr-defined]
        return writer

    def write_bytes(self, loc: Location, data: bytes) -> None:
        """One request (one ``PUT`` on S3: atomic, all or nothing)."""
        fs, path = filesystem(_url(loc))
        fs.pipe_file(path, data)
        fs.invalidate_cache(path)

    def seal_own(
        self, staging: Location, rank: int, written: Mapping[str, tuple[int, str]]
    ) -> list[FileEntry]:
        return [FileEntry(name, size, checksum, rank) for name, (size, checksum) in sorted(written.items())]

    def seal(
        self,
        staging: Location,
        entries: list[FileEntry],
        written: Mapping[str, tuple[int, str]],
        manifest: Manifest,
    ) -> Manifest:
        present = self.list_files(staging)
        stored_sizes = listed_sizes(self.list_files, staging, (e.path for e in entries), {"": present})
        claimed: dict[str, FileEntry] = {}
        for entry in entries:
            if entry.path in claimed:
                raise CheckpointError(
                    f"{entry.path!r} in {staging!r} was written by ranks {claimed[entry.path].rank}"
                    f" and {entry.rank}; DCP names every rank's files apart."
                )
            stored = stored_sizes.get(entry.path)
            if stored != entry.size:
                raise CheckpointError(
                    f"{staging}/{entry.path} (rank {entry.rank}) has {stored} bytes in the"
                    f" store, {entry.size} were written. The store lost or cut the upload; save again."
                )
            claimed[entry.path] = entry
        unclaimed = sorted(set(present) - set(claimed))
        if unclaimed:
            raise CheckpointError(
                f"{staging!r} holds files no rank reported writing: {unclaimed}. Another process writes to"
                " this prefix; make sure only one job saves to a checkpoint URL at a time."
            )
        fault(FaultPoint.BEFORE_MANIFEST, 0)
        # The version's own fields: written by publish(), whose one PUT of it is the publish.
        return dataclasses.replace(
            manifest,
            files=sorted(claimed.values(), key=lambda e: e.path),
            format_version=max(manifest.format_version, OBJECT_STORE_FORMAT_VERSION),
            data_dir=basename(staging),
        )

    def publish(
        self, staging: Location, target: Location, manifest: Manifest, previous: str | None, *, rank: int
    ) -> None:
        url = _url(target)
        try:
            self.write_bytes(join(url, names.MANIFEST_NAME), manifest.to_json().encode("utf-8"))
        except BaseException:
            with contextlib.suppress(Exception):
                current = self._manifest(url)
                if current is None or current.data_dir != manifest.data_dir:
                    self.discard(staging)
            raise
        fault(FaultPoint.AFTER_PUBLISH, rank)
        stale = [join(url, previous)] if previous and previous != manifest.data_dir else []
        # The files a stock save (no manifest) keeps at the top: these two and its __<rank>_<i>.distcp.
        stock = (names.DCP_METADATA, names.LIGHTNING_METADATA)
        stale += [join(url, n) for n in self.list_files(url) if n in stock or names.SHARD_FILE.match(n)]
        try:
            for index, old in enumerate(stale):
                self._remove_tree(old)
                if index == 0:
                    fault(FaultPoint.DURING_REMOVE, rank)
        except Exception as err:  # the new version is published: what is left goes with the next save
            log.warning("Published %s, but could not delete the previous version (%s): %s", url, stale, err)

    def publish_file(self, staged: Path, target: Location) -> None:
        """Upload; on S3 the object appears whole when the upload completes, or not at all."""
        fs, path = filesystem(_url(target))
        try:
            fs.put_file(os.fspath(staged), path)
            fs.invalidate_cache(path)
        finally:
            self.discard(staged)

    def discard(self, staging: Location) -> None:
        if isinstance(staging, Path):  # a full file staged locally
            shutil.rmtree(staging.parent, ignore_errors=True)
            return
        self._remove_tree(staging)

    def _remove_tree(self, loc: Location) -> None:
        fs, path = filesystem(_url(loc))
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path, recursive=True)
        fs.invalidate_cache(path)

    def remove(self, target: Location) -> None:
        """The manifest goes first: an interrupted removal leaves a prefix loads call not published."""
        url = _url(target).rstrip("/")
        if not self.exists(url):
            raise FileNotFoundError(f"There is no checkpoint to remove at {url!r}.")
        if self.is_file(url):
            self._remove_tree(url)
            return
        self._remove_tree(join(url, names.MANIFEST_NAME))
        self._remove_tree(url)
