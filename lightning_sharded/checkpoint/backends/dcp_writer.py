"""A DCP storage writer that checksums the shard files while it writes them.

The manifest lists every file with its CRC-32. Reading the files back after the save to checksum them
costs as much as 0.7 s per GB here, about half of the write itself; hashing the bytes on their way to
the file (:class:`~lightning_sharded.checkpoint.checksum.HashingStream`) hides most of it.
:class:`ChecksummingWriter` is torch's ``FileSystemWriter`` with such streams; after the save,
:attr:`ChecksummingWriter.checksums` holds ``{file name: (size, crc32 hex)}`` for every file it wrote.

While DCP writes into one of its files (on that thread only: torch's setting is a context variable),
it switches off ``torch.save``'s own per-record CRC-32 (it halves the throughput here and is redundant
with ours; the files still load everywhere, with or without this library) and keeps a large shard's
write-back going as it is written, its pages leaving the page cache once on disk
(:class:`~lightning_sharded.checkpoint.writeback.WriteBehind`: no fresh memory for the page cache,
which costs a background save's CPU, and so training's).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.utils.serialization import config as torch_save  # its settings: context variables
from typing_extensions import override

from lightning_sharded.checkpoint.checksum import HashingStream
from lightning_sharded.checkpoint.failures import named_os_error
from lightning_sharded.checkpoint.writeback import WriteBehind

__all__ = ["ChecksummingWriter", "ChecksumsKept"]


class ChecksumsKept:
    """A DCP filesystem's ``{file name: (size, crc32 hex)}`` of the files it wrote, kept through renames."""

    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # type: ignore[misc]
        with self._lock:
            if Path(path).name in self.checksums:
                self.checksums[Path(new_path).name] = self.checksums.pop(Path(path).name)


class _ChecksummingFileSystem(ChecksumsKept, FileSystem):
    def __init__(self, torch_crc32: bool) -> None:
        super().__init__()
        self.torch_crc32 = torch_crc32
        self.errors: list[BaseException] = []

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with open(path, mode + "b" if "b" not in mode else mode) as raw:
            behind = WriteBehind(raw.fileno())
            stream = HashingStream(raw, write_behind=behind)
            try:
                with torch_save.patch({"save.compute_crc32": self.torch_crc32}):  # type: ignore[attr-defined]
                    yield stream  # DCP writes the file (torch.save per item) and fsyncs it (its sync_files)
                behind.finish()
            except BaseException as err:  # kept: torch's extra writer threads only print it
                named = named_os_error(stream.error or err, path)
                with self._lock:
                    self.errors.append(named or err)
                if named is None:
                    raise
                # torch.save swallowed the write's OSError (RuntimeError "unexpected pos"): raise it
                raise named from err
            finally:
                figures = stream.result()
        with self._lock:
            self.checksums[path.name] = figures

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        super().rm_file(path)
        with self._lock:
            self.checksums.pop(Path(path).name, None)


class ChecksummingWriter(FileSystemWriter):
    """``FileSystemWriter`` whose files are CRC-32-checksummed as they are written.

    Args:
        path: the checkpoint directory.
        torch_crc32: whether ``torch.save`` writes its own per-record CRC-32 into the shard files
            (``False``: the manifest's whole-file CRC-32 covers them; decided per file this writer opens,
            never for the process).
        **kwargs: as ``FileSystemWriter`` (``thread_count``, ``sync_files``...).
    """

    def __init__(self, path: str | os.PathLike[str], *, torch_crc32: bool = False, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs: _ChecksummingFileSystem = _ChecksummingFileSystem(torch_crc32)

    def write_data(self, plan: Any, planner: Any) -> Any:
        """Write this rank's items, then raise if any writer thread failed.

        torch's extra writer threads (``thread_count > 1``) only print their exceptions: the save would
        go on with the items they lost, and publish a checkpoint whose index points at missing bytes.
        """
        future = super().write_data(plan, planner)
        results = future.wait()
        if self.fs.errors:
            raise self.fs.errors[0]
        if len(results) != len(plan.items):
            raise OSError(
                f"The checkpoint writer wrote {len(results)} of the {len(plan.items)} items of this rank into"
                f" {str(self.path)!r}; a writer thread failed (its error was printed above)."
            )
        return future

    @override
    def storage_meta(self) -> StorageMeta | None:
        """DCP's record of the save in ``.metadata``, without a ``checkpoint_id``: this writer writes into
        a staging directory that the commit renames, so its path would name a directory that no longer
        exists once the checkpoint is published (and make the index's bytes depend on where the run was).
        The save's ``save_id`` stays."""
        meta = super().storage_meta()
        if meta is not None:
            meta.checkpoint_id = None
        return meta

    @property
    def checksums(self) -> dict[str, tuple[int, str]]:
        """``{file name: (size, crc32 hex)}`` of every file this writer wrote into its directory."""
        return dict(self.fs.checksums)
