"""The safetensors file format and Hugging Face's layout of a weights directory, as written here.

A ``.safetensors`` file is an 8-byte little-endian header length ``N``, a JSON header of ``N`` bytes
(``{key: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``,
offsets relative to the end of the header) and the tensors' raw bytes, in that order
(https://huggingface.co/docs/safetensors/index#format); the directory's layout is in
``docs/huggingface.md``. Standard library only; :mod:`~lightning_sharded.checkpoint.hf_layout`
reads them.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_sharded.checkpoint import names

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONFIG_NAME",
    "FLOATING",
    "ST_DTYPES",
    "TORCH_NAMES",
    "Entry",
    "encode_header",
    "file_name",
    "parse_dtype",
    "parse_size",
    "plan_files",
]

CONFIG_NAME = "config.json"

#: For each dtype safetensors stores, by torch's name of it (``"bfloat16"``): its safetensors name and
#: bytes per element. Plain strings: the export without torch (:mod:`.export_direct`) reads them.
ST_DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "uint16": ("U16", 2),
    "uint32": ("U32", 4),
    "uint64": ("U64", 8),
}
#: torch's name of each safetensors dtype name (``"BF16"``: ``"bfloat16"``); one torch lacks is not in it.
TORCH_NAMES = {st: name for name, (st, _) in ST_DTYPES.items()}
#: The floating dtypes of :data:`ST_DTYPES` (those ``dtype`` casts).
FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
#: The dtypes the export converts floating tensors to, by the names the CLI accepts.
TARGET_NAMES = ("bfloat16", "float16", "float32")


def dtype_name(dtype: Any) -> str:
    """torch's name of a dtype (``"float32"`` for ``torch.float32``)."""
    return str(dtype).removeprefix("torch.")


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})


def parse_size(value: int | str) -> int:
    """A size in bytes from ``5000000``, ``"5GB"`` (10**9 bytes, as HF counts), ``"500MB"``, ``"2GiB"``."""
    if isinstance(value, bool):
        raise ValueError(
            f"max_shard_size must be a size such as '5GB', '500MB' or a number of bytes, not {value!r}."
        )
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"max_shard_size {value!r} is not a size: use a number of bytes or a number with a unit"
                " (B, KB, MB, GB, TB, KiB, MiB, GiB), such as '5GB' or '500MB'."
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"max_shard_size must be positive, not {value!r}.")
    return size


def parse_dtype(value: torch.dtype | str | None) -> str | None:
    """``None``, or the name (``"bfloat16"``) of a floating dtype to cast to, from a torch dtype or its name
    (``"bfloat16"``, ``"float16"``, ``"float32"``)."""
    if value is None:
        return None
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        if name not in TARGET_NAMES:
            raise ValueError(f"Unknown dtype {value!r}: use one of {sorted(TARGET_NAMES)}.")
        return name
    import torch  # imported already: the caller holds a torch dtype (or passed something else)

    name = dtype_name(value)
    if not isinstance(value, torch.dtype) or name not in FLOATING:
        raise ValueError(
            f"dtype must be a floating dtype safetensors stores (torch.bfloat16...), not {value!r}."
        )
    return name


@dataclass(frozen=True)
class Entry:
    """One tensor of the output: its key, shape and dtype as stored (torch's name: ``"float32"``)."""

    key: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ST_DTYPES[self.dtype][1]


def file_name(index: int, count: int) -> str:
    """``model-00001-of-00003.safetensors`` (1-based), or ``model.safetensors`` for a single file."""
    if count == 1:
        return names.SAFETENSORS_FILE
    return f"model-{index:05d}-of-{count:05d}{names.SAFETENSORS_SUFFIX}"


def plan_files(entries: Sequence[Entry], max_bytes: int) -> list[list[Entry]]:
    """Entries split into files of at most ``max_bytes`` each (a larger tensor alone), in order, as
    ``save_pretrained`` does."""
    files: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files if files[0] else []


def storage_order(entries: Iterable[Entry]) -> list[Entry]:
    """The order of the tensors' bytes in a file: widest element first, then by key, as the
    ``safetensors`` package writes them, so every tensor is aligned on its element size."""
    return sorted(entries, key=lambda e: (-ST_DTYPES[e.dtype][1], e.key))


def encode_header(entries: Sequence[Entry]) -> bytes:
    """The 8-byte length and the JSON header (padded with spaces to 8 bytes) for ``entries``, whose
    bytes then follow in the given order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.key] = {
            "dtype": ST_DTYPES[entry.dtype][0],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
