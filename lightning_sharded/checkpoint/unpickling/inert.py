"""Listing a refused checkpoint: a ``torch.save`` file read with every refused object a placeholder."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import IO, Any

from lightning_sharded.checkpoint.unpickling.allowed import LIGHTNING_SAFE_GLOBALS, allowed_objects

__all__ = ["INERT_ALLOWED", "NotUnpickled", "inert_load"]


class NotUnpickled:
    """Stands, in what :func:`inert_load` returns, for an object whose type was not allowed.

    Attributes:
        name: The refused type or function (``"builtins.exec"``).
    """

    name: str

    def __repr__(self) -> str:
        return f"<not unpickled: {self.name}>"

    # Whatever the pickle does with the object afterwards does nothing: a call (a nested reduce, such
    # as ``getattr(obj, name)(...)``) gives the placeholder back.
    def __call__(self, *args: Any, **kwargs: Any) -> NotUnpickled:
        return self

    def _ignore(self, *args: Any) -> None:
        pass

    __setstate__ = __setitem__ = append = extend = _ignore


def _placeholder(name: str) -> type:
    """A class the unpickler may call or instantiate in place of ``name``: it makes a NotUnpickled."""

    def make(cls: type, *args: Any, **kwargs: Any) -> NotUnpickled:
        obj = object.__new__(NotUnpickled)
        obj.name = name
        return obj

    return type("NotUnpickledType", (), {"__new__": make})


#: What :func:`inert_load` builds for real: tensors and plain data (a subset of torch's safe list);
#: reviewed with :mod:`~.allowed`'s lists (and pinned with them by a test). Everything else becomes a
#: :class:`NotUnpickled`.
INERT_ALLOWED = (
    "torch._utils._rebuild_tensor",  # a tensor from its storage (older archives)
    "torch._utils._rebuild_tensor_v2",  # a tensor from its storage, offset, size, stride
    "torch._utils._rebuild_parameter",  # an nn.Parameter around a rebuilt tensor
    "torch._utils._rebuild_parameter_with_state",  # the same, with its plain-data __dict__
    "torch.nn.parameter.Parameter",  # the class a rebuilt parameter is checked against
    "torch.Size",  # a tuple of ints
    "torch.device",  # a device from its name ("cpu", "cuda:0"); allocates nothing
    "torch.serialization._get_layout",  # a layout from its name; a dict lookup
    "collections.OrderedDict",  # plain data (state dicts)
    "collections.Counter",  # plain data
    "builtins.set",  # plain data
    "builtins.frozenset",  # plain data
    "builtins.bytearray",  # plain data
    "builtins.complex",  # plain data
    "_codecs.encode",  # how protocol 2 pickles bytes: encodes a str, nothing else
)


class _InertUnpickler(pickle.Unpickler):
    """Builds only allowed globals; every other global becomes a :class:`NotUnpickled` maker."""

    def __init__(self, file: IO[bytes], **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._allowed = allowed_objects((*INERT_ALLOWED, *LIGHTNING_SAFE_GLOBALS))

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


def inert_load(source: Any, *, load: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """Read a ``torch.save`` file without running any of its code, for listing a refused checkpoint.

    Tensors, plain data and :data:`~.allowed.LIGHTNING_SAFE_GLOBALS` are built as usual; every other
    global is never looked up: the objects made from it are :class:`NotUnpickled` placeholders that
    keep its name. Only for describing a file (``inspect``); the result is not the checkpoint. ``load``
    (``torch.load``, the default, or a wrapper of it) gets ``weights_only=False`` and this restricted
    ``pickle_module``.
    """
    if load is None:
        import torch

        load = torch.load
    return load(source, weights_only=False, pickle_module=_InertPickleModule, **kwargs)
