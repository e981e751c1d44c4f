"""A ``torch.save`` archive written without torch: the pickle of an object whose tensors are placeholders,
and the zip layout around it, with every tensor's bytes left to be written in place later.

``consolidate`` writes a full checkpoint of several GB from a sharded one. Importing torch to write it
costs 2 s on a 2-core machine, as long as copying 2 GB; the archive's format needs none of torch's code:

- ``data.pkl``: the object pickled at protocol 2, each tensor as ``torch.save`` pickles one,
  ``torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())``, its storage a
  persistent id ``("storage", torch.<Type>Storage, key, "cpu", numel)``; keys ``"0"``, ``"1"``... in the
  order the pickler meets the tensors, as torch numbers them.
- records, stored (not compressed), in torch's order: ``data.pkl``, ``.format_version``,
  ``.storage_alignment``, ``byteorder``, ``data/<key>`` for each storage, ``version``,
  ``.data/serialization_id``; each storage's bytes start 64-byte aligned in the file (an extra field of
  padding, as torch's writer pads), so ``torch.load(mmap=True)`` maps them in place.
- zip64 fields where a size or an offset does not fit in 32 bits (a checkpoint over 4 GiB).

What torch reads of it is checked against ``torch.save``'s own output in
``tests/checkpoint/test_archive_writer.py`` (loads, ``mmap`` loads, ``weights_only`` loads, zip64).
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any

from lightning_sharded.checkpoint.checksum import crc32
from lightning_sharded.checkpoint.libc import pwrite_all
from lightning_sharded.checkpoint.unpickling.without_torch import REBUILD_TENSOR, PlainTensor

__all__ = ["ALIGNMENT", "DTYPES", "Layout", "Record", "Tensor", "layout", "pickle_with_tensors"]

#: Where each storage's bytes start: a multiple of this many bytes (torch's ``storage_alignment``).
ALIGNMENT = 64
#: For each dtype this writes (by name), the storage class ``torch.save`` names and the bytes per element.
DTYPES = {
    "float16": ("HalfStorage", 2),
    "bfloat16": ("BFloat16Storage", 2),
    "float32": ("FloatStorage", 4),
    "float64": ("DoubleStorage", 8),
    "bool": ("BoolStorage", 1),
    "uint8": ("ByteStorage", 1),
    "int8": ("CharStorage", 1),
    "int16": ("ShortStorage", 2),
    "int32": ("IntStorage", 4),
    "int64": ("LongStorage", 8),
}
_PREFIX = "archive"
_ZIP64_LIMIT = 0xFFFFFFFF
_PAD_ID = 0x4246  # "FB": torch's padding extra field
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR64 = struct.Struct("<4sLQL")
_EOCD = struct.Struct("<4s4H2LH")


@dataclass(frozen=True)
class Tensor:
    """A placeholder for a tensor of ``shape`` and ``dtype`` (its name: ``"float32"``), pickled as
    ``torch.save`` pickles a contiguous tensor of its own storage; ``key`` names it for the caller, who
    writes its bytes, unless it has them (``data``: written with the archive's frame)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    data: bytes | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


class _Global:
    """A global of torch's, pickled by its name (``GLOBAL module name``) without torch imported."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # pickle's save_reduce wants a callable; torch's is called
        raise TypeError(f"{self.module}.{self.name} is torch's, named here only to be pickled")


_REBUILD = _Global(*REBUILD_TENSOR.rsplit(".", 1))
_STORAGE_GLOBALS = {dtype: _Global("torch", name) for dtype, (name, _) in DTYPES.items()}


class _Storage:
    """A tensor's storage in the pickle: a persistent id, as ``torch.save`` writes one."""

    def __init__(self, key: str, tensor: Tensor) -> None:
        self.pid = ("storage", _STORAGE_GLOBALS[tensor.dtype], key, "cpu", math.prod(tensor.shape))


_PurePickler: Any = pickle._Pickler  # type: ignore[attr-defined]


class _Pickler(_PurePickler):
    """Protocol 2, as ``torch.save``; :class:`Tensor` placeholders as torch's tensors (the pure-Python
    pickler: its ``dispatch`` table takes the placeholders' globals, which name modules not imported)."""

    dispatch: dict[type, Any] = dict(_PurePickler.dispatch)

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=2)
        self.tensors: list[Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _Storage) else None

    def save_torch_global(self, obj: _Global) -> None:
        self._global(obj, obj.module, obj.name)

    def _global(self, obj: Any, module: str, name: str) -> None:
        self.write(pickle.GLOBAL + f"{module}\n{name}\n".encode())
        self.memoize(obj)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        """A class that says under which name to pickle it (``pickled_as``: a stand-in for a class of a
        module not imported) by that name; any other as pickle does."""
        named = getattr(obj, "pickled_as", None) if isinstance(obj, type) else None
        if named is None:
            super().save_global(obj, name)
            return
        self._global(obj, *named)

    dispatch[_Global] = save_torch_global

    def save_tensor(self, obj: Tensor) -> None:
        if obj.dtype not in DTYPES:
            raise ValueError(f"no torch storage type for dtype {obj.dtype!r}")
        storage = _Storage(str(len(self.tensors)), obj)
        self.tensors.append(obj)
        stride = tuple(math.prod(obj.shape[i + 1 :]) for i in range(len(obj.shape)))
        args: tuple[Any, ...] = (
            storage,
            0,
            tuple(obj.shape),
            stride,
            obj.requires_grad,
            collections.OrderedDict(),
        )
        self.save_reduce(_REBUILD, args, obj=obj)

    dispatch[Tensor] = save_tensor

    def save_plain_tensor(self, obj: PlainTensor) -> None:
        self.save_tensor(
            Tensor(f"<plain {len(self.tensors)}>", obj.shape, obj.dtype, obj.requires_grad, obj.data)
        )

    dispatch[PlainTensor] = save_plain_tensor


def pickle_with_tensors(obj: Any) -> tuple[bytes, list[Tensor]]:
    """``data.pkl`` of ``obj`` (plain data and :class:`Tensor` placeholders) and the placeholders in the
    order of their storages' keys (``"0"``, ``"1"``...).

    Raises:
        ValueError: a placeholder of a dtype with no storage type here (:data:`DTYPES`).
        pickle.PicklingError: ``obj`` holds something else that plain pickling cannot write.
    """
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.tensors


@dataclass
class Record:
    """A record of the archive: its name, where its local header and its bytes start, its size, and
    (for the small records) its bytes."""

    name: str
    header: int
    start: int
    size: int
    data: bytes | None = None
    crc: int = 0
    central: int = 0  # where its central directory entry starts
    full_name: bytes = b""  # with the archive's prefix
    extra64: bool = False  # its sizes in a zip64 extra field


@dataclass
class Layout:
    """Every record of an archive placed: :meth:`write_frame` writes all but the storages' bytes, which
    the caller writes at ``storages[i].start``, then :meth:`patch_crcs` sets their CRC-32s."""

    records: list[Record]
    storages: list[Record]
    size: int
    frame: list[tuple[int, bytes]] = field(default_factory=list)  # (offset, bytes) of everything else

    def write_frame(self, fd: int) -> None:
        """Everything but the storages' bytes, at their places in the file ``fd`` (sized to :attr:`size`)."""
        os.ftruncate(fd, self.size)
        for offset, data in self.frame:
            pwrite_all(fd, data, offset)

    def patch_crcs(self, fd: int, crcs: dict[int, int]) -> None:
        """Set each storage's CRC-32 (``crcs``: by the storage's index) in its local header and its central
        directory entry; a storage ``crcs`` lacks is read back from ``fd`` (one written with the frame
        has its CRC-32 already)."""
        for i, record in enumerate(self.storages):
            if record.data is not None:
                continue
            crc = crcs.get(i)
            if crc is None:
                crc = _read_crc(fd, record.start, record.size)
            packed = struct.pack("<I", crc)
            pwrite_all(fd, packed, record.header + 14)
            pwrite_all(fd, packed, record.central + 16)


def _read_crc(fd: int, start: int, size: int) -> int:
    crc, at, end = 0, start, start + size
    while at < end:
        data = os.pread(fd, min(8 << 20, end - at), at)
        if not data:
            raise OSError(f"short read at byte {at} of the archive being written")
        crc = crc32(data, crc)
        at += len(data)
    return crc


def layout(data_pkl: bytes, tensors: list[Tensor], serialization_id: str | None = None) -> Layout:
    """Place the records of an archive of ``data_pkl`` and the storages of ``tensors`` (in key order)."""
    sid = serialization_id or str(uuid.uuid4().int).rjust(40, "0")[:40]
    small = [
        ("data.pkl", data_pkl),
        (".format_version", b"1"),
        (".storage_alignment", str(ALIGNMENT).encode()),
        ("byteorder", b"little"),
    ]
    entries: list[tuple[str, bytes | None, int]] = [(name, data, len(data)) for name, data in small]
    entries += [(f"data/{i}", tensor.data, tensor.nbytes) for i, tensor in enumerate(tensors)]
    entries += [("version", b"3\n", 2), (".data/serialization_id", sid.encode(), len(sid))]
    records: list[Record] = []
    frame: list[tuple[int, bytes]] = []
    at = 0
    for name, data, size in entries:
        full = f"{_PREFIX}/{name}".encode()
        extra64 = size >= _ZIP64_LIMIT
        zip64 = struct.pack("<2H2Q", 1, 16, size, size) if extra64 else b""
        fixed = at + _LOCAL.size + len(full) + len(zip64) + 4
        pad = b"FB" + struct.pack("<H", -fixed % ALIGNMENT) + b"Z" * (-fixed % ALIGNMENT)
        crc = crc32(data) if data is not None else 0
        stored = _ZIP64_LIMIT if extra64 else size
        local = _LOCAL.pack(
            b"PK\x03\x04",
            45 if extra64 else 20,
            0,
            0,
            0,
            0,
            0,
            crc,
            stored,
            stored,
            len(full),
            len(zip64) + len(pad),
        )
        start = at + len(local) + len(full) + len(zip64) + len(pad)
        record = Record(name, at, start, size, data, crc, full_name=full, extra64=extra64)
        frame.append((at, local + full + zip64 + pad + (data or b"")))
        records.append(record)
        at = start + size
    central_start = at
    for record in records:
        record.central = at
        fields = [record.size, record.size] if record.extra64 else []
        offset64 = record.header >= _ZIP64_LIMIT
        if offset64:
            fields.append(record.header)
        extra = struct.pack(f"<2H{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
        stored = _ZIP64_LIMIT if record.extra64 else record.size
        needs64 = record.extra64 or offset64
        entry = _CENTRAL.pack(
            b"PK\x01\x02",
            45,
            0,
            45 if needs64 else 20,
            0,
            0,
            0,
            0,
            0,
            record.crc,
            stored,
            stored,
            len(record.full_name),
            len(extra),
            0,
            0,
            0,
            0,
            _ZIP64_LIMIT if offset64 else record.header,
        )
        frame.append((at, entry + record.full_name + extra))
        at += len(entry) + len(record.full_name) + len(extra)
    central_size = at - central_start
    n = len(records)
    eocd64 = _EOCD64.pack(b"PK\x06\x06", _EOCD64.size - 12, 45, 45, 0, 0, n, n, central_size, central_start)
    locator = _LOCATOR64.pack(b"PK\x06\x07", 0, at, 1)
    eocd = _EOCD.pack(
        b"PK\x05\x06",
        0,
        0,
        min(n, 0xFFFF),
        min(n, 0xFFFF),
        min(central_size, _ZIP64_LIMIT),
        min(central_start, _ZIP64_LIMIT),
        0,
    )
    frame.append((at, eocd64 + locator + eocd))
    at += len(eocd64) + len(locator) + len(eocd)
    storages = [r for r in records if r.name.startswith("data/")]
    return Layout(records, storages, at, frame)
