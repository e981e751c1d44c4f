"""Hugging Face weights (a ``save_pretrained`` directory, ``consolidate --format safetensors``, one
``.safetensors`` file): recognised, listed and checked from names and headers only (standard library),
for the detector, ``verify``, ``inspect`` and ``load_pretrained``; the format is described in
:mod:`~lightning_sharded.checkpoint.tools.safetensors_format`, which writes it.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO

from lightning_sharded.checkpoint import names
from lightning_sharded.checkpoint.backends import Backend, Location, basename, join
from lightning_sharded.checkpoint.problems import Problem

__all__ = [
    "HEADER_LIMIT",
    "Header",
    "StoredTensor",
    "WeightsListing",
    "is_safetensors_head",
    "is_weights_listing",
    "list_weights",
    "parse_header",
]

#: The largest JSON header read (the safetensors package's own limit is 100 MB).
HEADER_LIMIT = 100 << 20

#: Bytes per element of each safetensors dtype name this module checks sizes for.
_ITEM_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8,
}  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors header: its key, dtype name (``"F32"``), shape and byte range."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A safetensors file's header: its JSON length and its tensors (in header order)."""

    length: int
    tensors: dict[str, StoredTensor]

    @property
    def file_size(self) -> int:
        """The size the file has when it holds every byte its header describes."""
        return 8 + self.length + max((t.end for t in self.tensors.values()), default=0)


def is_safetensors_head(head: bytes) -> bool:
    """Whether a file's first bytes (9 or more) are a safetensors file's: a header length, then ``{``."""
    return len(head) >= 9 and 2 <= struct.unpack("<Q", head[:8])[0] <= HEADER_LIMIT and head[8:9] == b"{"


def is_weights_listing(files: Iterable[str]) -> bool:
    """Whether a directory holding ``files`` is Hugging Face weights: an index or ``.safetensors``
    files, and no DCP index (a sharded checkpoint never is one)."""
    files = set(files)
    return names.DCP_METADATA not in files and (
        names.SAFETENSORS_INDEX in files or any(n.endswith(names.SAFETENSORS_SUFFIX) for n in files)
    )


def parse_header(f: IO[bytes], shown: str) -> Header:
    """The header of the safetensors file open in ``f`` (reads the header only); a ``ValueError`` that
    names ``shown`` when it is not one."""
    head = f.read(8)
    length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 2 <= length <= HEADER_LIMIT:
        raise ValueError(f"{shown!r} is not a safetensors file: its first 8 bytes are not a header length")
    text = f.read(length)
    try:
        header = json.loads(text)
        assert isinstance(header, dict)
    except (ValueError, AssertionError):
        why = f"{len(text)} of its {length} bytes" if len(text) < length else "not a JSON object"
        raise ValueError(f"{shown!r} is not a safetensors file: its header is {why}") from None
    tensors: dict[str, StoredTensor] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = (int(n) for n in info["data_offsets"])
            tensors[key] = StoredTensor(
                key, str(info["dtype"]), tuple(int(n) for n in info["shape"]), begin, end
            )
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{shown!r} is not a safetensors file: the header's entry {key!r} is {info!r}, not a dtype,"
                " a shape and data offsets"
            ) from None
    return Header(length, tensors)


@dataclass
class WeightsListing:
    """What a weights directory or file holds, after reading its headers (and index).

    Attributes:
        tensors: Every tensor, by key, with the file that holds it.
        problems: What is wrong: a file the index names that is not there, a header that does not read,
            a file shorter or longer than its header says, a key the index puts in a file without it.
    """

    tensors: dict[str, tuple[str, StoredTensor]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)


def _tensor_problem(name: str, tensor: StoredTensor) -> Problem | None:
    item = _ITEM_SIZES.get(tensor.dtype)
    if item is None:
        return None  # a dtype this module does not size: nothing to compare
    numel = math.prod(tensor.shape)
    if tensor.end - tensor.begin != numel * item:
        return Problem(
            name,
            f"has a bad header: {tensor.key!r} ({tensor.dtype}, shape {list(tensor.shape)}) needs"
            f" {numel * item} bytes, its offsets give {tensor.end - tensor.begin}",
        )
    return None


def list_weights(backend: Backend, data: Location) -> WeightsListing:
    """The weights at ``data`` (a directory or one ``.safetensors`` file): its tensors and problems.

    A directory with an index is read through its ``weight_map``; without one, every ``.safetensors``
    file in it is. Reads the index and each file's header, no tensor data.
    """
    listing = WeightsListing()
    if backend.is_file(data):
        root, present = None, {basename(data): backend.size(data)}
    else:
        root, present = data, backend.list_files(data)
    weight_map: dict[str, str] | None = None
    if root is not None and names.SAFETENSORS_INDEX in present:
        try:
            loaded = json.loads(backend.read_bytes(join(root, names.SAFETENSORS_INDEX)))
            weight_map = loaded["weight_map"]
            assert isinstance(weight_map, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            listing.problems.append(
                Problem(names.SAFETENSORS_INDEX, "is not a Hugging Face index: it has no 'weight_map' object")
            )
            weight_map = None
    if weight_map is not None:
        wanted = sorted({str(v) for v in weight_map.values()})
    else:
        wanted = sorted(n for n in present if n.endswith(names.SAFETENSORS_SUFFIX))
    for name in wanted:
        if name not in present:
            listing.problems.append(
                Problem(name, f"is missing (the index {names.SAFETENSORS_INDEX} names it)")
            )
            continue
        size = present[name]
        try:
            with backend.open_file(join(root, name) if root is not None else data) as f:
                header = parse_header(f, name)
        except ValueError as err:
            listing.problems.append(Problem(name, str(err).removeprefix(f"{name!r} ")))
            continue
        if size != header.file_size:
            how = "truncated" if size < header.file_size else "longer than its header says"
            listing.problems.append(
                Problem(name, f"is {how}: {size} bytes, its header says {header.file_size}", None, size)
            )
        for key, tensor in header.tensors.items():
            listing.tensors.setdefault(key, (name, tensor))
            problem = _tensor_problem(name, tensor)
            if problem is not None:
                listing.problems.append(problem)
                break
    if weight_map is not None:
        for key, name in sorted(weight_map.items()):
            if name in present and listing.tensors.get(key, ("",))[0] != name:
                listing.problems.append(
                    Problem(names.SAFETENSORS_INDEX, f"puts {key!r} in {name!r}, which does not hold it")
                )
                break
    return listing
