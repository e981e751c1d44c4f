"""Safe unpickling: opening a checkpoint never runs code from it unless the caller asks for that.

A checkpoint is a pickle, and a pickle may call any function while it is read. The tools
(``inspect``, ``verify``, ``consolidate``, ``load_checkpoint``) therefore read every pickle of a
checkpoint the way ``torch.load(weights_only=True)`` does: tensors, plain containers and numbers,
plus the few types Lightning's own checkpoints hold (:data:`LIGHTNING_SAFE_GLOBALS`). Anything else
is refused with one :class:`~lightning_sharded.CheckpointError` that names the type and the way to
open a file one trusts: ``--unsafe-unpickle`` on the command line, ``weights_only=False`` in Python.

- :func:`safe_load`: ``torch.load`` (full files, ``meta.pt``, DCP's non-tensor items) with the list.
- :func:`load_pickle`: a plain pickle (DCP's ``.metadata``) restricted to the classes DCP writes.
- :func:`unsafe_globals`: the types a ``torch.save`` file holds that would be refused, read
  statically (nothing is unpickled), for ``verify``.
- :func:`inert_load`: a refused ``torch.save`` file read with every refused object replaced by a
  :class:`NotUnpickled` placeholder, so that ``inspect`` can still list the rest.

Lightning's own list of what it writes, checked against Lightning 2.6 (``ModelCheckpoint``,
``EarlyStopping``, ``LearningRateMonitor``, ``Timer``, ``StochasticWeightAveraging``, loop and
``StatefulDataLoader`` states, every ``torch.optim.lr_scheduler``, ``torch.optim`` parameter groups,
``save_hyperparameters()``): all of it is plain data that torch already allows, except
``AttributeDict`` (hyperparameters nested in hyperparameters, and checkpoints of Lightning 1.x) and
the ``argparse.Namespace`` and ``pathlib`` paths that ``save_hyperparameters()`` keeps as given.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

import torch

from lightning_sharded.checkpoint.errors import CheckpointError

__all__ = [
    "DCP_METADATA_GLOBALS",
    "LIGHTNING_SAFE_GLOBALS",
    "UNSAFE_FLAG",
    "NotUnpickled",
    "RefusedPickleError",
    "inert_load",
    "load_pickle",
    "refused",
    "refused_name",
    "resolve_weights_only",
    "safe_globals",
    "safe_load",
    "unsafe_globals",
]

#: The command-line flag that opens a trusted checkpoint whatever it holds.
UNSAFE_FLAG = "--unsafe-unpickle"

#: Where ``AttributeDict`` has lived: Lightning 2.x, the standalone ``lightning_fabric`` and
#: ``pytorch_lightning`` packages, and Lightning 1.x.
ATTRIBUTE_DICT_NAMES = (
    "lightning.fabric.utilities.data.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
)

#: Globals added to torch's ``weights_only`` list while the tools read a checkpoint: what Lightning
#: writes beyond plain data. Each is a class whose construction runs no code but its own.
LIGHTNING_SAFE_GLOBALS = (
    *ATTRIBUTE_DICT_NAMES,
    "argparse.Namespace",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath",
)

#: What DCP's ``.metadata`` pickle holds (besides torch dtypes), by full name.
DCP_METADATA_GLOBALS = (
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.Size",
    "torch.serialization._get_layout",
    "collections.OrderedDict",
    "builtins.set",
    "builtins.frozenset",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath",
)

_TRUE = ("1", "y", "yes", "true")


def resolve_weights_only(weights_only: bool | None) -> bool:
    """The ``weights_only`` that ``torch.load`` would use: ``None`` is its default, ``True``.

    As in ``torch.load``: ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` makes every load safe, and
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns a ``None`` (not an explicit ``True``) into ``False``.
    """
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
        return True
    if weights_only is None:
        return os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in _TRUE
    return bool(weights_only)


class RefusedPickleError(CheckpointError):
    """A checkpoint holds a type that a safe load does not unpickle (a :class:`CheckpointError`).

    Attributes:
        what: The pickle, in words, with its file.
        name: The type or function that is not allowed.
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


def refused(what: str, name: str) -> RefusedPickleError:
    """The one error for a checkpoint that holds something not on the list.

    Args:
        what: The pickle, in words, with its file (``"The Lightning metadata '.../meta.pt'"``).
        name: The type or function that is not allowed (``"builtins.exec"``).
    """
    return RefusedPickleError(what, name)


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


# ------------------------------------------------------------------------- the list, made active


class _AttributeDictStub:
    """Stands for ``AttributeDict`` during a safe load.

    torch's safe unpickler only sets items on a plain ``dict``, so the stub makes one and records it;
    :func:`safe_load` turns the recorded dicts into ``AttributeDict`` once the load is done.
    """

    def __new__(cls, *args: Any) -> Any:  # called by the unpickler for NEWOBJ
        made: dict[Any, Any] = {}
        records = getattr(_recorded, "stack", None)
        if records:
            records[-1].append(made)
        return made


_recorded = threading.local()


def _resolve(name: str) -> Any | None:
    """The object named ``module.attr``, or ``None`` where the module is not installed."""
    import importlib

    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def _torch_globals() -> list[Any]:
    entries: list[Any] = [(_AttributeDictStub, name) for name in ATTRIBUTE_DICT_NAMES]
    for name in LIGHTNING_SAFE_GLOBALS:
        if name in ATTRIBUTE_DICT_NAMES:
            continue
        obj = _resolve(name)
        if obj is not None:
            entries.append((obj, name))
    return entries


@contextlib.contextmanager
def safe_globals() -> Iterator[None]:
    """Add :data:`LIGHTNING_SAFE_GLOBALS` to torch's ``weights_only`` list for the duration.

    Only what was not already on the list is added, and only that is removed on exit (torch's own
    ``safe_globals`` context would also remove a user's earlier ``add_safe_globals``).
    """
    present = set(torch.serialization.get_safe_globals())
    added = [g for g in _torch_globals() if g not in present]
    torch.serialization.add_safe_globals(added)
    _recorded.stack = [*getattr(_recorded, "stack", []), []]
    try:
        yield
    finally:
        _recorded.stack = _recorded.stack[:-1]
        removable = set(added)
        remaining = [g for g in torch.serialization.get_safe_globals() if g not in removable]
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(remaining)


def _restore_attribute_dicts(obj: Any, made: list[dict[Any, Any]]) -> Any:
    """Replace every recorded dict in ``obj`` by an ``AttributeDict`` (identity and sharing kept)."""
    cls = _resolve("lightning.fabric.utilities.data.AttributeDict")
    if cls is None or not made:
        return obj
    targets = {id(d) for d in made}
    done: dict[int, Any] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return node
        key = id(node)
        if key in done:
            return done[key]
        if type(node) is dict:
            out = cls() if key in targets else node
            done[key] = out
            for k, v in list(node.items()):
                out[k] = walk(v)
            return out
        if isinstance(node, dict):
            done[key] = node
            for k, v in list(node.items()):
                node[k] = walk(v)
            return node
        if isinstance(node, list):
            done[key] = node
            node[:] = [walk(v) for v in node]
            return node
        if type(node) is tuple:
            out_tuple = tuple(walk(v) for v in node)
            done[key] = out_tuple
            return out_tuple
        return node

    return walk(obj)


# ---------------------------------------------------------------------------------------- loading


def safe_load(
    source: Any,
    *,
    what: str,
    weights_only: bool | None = True,
    load: Callable[..., Any] = torch.load,
    **kwargs: Any,
) -> Any:
    """``torch.load`` of one checkpoint pickle, safe unless ``weights_only`` is ``False``.

    Args:
        source: A path, a file object, or what ``load`` takes.
        what: The pickle in words, with its file, for the error message.
        weights_only: ``True`` (or ``None``, torch's default): tensors, plain data and
            :data:`LIGHTNING_SAFE_GLOBALS` only. ``False``: anything, running the file's code.
        load: The loader, called as ``load(source, weights_only=..., **kwargs)``; ``torch.load`` or a
            wrapper of it (``storage.torch_load`` for URLs).
        **kwargs: Passed to ``load`` (``map_location``, ``mmap``).

    Returns:
        The unpickled object.

    Raises:
        CheckpointError: the pickle holds a type that is not allowed (see :func:`refused`).
    """
    if not resolve_weights_only(weights_only):
        return load(source, weights_only=False, **kwargs)
    with safe_globals():
        try:
            obj = load(source, weights_only=True, **kwargs)
        except pickle.UnpicklingError as err:
            raise refused(what, refused_name(err)) from None
        made = _recorded.stack[-1]
    return _restore_attribute_dicts(obj, made)


class _RestrictedUnpickler(pickle.Unpickler):
    """A pickle reader that builds only the named globals (the standard library's documented way)."""

    def __init__(self, file: IO[bytes], allowed: dict[str, Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in self._allowed:
            return self._allowed[full]
        raise pickle.UnpicklingError(f"GLOBAL {full} was not an allowed global")


def _allowed_objects(names: Iterable[str]) -> dict[str, Any]:
    allowed = {name: obj for name in names if (obj := _resolve(name)) is not None}
    for value in vars(torch).values():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[str(value)] = value
    for entry in torch.serialization.get_safe_globals():  # what the user allowed for torch.load
        obj, name = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
        allowed[name] = obj
    return allowed


def load_pickle(
    file: IO[bytes],
    *,
    what: str,
    weights_only: bool | None = True,
    allowed: Iterable[str] = DCP_METADATA_GLOBALS,
) -> Any:
    """Unpickle a plain pickle (not a ``torch.save`` archive), building only ``allowed`` globals.

    Args:
        file: The open pickle.
        what: The pickle in words, with its file, for the error message.
        weights_only: ``False`` unpickles anything (``pickle.load``).
        allowed: Full names of the classes and functions it may hold; torch dtypes, layouts and
            memory formats, and what ``torch.serialization.add_safe_globals`` allowed, always are.

    Raises:
        CheckpointError: it holds anything else (see :func:`refused`).
    """
    if not resolve_weights_only(weights_only):
        return pickle.load(file)  # the caller asked for it
    try:
        return _RestrictedUnpickler(file, _allowed_objects(allowed)).load()
    except pickle.UnpicklingError as err:
        raise refused(what, refused_name(err)) from None


def unsafe_globals(source: str | os.PathLike[str] | IO[bytes] | bytes) -> list[str]:
    """The globals of a ``torch.save`` archive that a safe load would refuse; nothing is unpickled.

    Read statically (torch's ``get_unsafe_globals_in_checkpoint``) with :data:`LIGHTNING_SAFE_GLOBALS`
    allowed, so an empty list means :func:`safe_load` opens it.
    """
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    with safe_globals():
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))


# --------------------------------------------------------------------- listing a refused file


class NotUnpickled:
    """Stands, in what :func:`inert_load` returns, for an object whose type was not allowed.

    Attributes:
        name: The refused type or function (``"builtins.exec"``).
    """

    name: str

    def __repr__(self) -> str:
        return f"<not unpickled: {self.name}>"

    # Whatever the pickle does with the object afterwards does nothing.
    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


def _placeholder(name: str) -> type:
    """A class the unpickler may call or instantiate in place of ``name``: it makes a NotUnpickled."""

    def make(cls: type, *args: Any, **kwargs: Any) -> NotUnpickled:
        obj = object.__new__(NotUnpickled)
        obj.name = name
        return obj

    return type("NotUnpickledType", (), {"__new__": make})


#: What :func:`inert_load` builds for real: tensors and plain data (a subset of torch's safe list).
_INERT_ALLOWED = (
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
    "torch.nn.parameter.Parameter",
    "torch.Size",
    "torch.device",
    "torch.serialization._get_layout",
    "collections.OrderedDict",
    "collections.Counter",
    "builtins.set",
    "builtins.frozenset",
    "builtins.bytearray",
    "builtins.complex",
    "_codecs.encode",
)


class _InertUnpickler(pickle.Unpickler):
    """Builds only allowed globals; every other global becomes a :class:`NotUnpickled` maker."""

    def __init__(self, file: IO[bytes], **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._allowed = _allowed_objects((*_INERT_ALLOWED, *LIGHTNING_SAFE_GLOBALS))

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in self._allowed:
            return self._allowed[full]
        return _placeholder(full)


class _InertPickleModule:
    """What ``torch.load(pickle_module=...)`` takes: ``Unpickler`` and ``load``."""

    __name__ = "lightning_sharded_inert_pickle"
    Unpickler = _InertUnpickler

    @staticmethod
    def load(file: IO[bytes], **kwargs: Any) -> Any:
        return _InertUnpickler(file, **kwargs).load()


def inert_load(source: Any, *, load: Callable[..., Any] = torch.load, **kwargs: Any) -> Any:
    """Read a ``torch.save`` file without running any of its code, for listing a refused checkpoint.

    Tensors, plain data and :data:`LIGHTNING_SAFE_GLOBALS` are built as usual; every other global is
    never looked up: the objects made from it are :class:`NotUnpickled` placeholders that keep its
    name. Only for describing a file (``inspect``); the result is not the checkpoint.

    Args:
        source: A path or file object, or what ``load`` takes.
        load: The loader (``torch.load`` or a wrapper of it), called with ``weights_only=False`` and
            this restricted ``pickle_module``.
        **kwargs: Passed to ``load`` (``map_location``, ``mmap``).
    """
    return load(source, weights_only=False, pickle_module=_InertPickleModule, **kwargs)
