"""Reading one pickle of a checkpoint safely, and the one error for a pickle that is refused (the package
docstring says which function reads what)."""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Callable, Iterable
from typing import IO, Any

from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.unpickling import without_torch
from lightning_sharded.checkpoint.unpickling.allowed import (
    DCP_METADATA_GLOBALS,
    allowed_objects,
    resolve_weights_only,
    restore_attribute_dicts,
    safe_globals,
)

__all__ = ["UNSAFE_FLAG", "RefusedPickleError", "load_pickle", "refused_name", "safe_load", "unsafe_globals"]

#: The command-line flag that opens a trusted checkpoint whatever it holds.
UNSAFE_FLAG = "--unsafe-unpickle"


class RefusedPickleError(CheckpointError):
    """A checkpoint holds a type that a safe load does not unpickle (a :class:`CheckpointError`).

    Attributes:
        what: The pickle, in words, with its file (``"The Lightning metadata '.../meta.pt'"``).
        name: The type or function that is not allowed (``"builtins.exec"``).
    """

    def __init__(self, what: str, name: str) -> None:
        super().__init__(
            f"{what} holds {name}, which is not on the list of types a checkpoint may hold (tensors, plain"
            " data, what Lightning writes): unpickling it could run code from the file, so nothing was"
            f" unpickled. If you trust the file, open it with {UNSAFE_FLAG} (command line) or"
            " weights_only=False (Python); or allow that type with torch.serialization.add_safe_globals."
        )
        self.what = what
        self.name = name

    def __reduce__(self) -> tuple[type[RefusedPickleError], tuple[str, str]]:
        # Rebuilt from its two fields: DCP gathers a rank's error to every rank by pickling it.
        return type(self), (self.what, self.name)


_NAME_PATTERNS = (
    re.compile(r"GLOBAL (\S+) was not an allowed global"),
    re.compile(r"unsupported GLOBAL (\S+) whose module"),
    re.compile(r"but got <class '([^']+)'>"),
    re.compile(r"unrecognized function (.+?)(?: which belongs to|$)", re.MULTILINE),
)


def refused_name(err: BaseException) -> str:
    """The type or function named by an ``UnpicklingError`` of torch's safe unpickler (or ours)."""
    text = str(err)
    for pattern in _NAME_PATTERNS:
        m = pattern.search(text)
        if m:
            return m.group(1).rstrip(".")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"something torch's safe unpickler refuses ({lines[-1] if lines else type(err).__name__})"


def safe_load(
    source: Any,
    *,
    what: str,
    weights_only: bool | None = True,
    load: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> Any:
    """``load(source, weights_only=..., **kwargs)`` of one checkpoint pickle (``what``: it in words, with
    its file), safe unless ``weights_only`` is ``False``: ``True`` or ``None`` (torch's default) build
    tensors, plain data and :data:`~.allowed.LIGHTNING_SAFE_GLOBALS` only. ``load``: ``torch.load`` (the
    default) or a wrapper of it (a backend's ``torch_load`` for URLs).

    Raises:
        RefusedPickleError: the pickle holds a type that is not allowed.
    """
    if load is None:
        import torch

        load = torch.load
    if not resolve_weights_only(weights_only):
        return load(source, weights_only=False, **kwargs)
    with safe_globals() as made:
        try:
            obj = load(source, weights_only=True, **kwargs)
        except pickle.UnpicklingError as err:
            raise RefusedPickleError(what, refused_name(err)) from None
    return restore_attribute_dicts(obj, made)


class _NotAllowed(pickle.UnpicklingError):
    """A global that :class:`_RestrictedUnpickler` refuses (any other error is damage, not a refusal)."""


class _RestrictedUnpickler(pickle.Unpickler):
    """A pickle reader that builds only the named globals (the standard library's documented way)."""

    def __init__(self, file: IO[bytes], allowed: dict[str, Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in self._allowed:
            return self._allowed[full]
        raise _NotAllowed(f"GLOBAL {full} was not an allowed global")


def load_pickle(
    file: IO[bytes],
    *,
    what: str,
    weights_only: bool | None = True,
    allowed: Iterable[str] = DCP_METADATA_GLOBALS,
) -> Any:
    """Unpickle a plain pickle (not a ``torch.save`` archive), building only the globals named in
    ``allowed``, torch's dtypes, layouts and memory formats, and what ``add_safe_globals`` allowed
    (``weights_only=False``: anything). ``what``: the pickle in words, with its file.

    Raises:
        RefusedPickleError: it holds anything else. A truncated or corrupt pickle raises what ``pickle``
            raises (``UnpicklingError``, ``EOFError``...), for the caller to report.
    """
    if not resolve_weights_only(weights_only):
        return pickle.load(file)  # the caller asked for it
    try:
        return _RestrictedUnpickler(file, allowed_objects(allowed)).load()
    except _NotAllowed as err:  # a truncated or corrupt pickle raises something else: the caller's damage
        raise RefusedPickleError(what, refused_name(err)) from None


def unsafe_globals(source: str | os.PathLike[str] | IO[bytes] | bytes) -> list[str]:
    """The globals of a ``torch.save`` archive that a safe load would refuse; nothing is unpickled.

    Read statically (torch's ``get_unsafe_globals_in_checkpoint``) with
    :data:`~.allowed.LIGHTNING_SAFE_GLOBALS` allowed, so an empty list means :func:`safe_load` opens it;
    an archive of tensors and plain data is told without importing torch (:mod:`.without_torch`).
    """
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    if not isinstance(source, (str, os.PathLike)):
        start = source.tell()
        if without_torch.archive_is_safe(source):
            return []
        source.seek(start)
    else:
        with open(source, "rb") as f:
            if without_torch.archive_is_safe(f):
                return []
    import torch

    with safe_globals():
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
