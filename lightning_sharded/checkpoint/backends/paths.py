"""Locations: a local :class:`~pathlib.Path`, or an fsspec URL kept as a string (standard library only).

:func:`is_url` is the one test of a string for a URL; it is asked by :func:`location` (which makes a
user's path a location) and :func:`~lightning_sharded.checkpoint.backends.backend_for` only. Everything
else asks the location's backend, or one of the helpers here, which work on either kind.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["Location", "absolute", "basename", "is_url", "join", "local_path", "location", "parent"]

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
    """``loc`` with a local path made absolute (against the current directory); a URL as it is."""
    return loc.absolute() if isinstance(loc, Path) else loc


def local_path(loc: Location) -> Path | None:
    """The file or directory ``loc`` is on this machine's filesystem, or ``None`` for a URL (for what
    only local files allow: memory-mapping, ``os`` calls, ``safetensors``' ``safe_open``)."""
    return loc if isinstance(loc, Path) else None
