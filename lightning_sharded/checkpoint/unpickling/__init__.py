"""Safe unpickling: opening a checkpoint never runs code from it unless the caller asks for that.

A checkpoint is a pickle, and a pickle may call any function while it is read. The tools
(``inspect``, ``verify``, ``consolidate``, ``load_checkpoint``) therefore read every pickle of a
checkpoint the way ``torch.load(weights_only=True)`` does: tensors, plain containers and numbers,
plus the few types Lightning's own checkpoints hold (:data:`LIGHTNING_SAFE_GLOBALS`). Anything else
is refused with one :class:`~lightning_sharded.CheckpointError` that names the type and the way to
open a file one trusts: ``--unsafe-unpickle`` on the command line, ``weights_only=False`` in Python.

- :mod:`.allowed`: the allow-lists and the context that adds them to torch's list (no file read);
- :mod:`.loaders`: :func:`safe_load` (``torch.load``), :func:`load_pickle` (DCP's ``.metadata``),
  :func:`unsafe_globals` (static, for ``verify``) and the one refusal, :class:`RefusedPickleError`;
- :mod:`.inert`: :func:`inert_load`, a refused file read with placeholders, for ``inspect``.

Imports only ``errors`` and torch: every reader of a checkpoint may use it.
"""

from __future__ import annotations

from lightning_sharded.checkpoint.unpickling.allowed import (
    ATTRIBUTE_DICT_NAMES,
    DCP_METADATA_GLOBALS,
    LIGHTNING_SAFE_GLOBALS,
    resolve_weights_only,
    safe_globals,
)
from lightning_sharded.checkpoint.unpickling.inert import NotUnpickled, inert_load
from lightning_sharded.checkpoint.unpickling.loaders import (
    UNSAFE_FLAG,
    RefusedPickleError,
    load_pickle,
    refused_name,
    safe_load,
    unsafe_globals,
)

__all__ = [
    "ATTRIBUTE_DICT_NAMES",
    "DCP_METADATA_GLOBALS",
    "LIGHTNING_SAFE_GLOBALS",
    "UNSAFE_FLAG",
    "NotUnpickled",
    "RefusedPickleError",
    "inert_load",
    "load_pickle",
    "refused_name",
    "resolve_weights_only",
    "safe_globals",
    "safe_load",
    "unsafe_globals",
]
