"""Safe unpickling: opening a checkpoint never runs code from it unless the caller asks for that.

The tools read every pickle of a checkpoint as ``torch.load(weights_only=True)`` does, plus the few
types Lightning's own checkpoints hold (:data:`LIGHTNING_SAFE_GLOBALS`); anything else is refused with
one :class:`RefusedPickleError` naming the type and how to open a file one trusts
(``docs/checkpoint-format.md``, "Security"). :mod:`.allowed` holds the lists, :mod:`.loaders` the
readers and the refusal, :mod:`.inert` the listing of a refused file, :mod:`.without_torch` the
answers given without importing torch where they are certain to be torch's. Imports only ``errors``
(torch where it is used): every reader of a checkpoint may use it.
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
