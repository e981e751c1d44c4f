"""Where checkpoint bytes live: local paths, or fsspec URLs (``s3://bucket/key``, ``memory://...``).

One small set of functions that every module reading or writing checkpoint files goes through, so a
checkpoint path may be a URL everywhere a local path works. A *location* is either a
:class:`pathlib.Path` (local) or a ``str`` URL; :func:`location` tells them apart and never turns a
URL into a ``Path`` (``Path("s3://b/k")`` is ``s3:/b/k``, the bug stock Lightning has for sharded
checkpoints). Local paths keep exactly the calls they always had (``open``, ``os.stat``, torch's
``FileSystemWriter``/``FileSystemReader``); URLs go through the fsspec filesystem of their protocol
(``s3fs`` for ``s3://``) and torch's ``FsspecWriter``/``FsspecReader``.

Credentials and endpoints come from wherever the fsspec filesystem looks: for S3, the usual
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_ENDPOINT_URL`` / ``AWS_PROFILE`` variables,
``~/.aws``, or fsspec's own configuration (``FSSPEC_S3_ENDPOINT_URL``, ``~/.config/fsspec/``).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "Location",
    "basename",
    "call_with_local_file",
    "dcp_reader",
    "dcp_writer",
    "exists",
    "filesystem",
    "is_file",
    "is_url",
    "join",
    "list_dirs",
    "list_files",
    "local_copy",
    "location",
    "open_file",
    "put_file",
    "read_bytes",
    "remove_tree",
    "size",
    "torch_load",
    "url_checksum",
    "write_bytes",
]

#: A checkpoint location: a local path, or an fsspec URL kept as a string.
Location = Path | str

_LOCAL_PROTOCOLS = ("file", "local")
#: Bytes read per request while checksumming an object.
CHUNK_SIZE = 8 << 20


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URL of a non-local fsspec filesystem (``s3://...``, ``memory://...``)."""
    if not isinstance(path, str):
        return False
    protocol, sep, _ = path.partition("://")
    return bool(sep) and protocol.isidentifier() and protocol not in _LOCAL_PROTOCOLS


def location(path: str | os.PathLike[str]) -> Location:
    """``path`` as a location: the URL string unchanged, or a local :class:`Path` (``file://`` stripped)."""
    if is_url(path):
        return str(path).rstrip("/")
    if isinstance(path, str) and path.startswith("file://"):
        return Path(path[len("file://") :])
    return Path(path)


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path in it (no protocol): ``(S3FileSystem, "b/k")``."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    return fs, str(path)


def join(base: Location, *parts: str) -> Location:
    """``base`` with ``parts`` appended, ``/``-separated for URLs."""
    if isinstance(base, Path):
        return base.joinpath(*parts)
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def basename(loc: Location) -> str:
    """The last component of ``loc``."""
    return loc.name if isinstance(loc, Path) else loc.rstrip("/").rsplit("/", 1)[-1]


def _refresh(fs: Any, path: str) -> None:
    # Other processes (the other ranks) write too: never trust a listing cached in this process.
    fs.invalidate_cache(path)


def exists(loc: Location) -> bool:
    """Whether a file or directory (a key or a prefix) is at ``loc``."""
    if isinstance(loc, Path):
        return os.path.lexists(loc)
    fs, path = filesystem(loc)
    _refresh(fs, path)
    return bool(fs.exists(path))


def is_file(loc: Location) -> bool:
    """Whether ``loc`` is a file (an object, for URLs)."""
    if isinstance(loc, Path):
        return loc.is_file()
    fs, path = filesystem(loc)
    _refresh(fs, path)
    return bool(fs.isfile(path))


def size(loc: Location) -> int:
    """Size in bytes of the file at ``loc``.

    Raises:
        FileNotFoundError: no file there.
    """
    if isinstance(loc, Path):
        return os.stat(loc).st_size
    fs, path = filesystem(loc)
    _refresh(fs, path)
    return int(fs.info(path)["size"])


def list_files(loc: Location) -> dict[str, int]:
    """The files directly inside directory (prefix) ``loc``: ``{name: size}``; empty if there is none."""
    if isinstance(loc, Path):
        try:
            return {p.name: p.stat().st_size for p in loc.iterdir() if p.is_file()}
        except (FileNotFoundError, NotADirectoryError):
            return {}
    fs, path = filesystem(loc)
    _refresh(fs, path)
    try:
        listing = fs.ls(path, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    return {
        basename(str(e["name"])): int(e.get("size") or 0)
        for e in listing
        if e.get("type") == "file" and str(e["name"]).rstrip("/") != path.rstrip("/")
    }


def list_dirs(loc: Location) -> list[str]:
    """The names of the directories (common prefixes) directly inside ``loc``, sorted."""
    if isinstance(loc, Path):
        try:
            return sorted(p.name for p in loc.iterdir() if p.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return []
    fs, path = filesystem(loc)
    _refresh(fs, path)
    try:
        listing = fs.ls(path, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    return sorted(basename(str(e["name"])) for e in listing if e.get("type") == "directory")


@contextlib.contextmanager
def open_file(loc: Location, mode: str = "rb") -> Iterator[IO[bytes]]:
    """Open the file at ``loc`` for reading (``"rb"``), seekable; URLs are read in ranged requests."""
    if isinstance(loc, Path):
        with open(loc, mode) as f:
            yield f
        return
    fs, path = filesystem(loc)
    with fs.open(path, mode) as f:
        yield f


def read_bytes(loc: Location) -> bytes:
    """The whole content of the file at ``loc``."""
    if isinstance(loc, Path):
        return loc.read_bytes()
    fs, path = filesystem(loc)
    return bytes(fs.cat_file(path))


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` to the object at ``url`` in one request (one ``PUT`` on S3: atomic, all or nothing)."""
    fs, path = filesystem(url)
    fs.pipe_file(path, data)
    _refresh(fs, path)


def put_file(local: Path, url: str) -> None:
    """Upload a local file to the object at ``url``.

    On S3 the object appears whole when the upload completes (a single ``PUT``, or a multipart upload
    completed in one request); a failed or killed upload leaves the previous object, if any, in place.
    """
    fs, path = filesystem(url)
    fs.put_file(os.fspath(local), path)
    _refresh(fs, path)


def remove_tree(loc: Location) -> None:
    """Delete the file or the whole directory (prefix) at ``loc``; nothing there is fine."""
    if isinstance(loc, Path):
        if loc.is_dir() and not loc.is_symlink():
            shutil.rmtree(loc, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                loc.unlink()
        return
    fs, path = filesystem(loc)
    _refresh(fs, path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)
    _refresh(fs, path)


def url_checksum(url: str) -> tuple[int, str]:
    """Size and CRC-32 of the object at ``url``, read in chunks (as :func:`~.manifest.file_checksum`)."""
    crc = 0
    total = 0
    fs, path = filesystem(url)
    with fs.open(path, "rb", block_size=CHUNK_SIZE) as f:
        while chunk := f.read(CHUNK_SIZE):
            crc = zlib.crc32(chunk, crc)
            total += len(chunk)
    return total, f"{crc & 0xFFFFFFFF:08x}"


def torch_load(loc: Location, **kwargs: Any) -> Any:
    """``torch.load`` of the file at ``loc``: by path (memory-mapping allowed) locally, from a stream else."""
    import torch

    if isinstance(loc, Path):
        return torch.load(loc, **kwargs)
    kwargs.pop("mmap", None)
    with open_file(loc) as f:
        return torch.load(f, **kwargs)


@contextlib.contextmanager
def local_copy(url: str) -> Iterator[Path]:
    """Download the object at ``url`` into a temporary local file, removed on exit (for memory-mapping)."""
    fs, path = filesystem(url)
    with tempfile.TemporaryDirectory(prefix="lightning-sharded-") as tmp:
        local = Path(tmp) / basename(url)
        fs.get_file(path, os.fspath(local))
        yield local


# ------------------------------------------------------------------------------------------ DCP


class _HashingStream(io.RawIOBase):
    """A write-only stream that passes every write on to ``raw`` and keeps its size and CRC-32."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self._raw = raw
        self.size = 0
        self.crc = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        self._raw.write(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._raw.flush()


def _hashing_filesystem() -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    class HashingFileSystem(FileSystem):  # type: ignore[misc]
        """torch's fsspec filesystem for DCP, checksumming every file while it is written."""

        def __init__(self) -> None:
            super().__init__()
            self.checksums: dict[str, tuple[int, str]] = {}
            self._lock = threading.Lock()

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with super().create_stream(path, mode) as raw:
                stream = _HashingStream(raw)  # type: ignore[arg-type]
                yield stream
            with self._lock:
                self.checksums[basename(os.fspath(path))] = (stream.size, f"{stream.crc & 0xFFFFFFFF:08x}")

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            super().rename(path, new_path)
            with self._lock:
                figures = self.checksums.pop(basename(os.fspath(path)), None)
                if figures is not None:
                    self.checksums[basename(os.fspath(new_path))] = figures

    return HashingFileSystem()


def dcp_writer(loc: Location, **kwargs: Any) -> Any:
    """A DCP storage writer for directory ``loc``: ``FileSystemWriter`` locally, ``FsspecWriter`` for URLs.

    For URLs the writer checksums each file while writing it: after the save, its ``checksums``
    attribute holds ``{file name: (size, crc32 hex)}`` for every file this rank wrote.
    """
    if isinstance(loc, Path):
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        return FileSystemWriter(loc, **kwargs)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    writer = FsspecWriter(loc, **kwargs)
    hashing = _hashing_filesystem()
    hashing.fs = writer.fs.fs  # type: ignore[attr-defined]
    writer.fs = hashing
    writer.checksums = hashing.checksums  # type: ignore[attr-defined]
    return writer


def dcp_reader(loc: Location) -> Any:
    """A DCP storage reader for directory ``loc``: ``FileSystemReader`` locally, ``FsspecReader`` for URLs."""
    if isinstance(loc, Path):
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        return FileSystemReader(loc)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(loc)


def call_with_local_file(url: str, write: Callable[[Path], None]) -> None:
    """Run ``write`` on a temporary local file name, then upload that file to ``url`` (:func:`put_file`).

    Nothing is uploaded when ``write`` raises or does not create the file.
    """
    with tempfile.TemporaryDirectory(prefix="lightning-sharded-") as tmp:
        local = Path(tmp) / basename(url)
        write(local)
        if not local.is_file():
            raise FileNotFoundError(f"The checkpoint file for {url!r} was not written; nothing was uploaded.")
        put_file(local, url)
