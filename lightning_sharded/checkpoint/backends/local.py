"""Checkpoints on a local or POSIX network filesystem: staged next to the target, published by rename
(over an existing checkpoint, ``renameat2(RENAME_EXCHANGE)`` where Linux and the filesystem support
it, else two renames through ``.<name>.old-<token>``). A save never replaces a non-empty directory of
something else. The steps and the recovery rules (:func:`resolve`): ``docs/checkpoint-format.md``,
"How a save commits" and "Recovery rules".
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import logging
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from lightning_sharded.checkpoint import libc, names
from lightning_sharded.checkpoint.backends.paths import Location
from lightning_sharded.checkpoint.checksum import file_checksum, ranges_checksum
from lightning_sharded.checkpoint.failures import free_space, named_os_error
from lightning_sharded.checkpoint.faults import FaultPoint, fault
from lightning_sharded.checkpoint.manifest import FileEntry, Manifest

if TYPE_CHECKING:
    from lightning_sharded.checkpoint.backends.dcp_reader import ReadRecorder

__all__ = ["LocalBackend", "leftovers", "resolve"]

log = logging.getLogger(__name__)


def leftovers(path: str | os.PathLike[str], kind: str | None = None) -> list[Path]:
    """The staging, old and trash siblings of checkpoint ``path`` (file or directory) left by saves,
    oldest first; only those of ``kind`` (``"staging"``, ``"old"`` or ``"trash"``) unless ``None``."""
    target = Path(path)
    pattern = names.sibling_pattern(target.name, names.SIBLING_KINDS if kind is None else (kind,))
    try:
        listed = os.listdir(target.parent)
    except FileNotFoundError:
        return []
    found = [(m.group(2), target.parent / n) for n in listed if (m := pattern.match(n))]
    return [p for _, p in sorted(found)]


def resolve(path: str | os.PathLike[str]) -> Path:
    """The path a load should read for checkpoint ``path``, after the recovery rules; changes nothing.

    Returns ``path`` itself when it exists; else the newest ``.<name>.old-<token>`` sibling (left by a
    crash between the two renames of a fallback publish) when there is one; else ``path`` (which does
    not exist, for the caller to report).
    """
    target = Path(path)
    if os.path.lexists(target):
        return target
    olds = leftovers(target, names.OLD)
    return olds[-1] if olds else target


def fsync_dir(path: Path) -> None:
    """``fsync`` a directory, so the entries created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with _naming(path), open(path, "rb") as f:
        os.fsync(f.fileno())  # a full disk or a quota may show only here (delayed allocation, NFS)


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An ``OSError`` raised inside without a file name (a write's, an fsync's) names ``path``."""
    try:
        yield
    except OSError as err:
        named = named_os_error(err, path)
        if named is None:
            raise
        raise named from err


def make_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents, each fsynced, and the one that existed above them."""
    created: list[Path] = []
    current = directory
    while not current.exists():
        created.append(current)
        current = current.parent
    for path in reversed(created):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            path.mkdir()
    for path in [*created, current] if created else []:
        fsync_dir(path)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with ``renameat2(RENAME_EXCHANGE)``; ``False`` where unsupported."""
    if fault(FaultPoint.NO_EXCHANGE, 0):  # a test's two-rename fallback
        return False
    renameat2 = libc.function(
        "renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint
    )
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {str(a)!r} and {str(b)!r}: {os.strerror(err)}")


def _delete(path: Path, *, rank: int = 0) -> None:
    """Delete a file or tree that no reader uses any more (already renamed away)."""
    if path.is_dir() and not path.is_symlink():
        first = True
        for root, dirs, files in os.walk(path, topdown=False):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(root, name))
                if first:
                    first = False
                    fault(FaultPoint.DURING_REMOVE, rank)
            for name in dirs:
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(os.path.join(root, name))
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _sibling(target: Path, kind: str) -> Path:
    return target.parent / names.sibling_name(target.name, kind)


def _discard(path: Path) -> None:
    """Rename ``path`` to a trash sibling (atomic), then delete it."""
    owner = names.owner_name(path.name)
    trash = _sibling(path.parent / owner if owner else path, names.TRASH)
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    _delete(trash)


def _refuse_foreign_directory(target: Path) -> None:
    """A save replaces a previous checkpoint, never a directory of something else (it would delete it)."""
    if not target.is_dir() or target.is_symlink():
        return
    listed = os.listdir(target)
    if not listed or any(names.is_checkpoint_member(n) for n in listed):
        return
    shown = ", ".join(sorted(listed)[:5]) + (", ..." if len(listed) > 5 else "")
    raise IsADirectoryError(  # stock Lightning's words first
        f"The checkpoint path exists and is a directory: {target}; it is a directory that is not a checkpoint"
        f" (it holds {shown}), and saving would replace and delete it. Choose another path, or remove the"
        " directory first."
    )


def _walk(root: Path) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            yield name if rel == "." else f"{Path(rel).as_posix()}/{name}"


def _entry(staging: Path, rel: str, rank: int, known: Mapping[str, tuple[int, str]]) -> FileEntry:
    """The manifest entry of one staged file, fsynced: from ``known`` (checksummed while written, its
    size checked against the file) or else by reading the file back."""
    figures = known.get(rel)
    if figures is not None and os.stat(staging / rel).st_size == figures[0]:
        _fsync_file(staging / rel)
        return FileEntry(rel, figures[0], figures[1], rank)
    with _naming(staging / rel):  # a failed read or fsync names the file, as _fsync_file's does
        size, checksum = file_checksum(staging / rel, fsync=True)
    return FileEntry(rel, size, checksum, rank)


def _path(loc: Location) -> Path:
    assert isinstance(loc, Path), loc
    return loc


class LocalBackend:
    """Local paths: plain file calls, torch's file-system DCP reader and writer, publish by rename."""

    noun = "directory"
    place = "path"
    reads_checksums = True
    hint = "Check the path or `ckpt_path` (relative paths start at {cwd!r})."

    def locate(self, target: Location) -> tuple[Location, Manifest | None]:
        real = resolve(_path(target))
        return real, self.manifest_at(real) if real.is_dir() else None

    def manifest_at(self, data: Location) -> Manifest | None:
        path = _path(data) / names.MANIFEST_NAME
        try:
            text = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return Manifest.from_json(text, source=str(path))

    def manifest_is_stale(self, target: Location, manifest: Manifest) -> bool:
        # By content, not by file times (a plain `cp -r` reorders those): a stock save over ours
        # rewrites both `.metadata` (a new save id every time) and `meta.pt`, so neither matches the
        # manifest any more. One file alone that differs is damage, for the checks to report.
        real = resolve(_path(target))
        return all(
            self._differs(real / name, manifest.entry(name))
            for name in (names.DCP_METADATA, names.LIGHTNING_METADATA)
        )

    @staticmethod
    def _differs(path: Path, entry: FileEntry | None) -> bool:
        if entry is None:
            return False
        try:
            return os.stat(path).st_size != entry.size or file_checksum(path)[1] != entry.checksum
        except FileNotFoundError:
            return False

    def exists(self, loc: Location) -> bool:
        return os.path.lexists(loc)

    def is_file(self, loc: Location) -> bool:
        return _path(loc).is_file()

    def size(self, loc: Location) -> int:
        return os.stat(loc).st_size

    def list_files(self, loc: Location) -> dict[str, int]:
        # One stat per file (the entry's type comes with the listing): on rank 0 only, see verify.
        try:
            with os.scandir(loc) as entries:
                return {e.name: e.stat().st_size for e in entries if e.is_file()}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def list_dirs(self, loc: Location) -> list[str]:
        try:
            return sorted(p.name for p in _path(loc).iterdir() if p.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def open_file(self, loc: Location) -> IO[bytes]:
        return open(loc, "rb")

    def read_bytes(self, loc: Location) -> bytes:
        return _path(loc).read_bytes()

    def torch_load(self, loc: Location, **kwargs: Any) -> Any:
        import torch

        return torch.load(loc, **kwargs)

    def local_file(self, loc: Location) -> contextlib.nullcontext[Path]:
        return contextlib.nullcontext(_path(loc))

    def checksum(self, loc: Location, known: Sequence[tuple[int, int, int]] | None = None) -> tuple[int, str]:
        if known is None:
            return file_checksum(loc)
        return ranges_checksum(loc, os.stat(loc).st_size, known)

    def dcp_reader(
        self,
        data: Location,
        metadata: Any = None,
        checksums: ReadRecorder | None = None,
    ) -> Any:
        from lightning_sharded.checkpoint.backends.dcp_reader import DirectReader

        return DirectReader(data, metadata=metadata, checksums=checksums)

    def prepare(
        self, target: Location, *, directory: bool, measure: bool = False
    ) -> tuple[str | None, int | None]:
        target = _path(target)
        make_dirs(target.parent)
        _refuse_foreign_directory(target)
        olds = leftovers(target, names.OLD)
        if not os.path.lexists(target) and olds:
            newest = olds.pop()
            log.warning("Recovering checkpoint %s from %s left by an interrupted save", target, newest.name)
            os.rename(newest, target)
            fsync_dir(target.parent)
        for stale in leftovers(target, names.STAGING) + leftovers(target, names.TRASH) + olds:
            if stale.exists():
                log.info("Removing %s left by an interrupted save", stale)
                _delete(stale)
        return None, self.free_space(target) if measure else None

    def free_space(self, target: Location) -> int | None:
        """Bytes free for a save at ``target`` (its filesystem's, ``statvfs``): what :meth:`prepare`
        measures (this backend's own; object storage has no such limit)."""
        return free_space(_path(target).parent, writable=True)

    def stage(self, target: Location, *, directory: bool) -> Location:
        staged = _sibling(_path(target), names.STAGING)
        if directory:
            staged.mkdir()
        return staged

    def dcp_writer(self, staging: Location, **kwargs: Any) -> Any:
        from lightning_sharded.checkpoint.backends.dcp_writer import ChecksummingWriter

        return ChecksummingWriter(staging, **kwargs)

    def write_bytes(self, loc: Location, data: bytes) -> None:
        _path(loc).parent.mkdir(parents=True, exist_ok=True)
        with _naming(_path(loc)), open(loc, "wb") as f:
            f.write(data)

    def seal_own(
        self, staging: Location, rank: int, written: Mapping[str, tuple[int, str]]
    ) -> list[FileEntry]:
        # A rank other than 0 claims the shard files DCP names after it (``__<rank>_*``) and its per-rank
        # state and index files, on its own node; rank 0 takes everything else in :meth:`seal`.
        # With ``written`` (DCP's writer reports the files it wrote) those are this rank's files: no
        # listing of the staging directory, which holds N ranks' files (N ranks listing N files each
        # is a metadata storm); a file it did not report is claimed and checksummed by rank 0.
        if rank == 0:
            return []
        prefix = f"__{rank}_"
        mine = (names.rank_state_file(rank), names.rank_index_file(rank))
        listed = sorted(written) if written else _walk(_path(staging))
        own = [rel for rel in listed if ("/" not in rel and rel.startswith(prefix)) or rel in mine]
        return [_entry(_path(staging), rel, rank, written) for rel in own]

    def seal(
        self,
        staging: Location,
        entries: list[FileEntry],
        written: Mapping[str, tuple[int, str]],
        manifest: Manifest,
    ) -> Manifest:
        staging = _path(staging)
        claimed = {e.path: e for e in entries}
        for rel in _walk(staging):
            if rel not in claimed and rel != names.MANIFEST_NAME:
                claimed[rel] = _entry(staging, rel, 0, written)
        for dirpath, _, _ in os.walk(staging):
            fsync_dir(Path(dirpath))
        manifest = dataclasses.replace(manifest, files=sorted(claimed.values(), key=lambda e: e.path))
        fault(FaultPoint.BEFORE_MANIFEST, 0)
        # Inside the staging directory, written last: a directory with a valid manifest is complete.
        tmp = staging / f".{names.MANIFEST_NAME}.tmp"
        with _naming(tmp), open(tmp, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, staging / names.MANIFEST_NAME)
        fsync_dir(staging)
        return manifest

    def publish(
        self,
        staging: Location,
        target: Location,
        manifest: Manifest | None,
        previous: str | None,
        *,
        rank: int,
    ) -> None:
        staged, target = _path(staging), _path(target)
        parent = target.parent
        try:
            # Again, right before the swap: something else may have put a directory there meanwhile.
            _refuse_foreign_directory(target)
            if not os.path.lexists(target):
                os.rename(staged, target)
                fsync_dir(parent)
                return
            if _exchange(staged, target):
                old = staged  # after the swap, the staging name holds the previous version
            else:
                old = _sibling(target, names.OLD)
                os.rename(target, old)
                fault(FaultPoint.BETWEEN_RENAMES, rank)
                os.rename(staged, target)
        except BaseException:
            with contextlib.suppress(Exception):
                if os.path.lexists(staged):
                    _delete(staged)
            raise
        # Published: from here on a failure leaves leftovers for the next save, not a failed save.
        try:
            fsync_dir(parent)
            fault(FaultPoint.AFTER_PUBLISH, rank)
            trash = _sibling(target, names.TRASH)
            os.rename(old, trash)
            _delete(trash, rank=rank)
            fsync_dir(parent)
        except OSError as err:
            log.warning(
                "Checkpoint %s is published, but removing the previous version failed (%s); the next save"
                " of this path removes it",
                target,
                err,
            )

    def publish_file(self, staged: Path, target: Location) -> None:
        _fsync_file(staged)
        self.publish(staged, target, None, None, rank=0)

    def discard(self, staging: Location) -> None:
        _delete(_path(staging))

    def remove(self, target: Location) -> None:
        target = _path(target).absolute()
        olds = leftovers(target, names.OLD)
        if not os.path.lexists(target) and not olds:
            raise FileNotFoundError(f"There is no checkpoint to remove at {str(target)!r}.")
        for stale in olds:  # first: an interrupted removal never brings an older version back
            _discard(stale)
        if os.path.lexists(target):
            _discard(target)
        for stale in leftovers(target, names.STAGING) + leftovers(target, names.TRASH):
            _delete(stale)
        if target.parent.exists():
            fsync_dir(target.parent)
