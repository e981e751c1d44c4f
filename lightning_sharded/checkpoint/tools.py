"""Single-process tools: load, consolidate and inspect a checkpoint without any process group.

They read sharded directories written by this library, by stock Lightning's ``FSDPStrategy``
(DCP keys ``model``, ``optimizer_N``) and by stock ``ModelParallelStrategy`` (``state_dict``,
``optimizer_N``), plus ``meta.pt``; and full ``torch.save`` files. A sharded checkpoint becomes the
dict a full Lightning checkpoint is: ``state_dict`` with full tensors, ``optimizer_states`` in
torch's form (``{"state": {index: ...}, "param_groups": [{"params": [index, ...]}]}``, indices in
the order of the parameter groups, as ``Optimizer.state_dict()`` numbers them), and everything
Lightning kept in ``meta.pt`` (epoch, global step, loops, callbacks, hyperparameters...).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import mmap
import os
import pickle
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_sharded.checkpoint import storage
from lightning_sharded.checkpoint.atomic import commit_file
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.layout import (
    DCP_METADATA,
    LIGHTNING_METADATA,
    MODEL_KEYS,
    OPTIMIZER_KEY,
    SHARD_FILE,
    CheckpointKind,
    checkpoint_kind,
)
from lightning_sharded.checkpoint.manifest import read_manifest
from lightning_sharded.checkpoint.verify import _dcp_problems, _raise, check_files

__all__ = [
    "CheckpointInfo",
    "EntryInfo",
    "consolidate_checkpoint",
    "inspect_checkpoint",
    "load_checkpoint",
]

log = logging.getLogger(__name__)

#: Consolidations of at least this many bytes show a progress bar when ``progress`` is ``None``.
PROGRESS_MIN_BYTES = 64 << 20

_VERIFY_HINT = "Run `lightning-sharded verify {path}` to find the damaged file."


# ------------------------------------------------------------------------------------ reading DCP


class _DcpReader:
    """Reads a DCP directory in this process (``no_dist``), tensor entries into given targets."""

    def __init__(self, root: storage.Location) -> None:
        self.root = root
        try:
            with storage.open_file(storage.join(root, DCP_METADATA)) as f:
                self.metadata: Any = pickle.load(f)
        except Exception as err:
            raise CheckpointError(
                f"The file `.metadata` of the sharded checkpoint {str(root)!r} cannot be read"
                f" ({type(err).__name__}: {err}). Restore the directory from a copy, or load an earlier"
                " checkpoint."
            ) from err
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        entries = self.metadata.state_dict_metadata
        self.tensors = {k: v for k, v in sorted(entries.items()) if isinstance(v, TensorStorageMetadata)}
        self.objects = sorted(k for k in entries if k not in self.tensors)
        self.mapping: dict[str, tuple[Any, ...]] = dict(self.metadata.planner_data or {})

    def path_of(self, key: str) -> tuple[Any, ...]:
        return tuple(self.mapping.get(key, (key,)))

    def skip(self, top_level: Callable[[Any], bool]) -> None:
        """Read none of the entries whose top-level key (``"optimizer_0"``...) ``top_level`` picks."""
        self.tensors = {k: v for k, v in self.tensors.items() if not top_level(self.path_of(k)[0])}
        self.objects = [k for k in self.objects if not top_level(self.path_of(k)[0])]

    def _load(self, state: dict[str, Any], on_tensor: Callable[[int], None] | None = None) -> None:
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        class Planner(DefaultLoadPlanner):
            def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
                super().commit_tensor(read_item, tensor)
                if on_tensor is not None:
                    on_tensor(int(torch.Size(read_item.lengths).numel()) * tensor.element_size())

        planner = Planner(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        try:
            _load_state_dict(state, storage.dcp_reader(self.root), planner=planner, no_dist=True)
        except (CheckpointException, Exception) as err:
            where = self.diagnose()
            raise CheckpointError(
                f"Reading the sharded checkpoint {str(self.root)!r} failed"
                + (f": {where}" if where else f" ({_first_line(err)})")
                + ". Restore it from a copy, or load an earlier checkpoint. "
                + _VERIFY_HINT.format(path=self.root)
            ) from err

    def diagnose(self) -> str | None:
        """After a failed read: the first stored item that does not deserialize, by file, rank and key.

        Reads one item at a time (memory bounded by the largest chunk).
        """
        import io

        items = sorted(
            (self.metadata.storage_data or {}).items(),
            key=lambda kv: (str(kv[1].relative_path), int(kv[1].offset)),
        )
        for index, info in items:
            rel = str(info.relative_path)
            m = SHARD_FILE.match(rel)
            who = f" (written by rank {m.group(1)})" if m else ""
            try:
                with storage.open_file(storage.join(self.root, rel)) as f:
                    f.seek(int(info.offset))
                    data = f.read(int(info.length))
                if len(data) != int(info.length):
                    raise EOFError(f"{len(data)} of {int(info.length)} bytes")
                torch.load(io.BytesIO(data), map_location="cpu", weights_only=index.fqn in self.tensors)
            except Exception as err:
                return (
                    f"{rel!r}{who} is corrupted: its entry {index.fqn!r} at byte {int(info.offset)} cannot be"
                    f" read ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
                )
        return None

    def read_objects(self) -> dict[str, Any]:
        """The non-tensor entries (pickled by DCP), e.g. the optimizers' ``param_groups``."""
        state: dict[str, Any] = dict.fromkeys(self.objects)
        if state:
            self._load(state)
        return state

    def read_tensors(self, targets: dict[str, torch.Tensor], on_tensor: Callable[[int], None] | None) -> None:
        """Copy every tensor entry into ``targets[key]`` (full, global shape), chunk by chunk."""
        self._load(dict(targets), on_tensor)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    # DCP's CheckpointException puts the original exception at the end of its traceback text.
    last = [line for line in text if line and not line.startswith((" ", "Traceback"))]
    return f"{type(err).__name__}: {last[-1] if last else ''}"


def _read_meta(root: storage.Location, weights_only: bool) -> dict[str, Any]:
    file = storage.join(root, LIGHTNING_METADATA)
    try:
        meta = storage.torch_load(file, map_location="cpu", weights_only=weights_only)
    except FileNotFoundError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"The Lightning metadata {str(file)!r} (epoch, global step, loops, callbacks) cannot be read"
            f" ({type(err).__name__}: {err}). {_VERIFY_HINT.format(path=root)}"
        ) from err
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"The Lightning metadata {str(file)!r} holds a {type(meta).__name__}, not a dict: this is not a"
            " Lightning checkpoint."
        )
    return meta


def _set(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = root
    for key, nxt in itertools.pairwise(path):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _rekey_optimizer(state: Any, key: str, root: storage.Location) -> Any:
    """DCP's optimizer state, keyed by parameter name, to torch's, keyed by index."""
    if not isinstance(state, dict) or "param_groups" not in state:
        return state
    groups = state["param_groups"]
    names = [p for group in groups for p in group.get("params", [])]
    if all(isinstance(p, int) for p in names):
        return state
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(str(k) for k in state.get("state", {}) if k not in index)
    if unknown:
        raise CheckpointError(
            f"The optimizer state {key!r} of {str(root)!r} has state for {unknown[:3]} that no parameter"
            " group"
            " lists: the checkpoint is inconsistent. Load it with the strategy that wrote it."
        )
    return {
        **{k: v for k, v in state.items() if k not in ("state", "param_groups")},
        "state": {index[name]: value for name, value in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [index[p] for p in g.get("params", [])]} for g in groups],
    }


def _to_lightning(nested: dict[str, Any], meta: dict[str, Any], root: storage.Location) -> dict[str, Any]:
    """DCP's top-level keys plus ``meta.pt`` to the dict of a full Lightning checkpoint."""
    checkpoint = dict(meta)
    model_key = next((k for k in MODEL_KEYS if k in nested), None)
    if model_key is None:
        raise CheckpointError(
            f"The sharded checkpoint {str(root)!r} has no model state: none of the keys {list(MODEL_KEYS)}"
            " among"
            f" its top-level keys {sorted(nested)}. It was not written by a Lightning strategy."
        )
    checkpoint["state_dict"] = nested.pop(model_key)
    optimizers = sorted((int(m.group(1)), k) for k in nested if (m := OPTIMIZER_KEY.match(k)))
    if [i for i, _ in optimizers] != list(range(len(optimizers))):
        raise CheckpointError(
            f"The sharded checkpoint {str(root)!r} has optimizer states {[k for _, k in optimizers]}, not"
            " numbered 0, 1, ...: one is missing. Restore the directory from a copy."
        )
    if optimizers:
        checkpoint["optimizer_states"] = [_rekey_optimizer(nested.pop(k), k, root) for _, k in optimizers]
    checkpoint.update(nested)
    return checkpoint


def _open_sharded(path: storage.Location, verify: bool) -> tuple[storage.Location, _DcpReader]:
    manifest = read_manifest(path)
    if manifest is not None:
        check_files(path, manifest, verify=verify)
    else:
        problems, _ = _dcp_problems(path)
        _raise(path, problems)
    return path, _DcpReader(path)


# --------------------------------------------------------------------------------------- loading


def load_checkpoint(
    path: str | os.PathLike[str],
    map_location: str | torch.device | None = "cpu",
    *,
    verify: bool = False,
    weights_only: bool = False,
    optimizer_states: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint in this process, without any process group, as a full Lightning checkpoint dict.

    A sharded directory (this library's, stock ``FSDPStrategy``'s or ``ModelParallelStrategy``'s) is
    read whole into memory and returned as :func:`torch.load` returns a full checkpoint: full tensors
    in ``state_dict``, ``optimizer_states`` in torch's index form, and the rest from ``meta.pt``. A full
    file is read with :func:`torch.load`. Nothing on disk changes.

    Args:
        path: A sharded checkpoint directory or a full checkpoint file.
        map_location: Where to put the tensors (a device or device string).
        verify: Also compare every file's checksum with the manifest before reading.
        weights_only: Passed to :func:`torch.load`; ``False`` unpickles arbitrary objects (hyperparameters),
            so only load checkpoints you trust.
        optimizer_states: ``False`` skips the optimizer states of a sharded directory (nothing of them is
            read; the dict has no ``optimizer_states``): the model state and ``meta.pt`` only, as inference
            needs.

    Returns:
        The checkpoint dict.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: not a checkpoint, or a file missing, truncated or (with ``verify``) corrupted;
            the message names the file and the rank that wrote it.
    """
    real, kind = checkpoint_kind(path)
    if kind is CheckpointKind.FULL:
        return _load_full(real, map_location, weights_only)
    real, reader = _open_sharded(real, verify)
    meta = _read_meta(real, weights_only)
    if not optimizer_states:
        reader.skip(lambda top: OPTIMIZER_KEY.match(str(top)) is not None)
    flat: dict[str, Any] = reader.read_objects()
    targets = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in reader.tensors.items()
    }
    reader.read_tensors(targets, None)
    flat.update(targets)
    nested: dict[str, Any] = {}
    for key in sorted(flat):
        _set(nested, reader.path_of(key), flat[key])
    checkpoint = _to_lightning(nested, meta, real)
    if map_location is not None and torch.device(map_location).type != "cpu":
        device = torch.device(map_location)
        checkpoint = _map_tensors(checkpoint, lambda t: t.to(device))
    return checkpoint


def _load_full(file: storage.Location, map_location: Any, weights_only: bool) -> dict[str, Any]:
    try:
        checkpoint = storage.torch_load(file, map_location=map_location, weights_only=weights_only)
    except Exception as err:
        raise CheckpointError(
            f"The checkpoint file {str(file)!r} cannot be read ({type(err).__name__}: {_first_line(err)}):"
            " it is"
            " truncated or corrupt, or not a checkpoint. Restore it from a copy, or load an earlier"
            " checkpoint."
        ) from err
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"The file {str(file)!r} holds a {type(checkpoint).__name__}, not a Lightning checkpoint dict."
        )
    return checkpoint


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _leaves(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path, obj


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    return functools.reduce(lambda node, key: node[key], path, obj)


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
) -> storage.Location:
    """Convert a sharded checkpoint directory into one full checkpoint file, in one process.

    The output is what stock Lightning writes for a single device: plain :func:`torch.load` reads it,
    ``Trainer.fit(ckpt_path=dst)`` resumes from it (optimizer state in ``optimizer_states``) and
    ``LightningModule.load_from_checkpoint(dst)`` loads it, without this library.

    Memory stays bounded by the largest tensor (one chunk read at a time) plus buffers: the output
    is first written with every tensor's space reserved but empty (``torch.serialization.skip_data``),
    then memory-mapped (shared, so the page cache, not the process, holds it) and filled from the
    shards one chunk at a time; the CRC-32s of the archive's records are then recomputed, and the file
    is published atomically with :func:`~lightning_sharded.checkpoint.atomic.commit_file`.

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
    real, kind = checkpoint_kind(src)
    if kind is CheckpointKind.FULL:
        raise CheckpointError(
            f"{str(src)!r} is already a full checkpoint file: there is nothing to consolidate. Copy it"
            " instead."
        )
    real, reader = _open_sharded(real, verify)
    meta = _read_meta(real, weights_only=False)
    flat: dict[str, Any] = reader.read_objects()
    flat.update({key: _Slot(key) for key in reader.tensors})
    nested: dict[str, Any] = {}
    for key in sorted(flat):
        _set(nested, reader.path_of(key), flat[key])
    checkpoint = _to_lightning(nested, meta, real)

    slots: dict[str, tuple[Any, ...]] = {}
    real_tensors: dict[tuple[Any, ...], torch.Tensor] = {}
    for path, leaf in _leaves(checkpoint):
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
            targets = {key: _get(loaded, path) for key, path in slots.items()}
            with _progress_bar(total, show, f"consolidating {storage.basename(real)}") as tick:
                reader.read_tensors(targets, tick)
            for path, tensor in real_tensors.items():
                _get(loaded, path).copy_(tensor)
        finally:
            targets = {}
            del loaded
            gc.collect()
        _fix_zip_crcs(tmp)

    out = storage.location(dst)
    if isinstance(out, str):  # written locally (memory-mapped while filled), then one upload
        storage.call_with_local_file(out, write)
    else:
        commit_file(out, write)
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


# --------------------------------------------------------------------------------------- inspect


@dataclass
class EntryInfo:
    """One entry of a checkpoint.

    Attributes:
        key: DCP's flattened key (``state_dict.layer.weight``) or, in a full file, the dotted path.
        shape: Global shape, or ``None`` for a non-tensor object.
        dtype: ``torch.float32``... or ``"object"``.
        size: Bytes of the full tensor (or of the pickled object).
        shards: Number of chunks stored (1 in a full file).
    """

    key: str
    shape: list[int] | None
    dtype: str
    size: int
    shards: int


@dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` found.

    Attributes:
        path: The checkpoint read.
        kind: ``"sharded"`` or ``"full"``.
        entries: Every entry, sorted by key.
        total_size: Bytes of all entries.
        files: Files of the checkpoint (1 for a full file).
        disk_size: Bytes of those files.
        world_size: Ranks that wrote it (manifest, else the shard file names), ``None`` for a full file.
        epoch: Lightning epoch, when recorded.
        global_step: Lightning global step, when recorded.
        has_manifest: It has a lightning_sharded manifest.
    """

    path: str
    kind: str
    entries: list[EntryInfo] = field(default_factory=list)
    total_size: int = 0
    files: int = 0
    disk_size: int = 0
    world_size: int | None = None
    epoch: int | None = None
    global_step: int | None = None
    has_manifest: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for ``lightning-sharded inspect --json``)."""
        return asdict(self)


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe a checkpoint without loading its tensors (sharded: ``.metadata`` and ``meta.pt`` only).

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: not a checkpoint, or ``.metadata`` / ``meta.pt`` unreadable.
    """
    real, kind = checkpoint_kind(path)
    if kind is CheckpointKind.FULL:
        return _inspect_full(real)
    reader = _DcpReader(real)
    object_sizes: dict[str, int] = {}
    chunks: dict[str, int] = {}
    for index, info in (reader.metadata.storage_data or {}).items():
        object_sizes[index.fqn] = object_sizes.get(index.fqn, 0) + int(info.length)
        chunks[index.fqn] = chunks.get(index.fqn, 0) + 1
    entries = []
    for key, md in reader.tensors.items():
        numel = int(torch.Size(md.size).numel())
        itemsize = torch.empty((), dtype=md.properties.dtype).element_size()
        entries.append(
            EntryInfo(key, list(md.size), str(md.properties.dtype), numel * itemsize, len(md.chunks))
        )
    for key in reader.objects:
        entries.append(EntryInfo(key, None, "object", object_sizes.get(key, 0), chunks.get(key, 1)))
    entries.sort(key=lambda e: e.key)
    files = storage.list_files(real)
    info = CheckpointInfo(
        path=str(real),
        kind=kind.value,
        entries=entries,
        total_size=sum(e.size for e in entries),
        files=len(files),
        disk_size=sum(files.values()),
    )
    manifest = read_manifest(real)
    if manifest is not None:
        info.has_manifest = True
        info.world_size, info.epoch, info.global_step = (
            manifest.world_size,
            manifest.epoch,
            manifest.global_step,
        )
    else:
        ranks = {int(m.group(1)) for name in files if (m := SHARD_FILE.match(name))}
        info.world_size = max(ranks) + 1 if ranks else None
    if info.epoch is None and LIGHTNING_METADATA in files:
        meta = _read_meta(real, weights_only=False)
        info.epoch, info.global_step = meta.get("epoch"), meta.get("global_step")
    return info


def _inspect_full(file: storage.Location) -> CheckpointInfo:
    try:  # memory-mapped: the tensors are not read (an object is read whole)
        checkpoint = storage.torch_load(file, map_location="cpu", weights_only=False, mmap=True)
    except Exception:
        checkpoint = _load_full(file, "cpu", weights_only=False)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"The file {str(file)!r} holds a {type(checkpoint).__name__}, not a checkpoint dict."
        )
    entries = [
        EntryInfo(".".join(map(str, p)), list(t.shape), str(t.dtype), t.numel() * t.element_size(), 1)
        for p, t in _leaves(checkpoint)
        if isinstance(t, torch.Tensor)
    ]
    entries.sort(key=lambda e: e.key)
    return CheckpointInfo(
        path=str(file),
        kind=CheckpointKind.FULL.value,
        entries=entries,
        total_size=sum(e.size for e in entries),
        files=1,
        disk_size=storage.size(file),
        epoch=checkpoint.get("epoch"),
        global_step=checkpoint.get("global_step"),
    )
