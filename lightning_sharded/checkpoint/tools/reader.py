"""Reading checkpoints in one process, without any process group: the offline reader and ``load_checkpoint``.

A sharded directory (this library's, stock ``FSDPStrategy``'s DCP keys ``model``, ``optimizer_N``, or
stock ``ModelParallelStrategy``'s ``state_dict``, ``optimizer_N``; and ``meta.pt``) becomes the dict a full
Lightning checkpoint is, ``optimizer_states`` indexed in the order of the parameter groups, as
``Optimizer.state_dict()`` numbers them. Every pickle is read safely unless the caller passes
``weights_only=False`` (:mod:`~lightning_sharded.checkpoint.unpickling`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_sharded.checkpoint import names, unpickling
from lightning_sharded.checkpoint.backends import Backend, Location, join
from lightning_sharded.checkpoint.backends.dcp_reader import SafeBytesPlanner
from lightning_sharded.checkpoint.dcp_index import model_key, read_index, top_level_keys
from lightning_sharded.checkpoint.detect import CheckpointKind, Found, detect, not_a_checkpoint
from lightning_sharded.checkpoint.errors import CheckpointError, first_line
from lightning_sharded.checkpoint.integrity import ReadChecksums, ReadVerification, prepare_read
from lightning_sharded.checkpoint.lightning_meta import VERIFY_HINT, read_meta
from lightning_sharded.checkpoint.tools.nested import get_path, set_path, to_lightning

log = logging.getLogger(__name__)

__all__ = [
    "OfflineReader",
    "first_line",
    "get_path",
    "leaves",
    "load_full",
    "map_tensors",
    "open_sharded",
    "read_checkpoint",
    "read_full",
    "safe_torch_load",
    "set_path",
]


# ------------------------------------------------------------------------------------ reading DCP


class OfflineReader:
    """Reads a DCP directory in this process (``no_dist``), tensor entries into given targets; with a
    ``verification``, the reads record the CRC-32 of the bytes they read, for :meth:`check`."""

    def __init__(
        self,
        backend: Backend,
        root: Location,
        weights_only: bool | None = True,
        verification: ReadVerification | None = None,
    ) -> None:
        self.backend = backend
        self.root = root
        self.weights_only = weights_only
        #: Checksums computed from the reads (:func:`open_sharded` with ``during``); see :meth:`check`.
        self.verification = verification
        self.metadata: Any = read_index(backend, root, weights_only=weights_only)
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        entries = self.metadata.state_dict_metadata
        self.tensors = {k: v for k, v in sorted(entries.items()) if isinstance(v, TensorStorageMetadata)}
        self.objects = sorted(k for k in entries if k not in self.tensors)
        self.mapping: dict[str, tuple[Any, ...]] = dict(self.metadata.planner_data or {})

    def path_of(self, key: str) -> tuple[Any, ...]:
        return tuple(self.mapping.get(key, (key,)))

    @functools.cached_property
    def _model_key(self) -> str:
        return model_key(top_level_keys(self.metadata), self.root)

    def model_key(self) -> str:
        """The top-level key of the model state (a ``CheckpointError`` for neither key or both); found
        once per reader (every index key is walked)."""
        return self._model_key

    def model_tensors(self) -> Iterator[tuple[str, str, Any]]:
        """``(DCP key, model key, metadata)`` of each tensor entry of the model state."""
        top = self.model_key()
        for key, md in self.tensors.items():
            if (path := self.path_of(key))[0] == top:
                yield key, ".".join(map(str, path[1:])), md

    def read_meta(self) -> dict[str, Any]:
        """``meta.pt``, read safely unless ``weights_only`` is ``False``."""
        with self.reading():
            return read_meta(
                self.backend, join(self.root, names.LIGHTNING_METADATA), self.weights_only, safe=True
            )

    def to_lightning(self, flat: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
        """DCP's entries (``flat``, by key) plus ``meta.pt`` as the dict of a full Lightning checkpoint."""
        return to_lightning(flat, meta, self.path_of, self.root)

    def what(self, fqn: str, relative_path: str | None = None) -> str:
        """An entry in words, for :class:`unpickling.RefusedPickleError`."""
        rank = names.shard_rank(relative_path or "")
        by = f", written by rank {rank}" if rank is not None else ""
        where = f" (in {relative_path!r}{by})" if relative_path else ""
        return f"The entry {fqn!r} of the sharded checkpoint {str(self.root)!r}{where}"

    def skip(self, top_level: Callable[[Any], bool]) -> None:
        """Read none of the entries whose top-level key (``"optimizer_0"``...) ``top_level`` picks."""
        self.tensors = {k: v for k, v in self.tensors.items() if not top_level(self.path_of(k)[0])}
        self.objects = [k for k in self.objects if not top_level(self.path_of(k)[0])]

    def _load(
        self,
        state: dict[str, Any],
        on_tensor: Callable[[int], None] | None = None,
        on_filled: Callable[[torch.Tensor, int | None], None] | None = None,
    ) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        from lightning_sharded._compat import dcp_load_state_dict

        refusals: list[CheckpointError] = []
        checksums = self.verification.checksums if self.verification is not None else None
        if checksums is None and on_filled is not None and self.backend.reads_checksums:
            checksums = ReadChecksums()  # each direct read's CRC-32 for on_filled, computed as it is read

        def what(read_item: Any) -> str:
            info = (self.metadata.storage_data or {}).get(read_item.storage_index)
            return self.what(read_item.dest_index.fqn, str(info.relative_path) if info is not None else None)

        class Planner(SafeBytesPlanner):
            def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
                super().commit_tensor(read_item, tensor)
                if on_filled is not None:
                    on_filled(tensor, checksums.take() if checksums is not None else None)
                if on_tensor is not None:
                    on_tensor(int(torch.Size(read_item.lengths).numel()) * tensor.element_size())

            def load_bytes(self, read_item: Any, value: Any) -> None:
                try:
                    super().load_bytes(read_item, value)
                except CheckpointError as err:
                    refusals.append(err)
                    raise

        planner = Planner(
            flatten_state_dict=False,
            flatten_sharded_tensors=False,
            allow_partial_load=True,
            weights_only=self.weights_only,
            what=what,
        )
        # metadata: already read safely
        reader = self.backend.dcp_reader(self.root, self.metadata, checksums)
        with self.reading():
            try:
                dcp_load_state_dict(state, storage_reader=reader, planner=planner)
            except (CheckpointException, Exception) as err:
                if refusals:
                    raise refusals[0] from None
                where = self.diagnose()
                raise CheckpointError(
                    f"Reading the sharded checkpoint {str(self.root)!r} failed"
                    + (f": {where}" if where else f" ({first_line(err)})")
                    + ". Restore it from a copy, or load an earlier checkpoint. "
                    + VERIFY_HINT.format(path=self.root)
                ) from err

    def reading(self) -> contextlib.AbstractContextManager[None]:
        """Around any read of the checkpoint's files: with a ``verification``, a ``CheckpointError``
        raised in it is replaced by the damage every file's checksum shows, if any."""
        return self.verification.reading() if self.verification is not None else contextlib.nullcontext()

    def check(self) -> None:
        """With a ``verification``: every file's checksum (completed from the bytes the reads did not
        cover) compared with the manifest; call it after the last read, before what was read is used."""
        if self.verification is not None:
            self.verification.check()

    def diagnose(self) -> str | None:
        """After a failed read: the first stored item that does not deserialize, by file, rank and key.

        Reads one item at a time (memory bounded by the largest chunk).
        """
        items = sorted(
            (self.metadata.storage_data or {}).items(),
            key=lambda kv: (str(kv[1].relative_path), int(kv[1].offset)),
        )
        for index, info in items:
            rel = str(info.relative_path)
            rank = names.shard_rank(rel)
            who = f" (written by rank {rank})" if rank is not None else ""
            try:
                with self.backend.open_file(join(self.root, rel)) as f:
                    f.seek(int(info.offset))
                    data = f.read(int(info.length))
                if len(data) != int(info.length):
                    raise EOFError(f"{len(data)} of {int(info.length)} bytes")
                unpickling.safe_load(
                    io.BytesIO(data),
                    what=self.what(index.fqn, rel),
                    weights_only=True if index.fqn in self.tensors else self.weights_only,
                    map_location="cpu",
                )
            except CheckpointError as err:
                return str(err)
            except Exception as err:
                return (
                    f"{rel!r}{who} is corrupted: its entry {index.fqn!r} at byte {int(info.offset)} cannot be"
                    f" read ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
                )
        return None

    def read_objects(self, keys: list[str] | None = None) -> dict[str, Any]:
        """The non-tensor entries (the optimizers' ``param_groups``...): ``keys``, or all of them."""
        state: dict[str, Any] = dict.fromkeys(self.objects if keys is None else keys)
        if state:
            self._load(state)
        return state

    def read_tensors(
        self,
        targets: dict[str, torch.Tensor],
        on_tensor: Callable[[int], None] | None,
        on_filled: Callable[[torch.Tensor, int | None], None] | None = None,
    ) -> None:
        """Copy the tensor entries named by ``targets`` into them (full, global shape), chunk by chunk;
        ``on_tensor`` gets each chunk's bytes (a progress bar), ``on_filled`` its region of the target and
        the CRC-32 of its bytes where the read computed it (a direct read, local files), else ``None``."""
        self._load(dict(targets), on_tensor, on_filled)


def safe_torch_load(backend: Backend, file: Location, weights_only: bool | None, **kwargs: Any) -> Any:
    """A full checkpoint file through :func:`unpickling.safe_load`; ``kwargs`` go to ``torch.load``."""
    what = f"The checkpoint file {str(file)!r}"
    return unpickling.safe_load(file, what=what, weights_only=weights_only, load=backend.torch_load, **kwargs)


def open_sharded(
    found: Found, verify: bool, weights_only: bool | None = True, *, during: bool = False, then: str = ""
) -> OfflineReader:
    """Check a sharded checkpoint's files (against its manifest, or its index), then open its index.

    Both read ``.metadata`` safely unless ``weights_only`` is ``False``. With ``verify``, every file's
    checksum is compared with the manifest before this returns; with ``during`` too (a manifest, local
    files), presence and sizes are checked now and the checksums are computed from the reader's own
    reads (each byte read once): the caller must call :meth:`OfflineReader.check` after its last read,
    before it returns or publishes anything, and ``then`` is what its error adds (what was not done).
    """
    verification = prepare_read(found, verify, weights_only, during=during, then=then)
    if verification is not None:
        with verification.reading():  # the index is the first file read
            return OfflineReader(found.backend, found.data, weights_only, verification)
    return OfflineReader(found.backend, found.data, weights_only)


# --------------------------------------------------------------------------------------- loading


def read_checkpoint(
    path: str | os.PathLike[str],
    map_location: str | torch.device | None = "cpu",
    *,
    verify: bool = False,
    weights_only: bool | None = True,
    optimizer_states: bool = True,
) -> dict[str, Any]:
    """What the checkpoint at ``path`` holds, as a full Lightning checkpoint dict, in this process.

    :func:`~lightning_sharded.checkpoint.tools.frozen.load_checkpoint` (the public ``load_checkpoint``,
    which documents the arguments) without reading a trainable-only checkpoint's frozen part: such a
    checkpoint's dict says what it left out under :data:`~lightning_sharded.checkpoint.names.FROZEN_KEY`
    (a sharded directory's from its manifest, a full file's as saved).
    """
    found = detect(path)
    if found.kind is CheckpointKind.FULL:
        return load_full(found.backend, found.data, map_location, weights_only)
    reader = open_sharded(found, verify, weights_only, during=True)
    meta = reader.read_meta()
    if not optimizer_states:
        reader.skip(lambda top: names.OPTIMIZER_KEY.match(str(top)) is not None)
    flat = reader.read_objects()
    targets = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in reader.tensors.items()
    }
    reader.read_tensors(targets, None)
    reader.check()  # with verify: the checksums of what was read, before anything is returned
    checkpoint = reader.to_lightning({**flat, **targets}, meta)
    if found.manifest is not None and found.manifest.frozen is not None:
        checkpoint[names.FROZEN_KEY] = found.manifest.frozen.to_dict()
    if map_location is not None and torch.device(map_location).type != "cpu":
        device = torch.device(map_location)
        checkpoint = map_tensors(checkpoint, lambda t: t.to(device))
    return checkpoint


def read_full(backend: Backend, file: Location, weights_only: bool | None, fix: str, **kwargs: Any) -> Any:
    """:func:`safe_torch_load` of a full checkpoint file; an error reading it as a ``CheckpointError``
    (``fix``: what its message then tells to do, from a space, or nothing)."""
    try:
        return safe_torch_load(backend, file, weights_only, **kwargs)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"The checkpoint file {str(file)!r} cannot be read ({first_line(err)}): it is truncated or"
            f" corrupt, or not a checkpoint.{fix}"
        ) from err


def load_full(
    backend: Backend, file: Location, map_location: Any, weights_only: bool | None
) -> dict[str, Any]:
    """A full checkpoint file as ``torch.load`` returns it, checked to be a dict."""
    fix = " Restore it from a copy, or load an earlier checkpoint."
    checkpoint = read_full(backend, file, weights_only, fix, map_location=map_location)
    if not isinstance(checkpoint, dict):
        raise not_a_checkpoint(file, "file", f"it holds a {type(checkpoint).__name__}, not a checkpoint dict")
    return checkpoint


def map_tensors(obj: Any, fn: Callable[[Any], Any], kind: type = torch.Tensor) -> Any:
    """``obj`` with every ``kind`` (a tensor) in its dicts, lists and tuples replaced by ``fn`` of it."""
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn, kind)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn, kind) for v in obj)
    return obj


def leaves(
    obj: Any, path: tuple[Any, ...] = (), plain: bool = False
) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """``(path, value)`` of every leaf of ``obj``'s dicts, lists and tuples; with ``plain``, a list or
    tuple of plain values (``params: [0, 1]``) is one leaf."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, (*path, k), plain)
    elif isinstance(obj, (list, tuple)) and (
        not plain or any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in obj)
    ):
        for i, v in enumerate(obj):
            yield from leaves(v, (*path, i), plain)
    else:
        yield path, obj
