"""A checkpoint's pickles read without importing torch, where that is certain to give torch's answer.

``import torch`` costs 1.3 s on a 2-core machine: most of ``lightning-sharded verify``'s run on a 2 GB
checkpoint, whose files it reads in about as long. What ``verify`` needs of torch are two answers about
pickles: which globals of a ``torch.save`` archive a safe load would refuse, and what DCP's
``.metadata`` says. Each function here answers without torch only when it is sure; it returns ``None``
when it is not (a global or an opcode it does not know, a damaged file), and the caller asks torch,
as before. So every answer is torch's, and a checkpoint of plain tensors and data never needs torch.
"""

from __future__ import annotations

import _compat_pickle
import collections
import dataclasses
import importlib
import io
import math
import pickle
import struct
import zipfile
from collections.abc import Callable
from typing import IO, Any

from lightning_sharded.checkpoint.unpickling.allowed import (
    ATTRIBUTE_DICT_NAMES,
    DCP_METADATA_GLOBALS,
    LIGHTNING_SAFE_GLOBALS,
)

__all__ = [
    "LIGHTNING_PLAIN_GLOBALS",
    "NOT_READ",
    "PLAIN_GLOBALS",
    "REBUILD_TENSOR",
    "TORCH_SAFE",
    "AttributeDict",
    "PlainTensor",
    "TensorRecord",
    "archive_is_safe",
    "is_contiguous",
    "read_dcp_metadata",
    "read_plain",
    "record_start",
    "stored_record",
    "tensor_record",
    "type_name",
]

# The common dtypes and their bytes per element (others leave a pickle that holds one to torch).
_DTYPES = {
    **{"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16},
    **{"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8},
}
_STORAGES = ("Half", "BFloat16", "Float", "Double", "Bool", "Byte", "Char", "Short", "Int", "Long")
_STORAGE_DTYPE_NAMES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
)

#: Globals that torch's ``weights_only`` unpickler allows by default in every torch this library supports
#: (what ``torch.save`` writes for tensors and plain data; ``tests/checkpoint/test_without_torch.py``
#: checks each against the installed torch's own list).
TORCH_SAFE = frozenset(
    {
        "collections.OrderedDict",
        "builtins.set",
        "_codecs.encode",  # how protocol 2 pickles bytes
        "torch.Size",
        "torch.device",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch.serialization._get_layout",
        "torch.storage.UntypedStorage",
        *(f"torch.{name}Storage" for name in _STORAGES),
        *(f"torch.{name}" for name in _DTYPES),
    }
)
_SAFE = TORCH_SAFE | set(LIGHTNING_SAFE_GLOBALS)

# The opcodes torch's static reader of a ``torch.save`` pickle knows (torch/_weights_only_unpickler.py,
# get_globals_in_pkl), with the bytes of argument that follow each: any other leaves the answer to torch.
_NO_ARGUMENT = (
    "NEWOBJ REDUCE BUILD APPEND APPENDS SETITEM SETITEMS MARK TUPLE TUPLE1 TUPLE2 TUPLE3 NONE NEWFALSE"
    " NEWTRUE EMPTY_TUPLE EMPTY_LIST EMPTY_DICT EMPTY_SET BINPERSID"
)
_FIXED = {
    **{getattr(pickle, name)[0]: 0 for name in _NO_ARGUMENT.split()},
    **{pickle.BININT[0]: 4, pickle.BININT1[0]: 1, pickle.BININT2[0]: 2, pickle.BINFLOAT[0]: 8},
    **{pickle.BINGET[0]: 1, pickle.LONG_BINGET[0]: 4, pickle.BINPUT[0]: 1, pickle.LONG_BINPUT[0]: 4},
    pickle.PROTO[0]: 1,
}
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip member's local header (zipfile's structFileHeader)


def _data_pkl(source: IO[bytes]) -> bytes | None:
    """The bytes of the ``data.pkl`` record of a ``torch.save`` archive, or ``None`` where it is not one
    torch would read as such (no single such record, a TorchScript archive, a compressed record)."""
    with zipfile.ZipFile(source) as archive:
        infos = archive.infolist()
        records = [i for i in infos if i.filename.count("/") == 1 and i.filename.endswith("/data.pkl")]
        if len(records) != 1 or any(i.filename.endswith("/constants.pkl") for i in infos):
            return None
        return stored_record(archive, records[0])


def record_start(f: IO[bytes] | io.RawIOBase, info: zipfile.ZipInfo) -> int | None:
    """Where the bytes of the zip record ``info`` start in the archive ``f`` (after its local header),
    or ``None`` where no local header is there."""
    f.seek(info.header_offset)
    header = f.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        return None
    fields = _LOCAL_HEADER.unpack(header)
    return int(info.header_offset) + _LOCAL_HEADER.size + int(fields[-2]) + int(fields[-1])  # name, extra


def stored_record(archive: zipfile.ZipFile, info: zipfile.ZipInfo | None) -> bytes | None:
    """A stored (uncompressed) record's bytes, or ``None``. torch.save may write no CRC-32 (its config's
    compute_crc32), so zipfile's reader, which checks it, cannot be used: the bytes are read from after
    the record's local header."""
    if info is None or info.compress_type != zipfile.ZIP_STORED:
        return None
    assert archive.fp is not None
    start = record_start(archive.fp, info)
    if start is None:
        return None
    archive.fp.seek(start)
    data = archive.fp.read(info.compress_size)
    return data if len(data) == info.compress_size else None


def _globals(data: bytes) -> set[str] | None:
    """The globals of a protocol-2 pickle as torch's static reader names them; ``None`` for an opcode it
    does not know or a pickle cut short."""
    found: set[str] = set()
    at = 0
    while at < len(data):
        op = data[at]
        at += 1
        if op == pickle.STOP[0]:
            return found
        if op == pickle.GLOBAL[0]:
            end = data.index(b"\n", data.index(b"\n", at) + 1)
            found.add(_name(*data[at:end].decode("utf-8").split("\n")))
            at = end + 1
        elif op in _FIXED:
            at += _FIXED[op]
        elif op == pickle.BINUNICODE[0]:
            at += 4 + int.from_bytes(data[at : at + 4], "little")
        elif op in (pickle.SHORT_BINSTRING[0], pickle.LONG1[0]):
            at += 1 + data[at] if at < len(data) else 1
        else:
            return None
    return None


def _name(module: str, name: str) -> str:
    """A global's full name as torch's reader gives it: Python 2 names mapped, as pickle maps them."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def archive_is_safe(source: IO[bytes] | bytes) -> bool:
    """``True`` when a safe load of the ``torch.save`` archive ``source`` refuses none of its globals, as
    far as can be told without torch: every global is in :data:`TORCH_SAFE` or Lightning's list.
    ``False`` means only "ask torch" (an unknown global, or damage torch reports in its words)."""
    try:
        data = _data_pkl(io.BytesIO(source) if isinstance(source, bytes) else source)
        found = None if data is None else _globals(data)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error):
        return False
    return found is not None and found <= _SAFE


_PARTS = (dict, type(None))


class _Standin:
    """An object of one of DCP's index classes, read without torch: it has the attributes the pickle set
    (one whose state is not a dict keeps it in ``state``)."""

    def __init__(self, *args: Any) -> None:  # a REDUCE: the class called with arguments
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and len(state) == 2 and all(isinstance(p, _PARTS) for p in state):
            for part in state:  # (its __dict__, its slots)
                self.__dict__.update(part or {})
        else:
            self.state = state


class _TensorProperties(_Standin):
    """DCP's ``TensorProperties`` read without torch: its state is a tuple (its ``__setstate__``), of 5
    fields, and ``strides`` as a sixth since torch 2.15."""

    strides = None

    def __setstate__(self, state: Any) -> None:
        if len(state) not in (5, 6):
            raise ValueError(f"a TensorProperties state of {len(state)} fields")  # torch reads it instead
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state[:5]
        self.strides = state[5] if len(state) == 6 else None


class _Dtype(str):
    """A torch dtype read without torch: its name (``"torch.float32"``) and ``itemsize``, as a dtype has."""

    itemsize: int


def _dtype(name: str, itemsize: int) -> _Dtype:
    dtype = _Dtype(f"torch.{name}")
    dtype.itemsize = itemsize
    return dtype


class _Size(tuple[int, ...]):
    """``torch.Size`` read without torch: the tuple of ints it is."""


_Size.__module__, _Size.__qualname__ = "torch", "Size"


_DCP = "torch.distributed.checkpoint."
# The fields of DCP's dataclasses whose default is None: a pickle leaves out those never set
# (``MetadataIndex`` sets ``offset`` only when given), so a stand-in has them as class attributes.
_NONE_DEFAULTS = {
    f"{_DCP}metadata.Metadata": ("planner_data", "storage_data", "storage_meta", "version"),
    f"{_DCP}metadata.MetadataIndex": ("offset", "index"),
    f"{_DCP}metadata.StorageMeta": ("checkpoint_id", "save_id", "load_id"),
    f"{_DCP}filesystem._StorageInfo": ("transform_descriptors",),
}


def _standin(full: str) -> type:
    module, _, name = full.rpartition(".")
    defaults = dict.fromkeys(_NONE_DEFAULTS.get(full, ()))
    return type(name, (_Standin,), {"__module__": module, "__qualname__": name, **defaults})


_STANDINS: dict[str, Any] = {
    **{name: _standin(name) for name in DCP_METADATA_GLOBALS if name.startswith(_DCP)},
    f"{_DCP}metadata.TensorProperties": _TensorProperties,
    "torch.Size": _Size,
    "torch.serialization._get_layout": str,  # its argument is the layout's name ("torch.strided")
    **{f"torch.{name}": _dtype(name, size) for name, size in _DTYPES.items()},  # pickled by its name
}
_TensorProperties.__module__, _TensorProperties.__qualname__ = f"{_DCP}metadata", "TensorProperties"


class _NeedsTorch(Exception):
    """A global the stand-ins do not cover: torch reads the pickle instead."""


class _StandinUnpickler(pickle.Unpickler):
    """Builds stand-ins for DCP's classes and the standard library's plain types of
    :data:`~.allowed.DCP_METADATA_GLOBALS`; any other global leaves the pickle to torch."""

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in _STANDINS:
            return _STANDINS[full]
        if full in DCP_METADATA_GLOBALS and not module.startswith("torch"):
            return getattr(importlib.import_module(module), name)  # collections, builtins, pathlib
        raise _NeedsTorch(full)


def read_dcp_metadata(f: IO[bytes]) -> Any | None:
    """DCP's ``.metadata`` from ``f`` with stand-ins for torch's classes (attributes only, for checks that
    read them, never for DCP's planner), or ``None`` where torch must read it: a global outside
    :data:`~.allowed.DCP_METADATA_GLOBALS` and the common dtypes (torch allows it or refuses it), or a
    damaged pickle (torch's error says how)."""
    try:
        return _StandinUnpickler(f).load()
    except Exception:  # the caller reads it again with torch, which raises what applies
        return None


def type_name(obj: Any) -> str:
    """``module.qualname`` of ``obj``'s class: the same for a DCP object and its stand-in."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


#: What :func:`read_plain` returns for an archive it leaves to torch.
NOT_READ: Any = object()
#: What :func:`read_plain` builds: the globals of plain data in a protocol-2 pickle (no tensor, no class).
PLAIN_GLOBALS = (
    "collections.OrderedDict",  # a dict (state dicts)
    "builtins.set",  # plain data
    "builtins.frozenset",  # plain data
    "_codecs.encode",  # how protocol 2 pickles bytes: encodes a str, nothing else
)


class _PlainUnpickler(pickle.Unpickler):
    """Builds plain data only: any other global, or a tensor's storage (pickle's own refusal of a persistent
    id: no ``persistent_load``), leaves the archive to torch."""

    def find_class(self, module: str, name: str) -> Any:
        full = _name(module, name)
        if full not in PLAIN_GLOBALS:
            raise _NeedsTorch(full)
        module, _, name = full.rpartition(".")
        return getattr(importlib.import_module(module), name)


class AttributeDict(dict[Any, Any]):
    """Lightning's ``AttributeDict`` (``save_hyperparameters``' container) read without Lightning: the dict
    it is, pickled again (:mod:`~lightning_sharded.checkpoint.tools.archive_writer`) under Lightning 2.x's
    name, as a safe load gives it back (``allowed.restore_attribute_dicts``)."""

    pickled_as = ("lightning.fabric.utilities.data", "AttributeDict")


#: What :func:`read_plain` builds with ``lightning``: what a safe load with Lightning's globals builds
#: (torch's defaults of :data:`PLAIN_GLOBALS`, and :data:`~.allowed.LIGHTNING_SAFE_GLOBALS`).
LIGHTNING_PLAIN_GLOBALS = (
    *(name for name in PLAIN_GLOBALS if name in TORCH_SAFE),
    *LIGHTNING_SAFE_GLOBALS,
)


@dataclasses.dataclass(frozen=True)
class PlainTensor:
    """A tensor read without torch with ``lightning`` (a callback's score in ``meta.pt``): its dtype's name
    (``"float32"``), shape, ``requires_grad`` and bytes; a contiguous tensor of a storage of its own."""

    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool
    data: bytes


# The storage types torch.save names for the dtypes a PlainTensor may have.
_STORAGE_DTYPES = {
    f"{name}Storage": dtype for name, dtype in zip(_STORAGES, _STORAGE_DTYPE_NAMES, strict=True)
}


#: The function ``torch.save`` pickles a tensor as a call of.
REBUILD_TENSOR = "torch._utils._rebuild_tensor_v2"


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """A tensor of a ``torch.save`` pickle that is the whole of its own storage, contiguous: its dtype's name
    (``"float32"``), the key of its storage's record (``data/<key>``), its shape and ``requires_grad``."""

    dtype: str
    key: str
    shape: tuple[int, ...]
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPES[self.dtype]


def _storage(pid: Any) -> tuple[str, str, int]:
    """A storage's persistent id as ``torch.save`` writes it: ``(dtype name, key, numel)``."""
    kind, dtype, key, _, numel = pid
    if kind != "storage" or dtype not in _DTYPES:
        raise _NeedsTorch(f"a storage {pid!r}")
    return dtype, str(key), int(numel)


def _rebuilt(
    storage: Any, offset: int, size: Any, stride: Any, requires_grad: bool, hooks: Any
) -> TensorRecord:
    """``_rebuild_tensor_v2`` read without torch: the tensor, where it is its storage (no view, no hooks;
    a seventh argument, metadata such as a conjugate bit, is refused by the arity)."""
    dtype, key, numel = storage
    shape = tuple(int(n) for n in size)
    if offset or hooks or not is_contiguous(shape, stride) or math.prod(shape) != numel:
        raise _NeedsTorch("a tensor that is not its storage")
    return TensorRecord(dtype, key, shape, bool(requires_grad))


class _TensorUnpickler(pickle.Unpickler):
    """Tensors as :class:`TensorRecord`, their storages' dtypes by name; any other global declines."""

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" == REBUILD_TENSOR:
            return _rebuilt
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if f"{module}.{name}" == "collections.OrderedDict":  # the (empty) backward hooks
            return collections.OrderedDict
        raise _NeedsTorch(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return _storage(pid)


def tensor_record(data_pkl: bytes) -> TensorRecord | None:
    """The tensor the pickle of a ``torch.save`` archive of one tensor (a DCP tensor entry) holds, where it
    is the whole of its own storage, contiguous, of a common dtype; ``None`` for any other pickle."""
    try:
        found = _TensorUnpickler(io.BytesIO(data_pkl)).load()
    except Exception:
        return None
    return found if isinstance(found, TensorRecord) else None


class _LightningUnpickler(_TensorUnpickler):
    """:data:`LIGHTNING_PLAIN_GLOBALS`, ``AttributeDict`` as :class:`AttributeDict`, and tensors that are
    their own storage as :class:`PlainTensor` (``records``: the archive's storages by key, each used
    once); any other global, or any other tensor, leaves the archive to torch."""

    def __init__(self, file: IO[bytes], records: Callable[[str], bytes | None]) -> None:
        super().__init__(file)
        self._records = records
        self._used: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        full = _name(module, name)
        if full in ATTRIBUTE_DICT_NAMES:
            return AttributeDict
        if full == REBUILD_TENSOR:
            return self._tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if full not in LIGHTNING_PLAIN_GLOBALS:
            raise _NeedsTorch(full)
        module, _, name = full.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def _tensor(self, *args: Any) -> PlainTensor:
        record = _rebuilt(*args)
        data = self._records(record.key)
        if record.key in self._used or data is None or len(data) != record.nbytes:
            raise _NeedsTorch(f"the storage {record.key!r}")
        self._used.add(record.key)
        return PlainTensor(record.dtype, record.shape, record.requires_grad, data)


def is_contiguous(shape: tuple[int, ...], stride: Any) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` is contiguous (C order), as torch tells it: the
    stride of a dimension of size 1 does not matter."""
    return len(stride) == len(shape) and all(
        n == 1 or s == math.prod(shape[d + 1 :]) for d, (n, s) in enumerate(zip(shape, stride, strict=True))
    )


def read_plain(source: IO[bytes] | bytes, *, lightning: bool = False) -> Any:
    """The object a ``torch.save`` archive of plain data holds (numbers, strings, bytes, lists, tuples,
    dicts, sets: no tensor), as ``torch.load`` gives it; :data:`NOT_READ` for any other archive, which
    torch then reads (or refuses, or reports damaged). With ``lightning``: what a safe load with
    Lightning's globals gives (:data:`LIGHTNING_PLAIN_GLOBALS`; no ``frozenset``, which torch refuses),
    ``AttributeDict`` as :class:`AttributeDict`."""
    try:
        f = io.BytesIO(source) if isinstance(source, bytes) else source
        data = _data_pkl(f)
        if data is None:
            return NOT_READ
        if not lightning:
            return _PlainUnpickler(io.BytesIO(data)).load()
        with zipfile.ZipFile(f) as archive:
            records = _records(archive)
            return _LightningUnpickler(io.BytesIO(data), records).load()
    except Exception:  # the caller reads it again with torch, which raises what applies
        return NOT_READ


def _records(archive: zipfile.ZipFile) -> Callable[[str], bytes | None]:
    """The bytes of a ``torch.save`` archive's storage records, by key (stored records only)."""
    infos = {i.filename: i for i in archive.infolist()}
    prefix = next(name for name in infos if name.endswith("/data.pkl"))[: -len("data.pkl")]

    def record(key: str) -> bytes | None:
        return stored_record(archive, infos.get(f"{prefix}data/{key}"))

    return record
