"""Locations: a local :class:`~pathlib.Path`, or an fsspec URL kept as a string (standard library only).

:func:`is_url` is the one test of a string for a URL; it is asked by :func:`location` (which makes a
user's path a location) and :func:`~lightning_sharded.checkpoint.backends.backend_for` only. Everything
else asks the location's backend, or one of the helpers here, which work on either kind.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

__all__ = [
    "Location",
    "absolute",
    "basename",
    "is_url",
    "join",
    "listed_sizes",
    "local_path",
    "location",
    "parent",
]

#: A checkpoint location: a local path, or an fsspec URL kept as a string.
Location = Path | str

_LOCAL_PROTOCOLS = ("file", "local")


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


def join(base: Location, *parts: str) -> Location:
    """``base`` with ``parts`` appended, ``/``-separated for URLs."""
    if isinstance(base, Path):
        return base.joinpath(*parts)
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def basename(loc: Location) -> str:
    """The last component of ``loc``."""
    return loc.name if isinstance(loc, Path) else loc.rstrip("/").rsplit("/", 1)[-1]


def parent(loc: Location) -> Location:
    """The folder that holds ``loc`` (``/``-separated for URLs)."""
    return loc.parent if isinstance(loc, Path) else loc.rstrip("/").rsplit("/", 1)[0]


def absolute(loc: Location) -> Location:
    """``loc`` with a local path made absolute (against the current directory) and normalized (``a/../b``
    is ``b``: one spelling per path, for comparisons); a URL as it is."""
    return Path(os.path.abspath(loc)) if isinstance(loc, Path) else loc


def local_path(loc: Location) -> Path | None:
    """The file or directory ``loc`` is on this machine's filesystem, or ``None`` for a URL (for what
    only local files allow: memory-mapping, ``os`` calls, ``safetensors``' ``safe_open``)."""
    return loc if isinstance(loc, Path) else None


def listed_sizes(
    list_files: Callable[[Location], Mapping[str, int]],
    base: Location,
    paths: Iterable[str],
    listed: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, int]:
    """The sizes of the files of ``paths`` (``/``-separated, relative to ``base``) that exist.

    One ``list_files`` of each folder they are in, not one ``stat`` per file: on an object store a
    ``LIST`` page per 1,000 files, where a ``HEAD`` per file made rank 0's check of a checkpoint one
    request per rank for each per-rank folder (``rank_state/``, ``index/``). ``listed``: folders
    already listed (``""`` for ``base``), by their path relative to ``base``.
    """
    folders: dict[str, Mapping[str, int]] = dict(listed or {})
    sizes: dict[str, int] = {}
    for path in paths:
        folder, _, name = path.rpartition("/")
        if folder not in folders:
            folders[folder] = list_files(join(base, *folder.split("/")) if folder else base)
        if name in folders[folder]:
            sizes[path] = folders[folder][name]
    return sizes
