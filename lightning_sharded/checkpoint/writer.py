"""A DCP storage writer that checksums the shard files while it writes them.

The manifest lists every file with its CRC-32. Reading the files back after the save to checksum them
costs as much as 0.7 s per GB here, about half of the write itself; a save that hashes the bytes on
their way to the file, in a thread of its own that runs while the disk flushes (``fsync``), hides
almost all of it. :class:`ChecksummingWriter` is torch's ``FileSystemWriter`` with such streams; after
the save, :attr:`ChecksummingWriter.checksums` holds ``{file name: (size, crc32 hex)}`` for every file
it wrote (shards and ``.metadata``), the figures :func:`~lightning_sharded.checkpoint.manifest.file_checksum`
would give.

It also switches off ``torch.save``'s own per-record CRC-32 for the shards it writes (DCP stores each
tensor with ``torch.save``; that checksum halves its throughput here and is redundant with ours).
Files written that way load everywhere, with or without this library.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import threading
import zlib
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

__all__ = ["ChecksummingWriter", "without_torch_crc32"]

# Smaller writes (zip headers, pickles) are copied and hashed at once: their buffer may be reused.
_HASH_INLINE_BELOW = 1 << 20


class _HashingStream(io.RawIOBase):
    """A binary file that hands each write to a hashing thread, in order; :meth:`result` joins it."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self._raw = raw
        self._size = 0
        self._crc = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._hash, name="lightning-sharded-crc32", daemon=True)
        self._thread.start()

    def _hash(self) -> None:
        crc = 0
        while (chunk := self._queue.get()) is not None:
            try:
                crc = zlib.crc32(chunk, crc)
            except BaseException as err:  # reported by result()
                self._error = err
        self._crc = crc

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self._raw.write(view)
        if n != len(view):  # a buffered writer writes everything or raises; keep it exact anyway
            raise OSError(f"short write: {n} of {len(view)} bytes")
        self._size += n
        self._queue.put(bytes(view) if n < _HASH_INLINE_BELOW else view)
        return n

    def tell(self) -> int:
        return self._raw.tell()

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def result(self) -> tuple[int, str]:
        """Wait for the hashing thread; ``(size, crc32 as 8 hex digits)`` of all bytes written."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._size, f"{self._crc & 0xFFFFFFFF:08x}"

    def close(self) -> None:
        # DCP closes the stream inside `create_stream`; the file itself is closed by our context.
        self._raw.flush()


class _ChecksummingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, tuple[int, str]] = {}
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with open(path, mode + "b" if "b" not in mode else mode) as raw:
            stream = _HashingStream(raw)
            try:
                yield stream
            except BaseException as err:  # kept: torch's extra writer threads only print it
                with self._lock:
                    self.errors.append(err)
                raise
            finally:
                figures = stream.result()
        with self._lock:
            self.checksums[path.name] = figures

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.checksums:
                self.checksums[Path(new_path).name] = self.checksums.pop(Path(path).name)

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        super().rm_file(path)
        with self._lock:
            self.checksums.pop(Path(path).name, None)


class ChecksummingWriter(FileSystemWriter):
    """``FileSystemWriter`` whose files are CRC-32-checksummed as they are written.

    Args:
        path: the checkpoint directory.
        **kwargs: as ``FileSystemWriter`` (``thread_count``, ``sync_files``...).
    """

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs: _ChecksummingFileSystem = _ChecksummingFileSystem()

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

    @property
    def checksums(self) -> dict[str, tuple[int, str]]:
        """``{file name: (size, crc32 hex)}`` of every file this writer wrote into its directory."""
        return dict(self.fs.checksums)


@contextlib.contextmanager
def without_torch_crc32() -> Iterator[None]:
    """``torch.save`` without its per-record CRC-32 inside the block (a global setting; restored after)."""
    from torch.utils.serialization import config

    previous = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = previous
