"""``consolidate_checkpoint``: a sharded checkpoint into one full file, in one process, memory bounded."""

from __future__ import annotations

import contextlib
import gc
import logging
import mmap
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_sharded.checkpoint.backends import Location, basename, location
from lightning_sharded.checkpoint.commit import commit_file
from lightning_sharded.checkpoint.detect import CheckpointKind, detect
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.tools.reader import (
    get_path,
    leaves,
    open_sharded,
    read_meta,
    set_path,
    to_lightning,
)

__all__ = ["PROGRESS_MIN_BYTES", "consolidate_checkpoint"]

log = logging.getLogger(__name__)

#: Consolidations of at least this many bytes show a progress bar when ``progress`` is ``None``.
PROGRESS_MIN_BYTES = 64 << 20


# ----------------------------------------------------------------------------------- consolidate


@dataclass(frozen=True)
class _Slot:
    """Stands for a DCP tensor entry in the checkpoint structure until the output file exists."""

    key: str


def consolidate_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    progress: bool | None = None,
    verify: bool = False,
) -> Location:
    """Convert a sharded checkpoint directory into one full checkpoint file, in one process.

    The output is what stock Lightning writes for a single device: plain :func:`torch.load` reads it,
    ``Trainer.fit(ckpt_path=dst)`` resumes from it (optimizer state in ``optimizer_states``) and
    ``LightningModule.load_from_checkpoint(dst)`` loads it, without this library.

    Memory stays bounded by the largest tensor (one chunk read at a time) plus buffers: the output
    is first written with every tensor's space reserved but empty (``torch.serialization.skip_data``),
    then memory-mapped (shared, so the page cache, not the process, holds it) and filled from the
    shards one chunk at a time; the CRC-32s of the archive's records are then recomputed, and the file
    is published atomically with :func:`~lightning_sharded.checkpoint.commit.commit_file`.

    Args:
        src: A sharded checkpoint directory.
        dst: The output file (replaced atomically if it exists), or an fsspec URL (``s3://...``: written
            locally first, then uploaded as one object).
        progress: Show a progress bar; ``None`` shows one for checkpoints of 64 MB or more.
        verify: Compare every source file's checksum with the manifest first.

    Returns:
        The path of the output file.

    Raises:
        FileNotFoundError: nothing at ``src``.
        CheckpointError: ``src`` is not a sharded checkpoint, or is damaged.
    """
    started = time.perf_counter()
    found = detect(src)
    real = found.data
    if found.kind is CheckpointKind.FULL:
        raise CheckpointError(
            f"{str(src)!r} is already a full checkpoint file: there is nothing to consolidate. Copy it"
            " instead."
        )
    reader = open_sharded(found, verify)
    meta = read_meta(found.backend, real, weights_only=False)
    flat: dict[str, Any] = reader.read_objects()
    flat.update({key: _Slot(key) for key in reader.tensors})
    nested: dict[str, Any] = {}
    for key in sorted(flat):
        set_path(nested, reader.path_of(key), flat[key])
    checkpoint = to_lightning(nested, meta, real)

    slots: dict[str, tuple[Any, ...]] = {}
    real_tensors: dict[tuple[Any, ...], torch.Tensor] = {}
    for path, leaf in leaves(checkpoint):
        if isinstance(leaf, _Slot):
            slots[leaf.key] = path
        elif isinstance(leaf, torch.Tensor):
            real_tensors[path] = leaf
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fakes = {
            key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in reader.tensors.items()
        }
    skeleton = _map_slots(checkpoint, fakes)
    total = sum(
        int(torch.Size(md.size).numel()) * fakes[key].element_size() for key, md in reader.tensors.items()
    )
    show = progress if progress is not None else total >= PROGRESS_MIN_BYTES

    def write(tmp: Path) -> None:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, tmp)
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            loaded = torch.load(tmp, mmap=True, weights_only=False, map_location="cpu")
        try:
            targets = {key: get_path(loaded, path) for key, path in slots.items()}
            with _progress_bar(total, show, f"consolidating {basename(real)}") as tick:
                reader.read_tensors(targets, tick)
            for path, tensor in real_tensors.items():
                get_path(loaded, path).copy_(tensor)
        finally:
            targets = {}
            del loaded
            gc.collect()
        _fix_zip_crcs(tmp)

    out = location(dst)
    commit_file(out, write)  # written locally (memory-mapped while filled); a URL gets one upload
    log.info(
        "Consolidated %s into %s (%.1f MB of tensors) in %.2fs",
        real,
        out,
        total / 1e6,
        time.perf_counter() - started,
    )
    return out


def _map_slots(obj: Any, fakes: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return fakes[obj.key]
    if isinstance(obj, dict):
        return type(obj)((k, _map_slots(v, fakes)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_slots(v, fakes) for v in obj)
    return obj


@contextlib.contextmanager
def _progress_bar(total: int, show: bool, desc: str) -> Iterator[Callable[[int], None]]:
    if not show:
        yield lambda n: None
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc) as bar:
        yield bar.update


def _fix_zip_crcs(file: Path) -> None:
    """Recompute the CRC-32 of every record of a zip archive written by ``torch.save`` and filled later.

    torch.save computes the CRCs while writing (with ``skip_data``, of the empty space); the data
    descriptors and central directory are patched in place. Reads the file once, in 8 MiB chunks.
    """
    import zipfile

    with zipfile.ZipFile(file) as archive:
        infos = archive.infolist()
        start_dir = archive.start_dir  # type: ignore[attr-defined]
    with open(file, "r+b") as f:
        f.seek(start_dir)
        central = []
        for _ in infos:
            header = f.read(46)
            if header[:4] != b"PK\x01\x02":
                raise CheckpointError(f"Unexpected zip layout in {str(file)!r} while consolidating.")
            name_len, extra_len, comment_len = struct.unpack("<HHH", header[28:34])
            central.append(f.tell() - 46)
            f.seek(name_len + extra_len + comment_len, os.SEEK_CUR)
        for info, central_pos in zip(infos, central, strict=True):
            f.seek(info.header_offset)
            local = f.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            data_start = info.header_offset + 30 + name_len + extra_len
            f.seek(data_start)
            crc, left = 0, info.compress_size
            while left:
                chunk = f.read(min(left, 8 << 20))
                if not chunk:
                    break
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
            if crc == info.CRC:
                continue
            packed = struct.pack("<I", crc)
            f.seek(central_pos + 16)
            f.write(packed)
            if info.flag_bits & 0x08:  # data descriptor after the data, with an optional signature
                f.seek(data_start + info.compress_size)
                signature = f.read(4)
                f.seek(data_start + info.compress_size + (4 if signature == b"PK\x07\x08" else 0))
                f.write(packed)
            f.seek(info.header_offset + 14)
            if f.read(4) != b"\0\0\0\0" or not info.flag_bits & 0x08:
                f.seek(info.header_offset + 14)
                f.write(packed)
