"""Counting what one rank does to storage and to the other ranks (``benchmarks.scale``).

:class:`Tally` counts, for one rank's run of a save or a load: file-system operations by kind and by
file (``open``-for-read, ``open``-for-write, ``stat``, ``list``, ``mkdir``, ``rename``, ``unlink``,
``fsync``...), S3 requests by kind and key (``GET``, ``HEAD``, ``PUT``, ``LIST``, ``DELETE``, counted
where s3fs issues them), and collectives by kind with the bytes this rank sends and receives. Each is
attributed to DCP (anything under ``torch.distributed.checkpoint.save`` / ``load``) or to our layer
(anything else under ``lightning_sharded``). :func:`instrument` patches what is counted for a block
(``benchmarks.timing.patched``: always undone) and serves the object collectives by a
:class:`~benchmarks.scale.simworld.SimWorld`.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch

from benchmarks.scale.simworld import SimWorld
from benchmarks.timing import patched

_SHARD = re.compile(r"__(\d+)_\d+\.distcp$")
_RANK_INDEX = re.compile(r"^rank-(\d+)\.json$")
_DCP_ENTRY = (
    os.sep + os.path.join("torch", "distributed", "checkpoint", "state_dict_saver.py"),
    os.sep + os.path.join("torch", "distributed", "checkpoint", "state_dict_loader.py"),
)
_OURS = os.sep + "lightning_sharded" + os.sep


def file_class(path: str, rank: int) -> str:
    """What a path is, for the tables: a shared small file, this rank's shard, another's, a directory."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if name in (".metadata", ".metadata.tmp"):
        return ".metadata"
    if name == "meta.pt":
        return "meta.pt"
    if name.endswith("lightning_sharded.json") or name.endswith("lightning_sharded.json.tmp"):
        return "manifest"
    if name == "layout.json":
        return "index layout"
    m = _RANK_INDEX.search(name)
    if m:
        return "own index" if int(m.group(1)) == rank else "other indexes"
    m = _SHARD.search(name)
    if m:
        return "own shard" if int(m.group(1)) == rank else "other shards"
    return "directory"


def origin() -> str:
    """The caller: ``"dcp"`` (in a DCP save or load), ``"ours"`` (in lightning_sharded), else ``"other"``."""
    frame: FrameType | None = sys._getframe(2)
    ours = False
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith(_DCP_ENTRY):
            return "dcp"
        if _OURS in name:
            ours = True
        frame = frame.f_back
    return "ours" if ours else "other"


class Tally:
    """Counts of one rank's run; only paths under ``root`` and S3 keys under ``prefix`` count."""

    def __init__(self, rank: int, root: str, prefix: str | None = None) -> None:
        self.rank = rank
        self.root = root
        self.prefix = prefix
        self.files: Counter[tuple[str, str, str]] = Counter()  # (origin, kind, class)
        self.s3: Counter[tuple[str, str, str]] = Counter()
        self.collectives: Counter[tuple[str, str]] = Counter()
        self.collective_bytes: Counter[tuple[str, str]] = Counter()
        self._paused = 0
        self.s3_origin: str | None = None
        self._fds: dict[int, str] = {}
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self._paused == 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def file_op(self, kind: str, path: Any) -> None:
        if not self.active:
            return
        try:
            text = os.fsdecode(path) if not isinstance(path, int) else self._fds.get(path, "")
        except TypeError:
            return
        if not text or not os.path.abspath(text).startswith(self.root):
            return
        with self._lock:
            self.files[(origin(), kind, file_class(text, self.rank))] += 1

    def s3_op(self, method: str, kwargs: dict[str, Any]) -> None:
        if not self.active:
            return
        key = f"{kwargs.get('Bucket', '')}/{kwargs.get('Key', kwargs.get('Prefix', ''))}"
        if self.prefix is not None and not key.startswith(self.prefix):
            return
        kind = _S3_KINDS.get(method, method)
        with self._lock:
            self.s3[(self.s3_origin or origin(), kind, file_class(key, self.rank))] += 1

    def collective(self, kind: str, nbytes: int) -> None:
        if not self.active:
            return
        where = origin()
        self.collectives[(where, kind)] += 1
        self.collective_bytes[(where, kind)] += nbytes

    def summary(self) -> dict[str, Any]:
        """Counts as dicts: ``{origin: {kind: {class: n}}}``, collectives ``{origin: {kind: [n, bytes]}}``."""

        def nest(counter: Counter[tuple[str, str, str]]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for (who, kind, cls), n in sorted(counter.items()):
                out.setdefault(who, {}).setdefault(kind, {})[cls] = n
            return out

        coll: dict[str, Any] = {}
        for (who, kind), n in sorted(self.collectives.items()):
            coll.setdefault(who, {})[kind] = [n, self.collective_bytes[(who, kind)]]
        return {"files": nest(self.files), "s3": nest(self.s3), "collectives": coll}


_S3_KINDS = {
    "get_object": "GET",
    "head_object": "HEAD",
    "head_bucket": "HEAD",
    "put_object": "PUT",
    "copy_object": "PUT",
    "create_multipart_upload": "PUT",
    "upload_part": "PUT",
    "complete_multipart_upload": "PUT",
    "list_objects_v2": "LIST",
    "list_objects": "LIST",
    "delete_object": "DELETE",
    "delete_objects": "DELETE",
}


@contextlib.contextmanager
def instrument(tally: Tally, world: SimWorld | None, *, files: bool = True) -> Iterator[None]:
    """Count every file, S3 and collective operation into ``tally``; serve object collectives by ``world``.

    With ``files=False`` only the collectives are served (and nothing is counted): for timing.
    """
    import torch.distributed as dist

    stack = contextlib.ExitStack()
    if not files:
        stack.enter_context(tally.paused())

    def patch(owner: Any, name: str, new: Any) -> None:
        stack.enter_context(patched(owner, name, new))

    real_open, real_os_open = builtins.open, os.open

    def counted_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, mode, *args, **kwargs)
        if not isinstance(file, int):
            writing = any(c in mode for c in "wax+")
            tally.file_op("write" if writing else "read", file)
            with contextlib.suppress(Exception):
                tally._fds[f.fileno()] = os.fsdecode(file)
        return f

    def counted_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_os_open(path, flags, *args, **kwargs)
        writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        is_dir = flags & getattr(os, "O_DIRECTORY", 0)
        tally.file_op("open dir" if is_dir else ("write" if writing else "read"), path)
        tally._fds[fd] = os.fsdecode(path)
        return fd

    def wrap(name: str, kind: str, arg: int = 0) -> None:
        real = getattr(os, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if len(args) > arg:
                tally.file_op(kind, args[arg])
            return real(*args, **kwargs)

        patch(os, name, counted)

    real_scandir = os.scandir

    class _Entry:  # a DirEntry whose stat() (one system call per file, unlike is_file()) is counted
        def __init__(self, entry: Any) -> None:
            self._entry = entry

        def __getattr__(self, name: str) -> Any:
            return getattr(self._entry, name)

        def __fspath__(self) -> str:
            return str(os.fspath(self._entry))

        def stat(self, *args: Any, **kwargs: Any) -> Any:
            tally.file_op("stat", self._entry.path)
            return self._entry.stat(*args, **kwargs)

    class _Listing:
        def __init__(self, it: Any) -> None:
            self._it = it

        def __iter__(self) -> Iterator[Any]:
            return (_Entry(e) for e in self._it)

        def __next__(self) -> Any:
            return _Entry(next(self._it))

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: Any) -> None:
            self._it.close()

        def close(self) -> None:
            self._it.close()

    def counted_scandir(path: Any = ".") -> Any:
        tally.file_op("list", path)
        return _Listing(real_scandir(path))

    if files:
        patch(os, "scandir", counted_scandir)
        patch(builtins, "open", counted_open)
        patch(io, "open", counted_open)
        patch(os, "open", counted_os_open)
    for name, kind in (
        ()
        if not files
        else (
            ("stat", "stat"),
            ("lstat", "stat"),
            ("listdir", "list"),
            ("mkdir", "mkdir"),
            ("rename", "rename"),
            ("replace", "rename"),
            ("unlink", "unlink"),
            ("remove", "unlink"),
            ("rmdir", "rmdir"),
            ("fsync", "fsync"),
            ("pread", "read"),
        )
    ):
        wrap(name, kind)

    with contextlib.suppress(ImportError):
        if not files:
            raise ImportError
        import fsspec.asyn
        import s3fs.core

        real_call = s3fs.core.S3FileSystem._call_s3
        real_sync = fsspec.asyn.sync

        async def counted_call(self: Any, method: str, *akwarglist: Any, **kwargs: Any) -> Any:
            tally.s3_op(method, kwargs)
            return await real_call(self, method, *akwarglist, **kwargs)

        def counted_sync(*args: Any, **kwargs: Any) -> Any:
            # s3fs runs its requests in fsspec's event-loop thread: whose they are is known here only.
            tally.s3_origin = origin()
            try:
                return real_sync(*args, **kwargs)
            finally:
                tally.s3_origin = None

        patch(fsspec.asyn, "sync", counted_sync)
        if getattr(s3fs.core, "sync", None) is real_sync:  # s3fs's own reference to it (file reads)
            patch(s3fs.core, "sync", counted_sync)
        patch(s3fs.core.S3FileSystem, "_call_s3", counted_call)
        patch(s3fs.core.S3FileSystem, "call_s3", fsspec.asyn.sync_wrapper(counted_call))

    def object_collective(name: str) -> None:
        real = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if world is None:
                tally.collective(name, 0)
                return real(*args, **kwargs)
            cpu, wall, own = time.process_time(), time.perf_counter(), world.own_cpu
            with tally.paused():
                nbytes = getattr(world, name)(*args, **kwargs)
            # the simulation's own time, less the pickling a real rank does itself (SimWorld.own_cpu)
            world.cpu += time.process_time() - cpu - (world.own_cpu - own)
            world.wall += time.perf_counter() - wall - (world.own_cpu - own)
            tally.collective(name, nbytes)
            return None

        patch(dist, name, counted)

    def tensor_collective(name: str) -> None:
        real = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if args else None
            nbytes = int(tensor.numel() * tensor.element_size()) if isinstance(tensor, torch.Tensor) else 0
            tally.collective(name, nbytes)
            return real(*args, **kwargs)

        patch(dist, name, counted)

    for name in ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list"):
        object_collective(name)
    for name in (
        "all_reduce",
        "broadcast",
        "barrier",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
    ):
        tensor_collective(name)
    with stack:
        yield
