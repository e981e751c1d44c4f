"""The safetensors file format and Hugging Face's layout of a weights directory, as written here.

A ``.safetensors`` file is an 8-byte little-endian header length ``N``, a JSON header of ``N`` bytes
(``{key: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``,
offsets relative to the end of the header) and the tensors' raw bytes, in that order
(https://huggingface.co/docs/safetensors/index#format); the directory's layout is in
``docs/huggingface.md``. Standard library and torch only; :mod:`~lightning_sharded.checkpoint.hf_layout`
reads them.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_sharded.checkpoint import names

__all__ = [
    "CONFIG_NAME",
    "DTYPE_NAMES",
    "TORCH_DTYPES",
    "Entry",
    "encode_header",
    "file_name",
    "parse_dtype",
    "parse_size",
    "plan_files",
]

CONFIG_NAME = "config.json"

#: torch dtype to the safetensors name of it.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
#: The torch dtype of each safetensors dtype name (``"BF16"``); one torch cannot hold is not in it.
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}

#: The dtypes the export converts floating tensors to, by the names the CLI accepts.
TARGET_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

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


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """``None``, a floating torch dtype, or its name (``"bfloat16"``, ``"float16"``, ``"float32"``)."""
    if value is None:
        return None
    if isinstance(value, str):
        dtype = TARGET_DTYPES.get(value.removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"Unknown dtype {value!r}: use one of {sorted(TARGET_DTYPES)}.")
        return dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point or value not in DTYPE_NAMES:
        raise ValueError(
            f"dtype must be a floating dtype safetensors stores (torch.bfloat16...), not {value!r}."
        )
    return value


@dataclass(frozen=True)
class Entry:
    """One tensor of the output: its key, shape and dtype as stored."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


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
    return sorted(entries, key=lambda e: (-e.dtype.itemsize, e.key))


def encode_header(entries: Sequence[Entry]) -> bytes:
    """The 8-byte length and the JSON header (padded with spaces to 8 bytes) for ``entries``, whose
    bytes then follow in the given order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.key] = {
            "dtype": DTYPE_NAMES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
