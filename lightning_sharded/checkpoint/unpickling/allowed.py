"""What a checkpoint's pickles may hold: the allow-lists, and torch's ``weights_only`` list made to hold them.

Which of Lightning's types are on the list, and why (checked against Lightning 2.6):
``docs/checkpoint-format.md``, "Security". Standard library and torch only (torch imported where used,
so the lists cost no torch import): nothing here reads a file.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = [
    "ATTRIBUTE_DICT_NAMES",
    "DCP_METADATA_GLOBALS",
    "LIGHTNING_SAFE_GLOBALS",
    "allowed_objects",
    "resolve_name",
    "resolve_weights_only",
    "restore_attribute_dicts",
    "safe_globals",
]

# Every entry below is reviewed: a name is allowed only when building it from a pickle runs no code but
# its own constructor, which touches no file, process or module. Never add a callable that calls or
# looks up something else (``builtins.getattr``, ``eval``, ``exec``, ``__import__``,
# ``functools.partial``, ``operator.*``, ``os.*``, ``subprocess.*``): with ``getattr`` alone, an allowed
# path becomes ``PosixPath(p).unlink()``. ``tests/checkpoint/test_allow_lists.py`` pins these lists:
# a change there is a change of this review.

#: Where ``AttributeDict`` has lived: Lightning 2.x, the standalone ``lightning_fabric`` and
#: ``pytorch_lightning`` packages, and Lightning 1.x. Never built: a plain ``dict`` stub stands for it
#: during the load (:class:`_AttributeDictStub`), converted afterwards, so no Lightning code runs.
ATTRIBUTE_DICT_NAMES = (
    "lightning.fabric.utilities.data.AttributeDict",  # Lightning 2.x: save_hyperparameters' container
    "lightning_fabric.utilities.data.AttributeDict",  # the standalone lightning_fabric package
    "lightning.pytorch.utilities.parsing.AttributeDict",  # re-export some versions pickled under
    "pytorch_lightning.utilities.parsing.AttributeDict",  # Lightning 1.x checkpoints
)

#: Globals added to torch's ``weights_only`` list while the tools read a checkpoint: what Lightning
#: writes beyond plain data. Each is a class whose construction runs no code but its own.
LIGHTNING_SAFE_GLOBALS = (
    *ATTRIBUTE_DICT_NAMES,
    "argparse.Namespace",  # save_hyperparameters() of an argparse result; sets attributes only
    "pathlib.PosixPath",  # a path hyperparameter (data_dir=Path(...)); parses a string, opens nothing
    "pathlib.PurePosixPath",  # how a PosixPath pickles on some Python versions; pure: no file access
    "pathlib.PureWindowsPath",  # a path saved on Windows, read on Linux; pure: no file access
)

#: What DCP's ``.metadata`` pickle holds (besides torch dtypes), by full name.
DCP_METADATA_GLOBALS = (
    "torch.distributed.checkpoint.metadata.Metadata",  # the dataclass .metadata is
    "torch.distributed.checkpoint.metadata.MetadataIndex",  # a key of storage_data: fqn, offset
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",  # a tensor piece: offsets, sizes
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",  # a tensor: properties, size, chunks
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",  # a non-tensor item: an empty marker
    "torch.distributed.checkpoint.metadata.TensorProperties",  # dtype, layout, requires_grad...
    "torch.distributed.checkpoint.metadata.StorageMeta",  # checkpoint_id, save_id, load_id
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",  # an Enum of memory formats
    "torch.distributed.checkpoint.filesystem._StorageInfo",  # where an item is: file, offset, length
    "torch.Size",  # a tuple of ints (sizes of tensors)
    "torch.serialization._get_layout",  # maps a layout's name to torch.strided etc.; a dict lookup
    "collections.OrderedDict",  # dicts of older DCP versions
    "builtins.set",  # plain data
    "builtins.frozenset",  # plain data
    "pathlib.PosixPath",  # StorageMeta.checkpoint_id as the Path the save was given; no file access
    "pathlib.PurePosixPath",  # the same, pickled as a pure path
    "pathlib.PureWindowsPath",  # the same, saved on Windows
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


def resolve_name(name: str) -> Any | None:
    """The object named ``module.attr``, or ``None`` where the module is not installed."""
    import importlib

    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def allowed_objects(names: Iterable[str]) -> dict[str, Any]:
    """Full name to object for ``names`` (those installed), torch's dtypes, layouts and memory formats,
    and what the user allowed with ``torch.serialization.add_safe_globals``."""
    import torch

    allowed = {name: obj for name in names if (obj := resolve_name(name)) is not None}
    for value in vars(torch).values():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[str(value)] = value
    for entry in torch.serialization.get_safe_globals():  # what the user allowed for torch.load
        obj, name = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
        allowed[name] = obj
    return allowed


class _AttributeDictStub:
    """Stands for ``AttributeDict`` during a safe load.

    torch's safe unpickler only sets items on a plain ``dict``, so the stub makes one and records it
    in the innermost :func:`safe_globals` context; :func:`restore_attribute_dicts` turns the recorded
    dicts into ``AttributeDict`` once the load is done.
    """

    def __new__(cls, *args: Any) -> Any:  # called by the unpickler for NEWOBJ
        made: dict[Any, Any] = {}
        records = getattr(_recorded, "stack", None)
        if records:
            records[-1].append(made)
        return made


_recorded = threading.local()


def _torch_globals() -> list[Any]:
    others = [name for name in LIGHTNING_SAFE_GLOBALS if name not in ATTRIBUTE_DICT_NAMES]
    return [(_AttributeDictStub, name) for name in ATTRIBUTE_DICT_NAMES] + [
        (obj, name) for name in others if (obj := resolve_name(name)) is not None
    ]


@contextlib.contextmanager
def safe_globals() -> Iterator[list[dict[Any, Any]]]:
    """Add :data:`LIGHTNING_SAFE_GLOBALS` to torch's ``weights_only`` list for the duration.

    Only what was not already on the list is added, and only that is removed on exit (torch's own
    ``safe_globals`` context would also remove a user's earlier ``add_safe_globals``).

    Yields:
        The plain dicts made for ``AttributeDict`` objects while it is active (for
        :func:`restore_attribute_dicts`).
    """
    import torch

    present = set(torch.serialization.get_safe_globals())
    added = [g for g in _torch_globals() if g not in present]
    torch.serialization.add_safe_globals(added)
    made: list[dict[Any, Any]] = []
    _recorded.stack = [*getattr(_recorded, "stack", []), made]
    try:
        yield made
    finally:
        _recorded.stack = _recorded.stack[:-1]
        removable = set(added)
        remaining = [g for g in torch.serialization.get_safe_globals() if g not in removable]
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(remaining)


def restore_attribute_dicts(obj: Any, made: list[dict[Any, Any]]) -> Any:
    """Replace every dict of ``made`` in ``obj`` by an ``AttributeDict`` (identity and sharing kept)."""
    if not made:  # before the import: Lightning takes seconds to import, and the CLI's tools need none
        return obj
    cls = resolve_name("lightning.fabric.utilities.data.AttributeDict")
    if cls is None:
        return obj
    import torch

    targets = {id(d) for d in made}
    done: dict[int, Any] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return node
        key = id(node)
        if key in done:
            return done[key]
        if isinstance(node, dict):
            out = cls() if key in targets else node  # a target is a plain dict, the stub's
            done[key] = out
            for k, v in list(node.items()):
                out[k] = walk(v)
            return out
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
