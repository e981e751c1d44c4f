"""Atomic checkpoints on object storage (S3 and other fsspec URLs), where there is no atomic rename.

A sharded checkpoint at ``URL`` is laid out as::

    URL/lightning_sharded.json        the manifest: the version published, every file, size and CRC-32
    URL/data-<token>/.metadata        the version it names: DCP index, shards and Lightning's meta.pt
    URL/data-<token>/__0_0.distcp
    URL/data-<token>/meta.pt

The manifest is the only object a save overwrites, in one ``PUT`` (atomic on S3: readers see the old
object or the new one, never a mix). So the protocol (:func:`commit_directory`, collective) is:

1. rank 0 reads the current manifest (the published version), deletes every other ``data-*``
   prefix (leftovers of crashed saves, or a previous version whose deletion was interrupted) and
   broadcasts a fresh ``URL/data-<token>``;
2. every rank writes its part there (DCP through ``FsspecWriter``), checksumming each file as its
   bytes go out; the checksums are gathered on rank 0, which checks every file is listed with that size;
3. rank 0 publishes: one ``PUT`` of the manifest naming ``data-<token>`` (``data_dir``). Only then
   does it delete the previous version's prefix (and the files of a stock checkpoint at ``URL``);
4. rank 0 broadcasts the outcome; every rank returns or raises the same error.

A load (:func:`locate`) reads the manifest first and only ever reads the version it names; a prefix
with data but no manifest is *not published* (a :class:`CheckpointError` says so). A crash of any
rank at any moment before the ``PUT`` leaves the previous manifest, hence the previous checkpoint;
after it, the new one. Assumes what S3 promises: single-object ``PUT`` is atomic, and reads after a
write see it (strong read-after-write consistency, S3 since 2020, and most S3-compatible stores).

A full checkpoint file at ``URL`` is one object, written locally then uploaded in one upload
(:func:`~lightning_sharded.checkpoint.storage.put_file`), which S3 also makes visible all at once.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from lightning_sharded.checkpoint import storage
from lightning_sharded.checkpoint.atomic import (
    FaultPoint,
    _all_gather,
    _broadcast,
    _describe,
    _dist,
    _fault,
    _token,
)
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest
from lightning_sharded.checkpoint.verify import Problem, checksum_problem

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "DATA_PREFIX",
    "OBJECT_STORE_FORMAT_VERSION",
    "Located",
    "ObjectKind",
    "ObjectStorePublisher",
    "commit_directory",
    "find_problems",
    "locate",
    "remove_checkpoint",
]

log = logging.getLogger(__name__)

#: Name prefix of the directory (key prefix) that holds one version of a sharded checkpoint.
DATA_PREFIX = "data-"
#: Manifest format version written on object storage (it adds ``data_dir``; older readers refuse it).
OBJECT_STORE_FORMAT_VERSION = 2
_DATA_RE = re.compile(rf"^{DATA_PREFIX}[0-9a-f]{{24}}$")
# The files a checkpoint written by stock Lightning (no manifest) keeps at the top of its directory.
_STOCK_FILE = re.compile(r"^(\.metadata|meta\.pt|__\d+_\d+\.distcp)$")
_DCP_METADATA = ".metadata"
_META = "meta.pt"


class ObjectKind(str, Enum):
    """What a URL holds."""

    SHARDED = "sharded"
    FULL = "full"


@dataclass(frozen=True)
class Located:
    """A checkpoint found at a URL by :func:`locate`.

    Attributes:
        url: The checkpoint URL as given.
        kind: Sharded directory or full file.
        data: Where its files are: the published ``data-<token>`` prefix, the URL itself for a stock
            sharded checkpoint or a full file.
        manifest: The manifest, ``None`` for a stock checkpoint or a full file.
    """

    url: str
    kind: ObjectKind
    data: str
    manifest: Manifest | None


def _read_manifest(url: str) -> Manifest | None:
    key = storage.join(url, MANIFEST_NAME)
    assert isinstance(key, str)
    try:
        text = storage.read_bytes(key)
    except FileNotFoundError:
        return None
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(
            f"The manifest {key!r} is not UTF-8 text. The checkpoint is damaged: restore it from a copy."
        ) from err
    return Manifest.from_json(decoded, source=key)


def _data_url(url: str, manifest: Manifest) -> str:
    data_dir = manifest.data_dir
    if not data_dir:  # a manifest of a local checkpoint copied to object storage: files next to it
        return url
    if "/" in data_dir or not _DATA_RE.match(data_dir):
        raise CheckpointError(
            f"The manifest of {url!r} names the data directory {data_dir!r}, which is not one this library"
            " writes. The manifest is damaged: restore the checkpoint from a copy."
        )
    data = storage.join(url, data_dir)
    assert isinstance(data, str)
    return data


def locate(url: str) -> Located:
    """Find the published checkpoint at ``url``; reads the manifest (or one listing), changes nothing.

    Raises:
        FileNotFoundError: nothing at ``url``.
        CheckpointError: ``url`` holds only the data of saves that never published (no manifest), or
            objects that are not a checkpoint.
    """
    url = url.rstrip("/")
    manifest = _read_manifest(url)
    if manifest is not None:
        return Located(url, ObjectKind.SHARDED, _data_url(url, manifest), manifest)
    if storage.is_file(url):
        return Located(url, ObjectKind.FULL, url, None)
    files = storage.list_files(url)
    dirs = storage.list_dirs(url)
    if _DCP_METADATA in files and _META in files:  # written by stock Lightning: no manifest, no versions
        return Located(url, ObjectKind.SHARDED, url, None)
    unpublished = [d for d in dirs if _DATA_RE.match(d)]
    if unpublished:
        raise CheckpointError(
            f"The checkpoint {url!r} is not published: it has no manifest {MANIFEST_NAME!r}, only the data"
            f" of {len(unpublished)} save(s) that did not finish ({', '.join(unpublished)}). Load an earlier"
            " checkpoint; the next save to this URL removes these leftovers."
        )
    if not files and not dirs:
        raise FileNotFoundError(
            f"There is no checkpoint at {url!r}: no object and no prefix by that name. Check the URL (a"
            " sharded checkpoint directory or a single checkpoint file) and the credentials/endpoint"
            " (AWS_* variables)."
        )
    listed = sorted(files) + [f"{d}/" for d in dirs]
    shown = ", ".join(listed[:5]) + (", ..." if len(listed) > 5 else "")
    raise CheckpointError(
        f"The prefix {url!r} is not a checkpoint: it has no manifest {MANIFEST_NAME!r} and no `.metadata`"
        f" with `meta.pt` (it holds {shown}). Point the path to a checkpoint directory or file."
    )


def manifest_for(data: str) -> Manifest | None:
    """The manifest that describes the checkpoint files under ``data`` (a URL), or ``None`` (stock).

    For a version ``URL/data-<token>`` it is ``URL``'s manifest, which must publish that version;
    otherwise a manifest next to the files (a local checkpoint copied to object storage).

    Raises:
        CheckpointError: ``data`` is a version that its checkpoint's manifest does not publish.
    """
    data = data.rstrip("/")
    parent, _, name = data.rpartition("/")
    if not _DATA_RE.match(name):
        return _read_manifest(data)
    manifest = _read_manifest(parent)
    if manifest is None or manifest.data_dir != name:
        raise CheckpointError(
            f"{data!r} is a version of the checkpoint {parent!r} that is not published (a save that did not"
            f" finish, or a previous version being deleted). Load {parent!r} itself."
        )
    return manifest


def find_problems(data: str, manifest: Manifest, *, checksums: bool) -> list[Problem]:
    """Every file of ``manifest`` missing under ``data``, of another size, or (``checksums``) other bytes."""
    present = storage.list_files(data)
    problems: list[Problem] = []
    for entry in manifest.files:
        found = present.get(entry.path) if "/" not in entry.path else _size_or_none(data, entry.path)
        if found is None:
            problems.append(Problem(entry.path, "is missing", entry.rank))
            continue
        if found != entry.size:
            how = "truncated" if found < entry.size else "longer than written"
            problems.append(
                Problem(entry.path, f"is {how}: {found} bytes, the manifest says {entry.size}", entry.rank)
            )
            continue
        if checksums:
            key = storage.join(data, entry.path)
            assert isinstance(key, str)
            problem = checksum_problem(entry, manifest, storage.url_checksum(key)[1])
            if problem is not None:
                problems.append(problem)
    return problems


def _size_or_none(base: str, rel: str) -> int | None:
    try:
        return storage.size(storage.join(base, rel))
    except FileNotFoundError:
        return None


# -------------------------------------------------------------------------------------- publish


class ObjectStorePublisher:
    """Publishing on object storage: versions under ``data-<token>``, the manifest ``PUT`` last.

    The object-store counterpart of :class:`~lightning_sharded.checkpoint.atomic.LocalPublisher`: same
    four steps, on URLs (strings) instead of paths, and a manifest ``PUT`` instead of a rename.
    """

    def prepare(self, url: str) -> str | None:
        """Delete every ``data-*`` prefix but the published one; returns the published one's name.

        Raises:
            CheckpointError: ``url`` is a full checkpoint file (one object): replacing it by a directory
                could not be atomic.
        """
        manifest = _read_manifest(url)
        current = manifest.data_dir if manifest is not None else None
        if manifest is None and storage.is_file(url):
            raise CheckpointError(
                f"{url!r} is a full checkpoint file (one object); saving a sharded checkpoint there would"
                " leave both until the file is deleted, which object storage cannot do atomically. Remove it"
                " first, or save to another URL."
            )
        for name in storage.list_dirs(url):
            if _DATA_RE.match(name) and name != current:
                log.info("Removing %s/%s left by an interrupted save", url, name)
                storage.remove_tree(storage.join(url, name))
        return current

    def stage(self, url: str) -> str:
        """A fresh ``URL/data-<token>`` name (object storage has no directories to create)."""
        staged = storage.join(url, f"{DATA_PREFIX}{_token()}")
        assert isinstance(staged, str)
        return staged

    def publish(self, manifest: Manifest, url: str, previous: str | None, *, rank: int = 0) -> None:
        """``PUT`` the manifest (the publish), then delete the previous version and any stock files."""
        key = storage.join(url, MANIFEST_NAME)
        assert isinstance(key, str)
        storage.write_bytes(key, manifest.to_json().encode("utf-8"))
        _fault(FaultPoint.AFTER_PUBLISH, rank)
        stale = [storage.join(url, previous)] if previous and previous != manifest.data_dir else []
        stale += [storage.join(url, name) for name in storage.list_files(url) if _STOCK_FILE.match(name)]
        try:
            for index, old in enumerate(stale):
                storage.remove_tree(old)
                if index == 0:
                    _fault(FaultPoint.DURING_REMOVE, rank)
        except Exception as err:  # the new version is published: what is left goes with the next save
            log.warning("Published %s, but could not delete the previous version (%s): %s", url, stale, err)

    def discard(self, staged: str) -> None:
        """Delete a staged version after a failed save."""
        storage.remove_tree(staged)


def commit_directory(
    url: str,
    write: Callable[[str], Mapping[str, tuple[int, str]]],
    *,
    metadata: Mapping[str, Any] | None = None,
    group: ProcessGroup | None = None,
) -> None:
    """Write a sharded checkpoint at ``url`` atomically (see the module docstring); collective.

    Args:
        url: The checkpoint URL; rank 0's is used.
        write: Called on every rank with the staging URL; writes this rank's files there and returns
            ``{file name: (size, crc32 hex)}`` for each of them (see
            :func:`~lightning_sharded.checkpoint.storage.dcp_writer`).
        metadata: Recorded in the manifest (rank 0's), e.g. ``{"epoch": 3, "global_step": 120}``.
        group: The process group of the ranks that write.

    Raises:
        CheckpointError: some rank failed to write, or rank 0 to publish; the previous checkpoint at
            ``url`` is unchanged and the staged data removed.
        BaseException: the exception ``write`` raised on this rank, after every rank has learned of it.
    """
    publisher = ObjectStorePublisher()
    rank, world_size, src = _dist(group)
    url = url.rstrip("/")
    started = time.perf_counter()

    prepared: tuple[str | None, str | None, str | None] = (None, None, None)
    if rank == 0:
        try:
            previous = publisher.prepare(url)
            prepared = (publisher.stage(url), previous, None)
        except Exception as err:
            prepared = (None, None, _describe(err))
    staged, previous, error = _broadcast(prepared, src, group, world_size)
    if staged is None:
        raise CheckpointError(
            f"Could not prepare the checkpoint {url!r} on rank 0: {error}. Check the URL, the credentials"
            " and that the bucket is writable; the previous checkpoint is unchanged."
        )

    written: dict[str, tuple[int, str]] = {}
    own_error: BaseException | None = None
    try:
        written = dict(write(staged))
        _fault(FaultPoint.AFTER_WRITE, rank)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        own_error = err
    reports = _all_gather((written, None if own_error is None else _describe(own_error)), group, world_size)
    failures = [(r, msg) for r, (_, msg) in enumerate(reports) if msg is not None]
    if failures:
        if rank == 0:
            with contextlib.suppress(Exception):
                publisher.discard(staged)
        if own_error is not None:
            raise own_error
        who = ", ".join(f"rank {r} ({msg})" for r, msg in failures)
        raise CheckpointError(
            f"Saving the checkpoint {url!r} failed on {who}. The partial save was removed and the previous"
            " checkpoint at that URL, if any, is unchanged."
        )

    _fault(FaultPoint.BEFORE_MANIFEST, rank)
    outcome: str | None = None
    if rank == 0:
        try:
            entries = _entries(staged, reports)
            manifest = Manifest(
                files=entries,
                world_size=world_size,
                metadata=dict(metadata or {}),
                format_version=OBJECT_STORE_FORMAT_VERSION,
                data_dir=storage.basename(staged),
            )
            _fault(FaultPoint.BEFORE_PUBLISH, rank)
            publisher.publish(manifest, url, previous, rank=rank)
            log.info(
                "Committed checkpoint %s (%s): %d files, %.1f MB, %d ranks in %.2fs",
                url,
                manifest.data_dir,
                len(entries),
                manifest.total_size / 1e6,
                world_size,
                time.perf_counter() - started,
            )
        except Exception as err:
            outcome = _describe(err)
            with contextlib.suppress(Exception):
                if outcome is not None and _read_manifest_dir(url) != storage.basename(staged):
                    publisher.discard(staged)
    else:
        _fault(FaultPoint.BEFORE_PUBLISH, rank)
    outcome = _broadcast(outcome, src, group, world_size)
    if outcome is not None:
        raise CheckpointError(
            f"Publishing the checkpoint {url!r} failed on rank 0: {outcome}. The previous checkpoint at that"
            " URL, if any, is unchanged; check the storage and save again."
        )


def _read_manifest_dir(url: str) -> str | None:
    manifest = _read_manifest(url)
    return manifest.data_dir if manifest is not None else None


def _entries(staged: str, reports: list[tuple[dict[str, tuple[int, str]], str | None]]) -> list[FileEntry]:
    """The manifest entries from every rank's checksums, each checked against the stored object's size."""
    present = storage.list_files(staged)
    entries: dict[str, FileEntry] = {}
    for rank, (written, _) in enumerate(reports):
        for name, (size, checksum) in written.items():
            if name in entries:
                raise CheckpointError(
                    f"{name!r} in {staged!r} was written by ranks {entries[name].rank}"
                    f" and {rank}; DCP names every rank's files apart."
                )
            if present.get(name) != size:
                raise CheckpointError(
                    f"{staged}/{name} (rank {rank}) has {present.get(name)} bytes in the store, {size} were"
                    " written. The store lost or cut the upload; save again."
                )
            entries[name] = FileEntry(name, size, checksum, rank)
    unclaimed = sorted(set(present) - set(entries))
    if unclaimed:
        raise CheckpointError(
            f"{staged!r} holds files no rank reported writing: {unclaimed}. Another process writes to this"
            " prefix; make sure only one job saves to a checkpoint URL at a time."
        )
    return sorted(entries.values(), key=lambda e: e.path)


def write_sharded_checkpoint(
    url: str,
    state: dict[str, Any],
    metadata: dict[str, Any],
    *,
    rank: int,
    manifest_metadata: Mapping[str, Any],
    run_dcp: Callable[[Callable[[], None], str], None],
    group: ProcessGroup | None = None,
) -> None:
    """DCP shards, index and Lightning's ``meta.pt`` at ``url``, published by :func:`commit_directory`.

    Collective. ``run_dcp(call, what)`` runs the DCP call and turns its errors into ``CheckpointError``.
    """
    import torch
    from torch.distributed.checkpoint.state_dict_saver import save

    def write(staging: str) -> dict[str, tuple[int, str]]:
        writer = storage.dcp_writer(staging)
        run_dcp(
            lambda: save(state, storage_writer=writer, process_group=group),
            f"Saving the sharded checkpoint to {url!r}",
        )
        checksums: dict[str, tuple[int, str]] = dict(writer.checksums)
        if rank == 0:
            buffer = io.BytesIO()
            torch.save(metadata, buffer)
            data = buffer.getvalue()
            meta = storage.join(staging, _META)
            assert isinstance(meta, str)
            storage.write_bytes(meta, data)
            checksums[_META] = (len(data), f"{zlib.crc32(data) & 0xFFFFFFFF:08x}")
        return checksums

    commit_directory(url, write, metadata=manifest_metadata, group=group)


def write_full_checkpoint(url: str, write: Callable[[Any], None]) -> None:
    """Write a full checkpoint file at ``url``: locally first, then one upload (one process).

    Raises:
        CheckpointError: ``url`` holds a sharded checkpoint (a manifest or stock files below it).
    """
    if _read_manifest(url) is not None or _DCP_METADATA in storage.list_files(url):
        raise CheckpointError(
            f"{url!r} holds a sharded checkpoint; saving a full checkpoint file there would leave both until"
            " the directory is deleted, which object storage cannot do atomically. Remove it first, or save"
            " to another URL."
        )
    storage.call_with_local_file(url, write)


def remove_checkpoint(url: str) -> None:
    """Remove the checkpoint at ``url`` (file, or directory with every version and leftover).

    The manifest goes first, so an interrupted removal leaves a prefix that loads report as not
    published rather than a half-deleted checkpoint that seems complete.

    Raises:
        FileNotFoundError: nothing at ``url``.
    """
    url = url.rstrip("/")
    if not storage.exists(url):
        raise FileNotFoundError(f"There is no checkpoint to remove at {url!r}.")
    if storage.is_file(url):
        storage.remove_tree(url)
        return
    storage.remove_tree(storage.join(url, MANIFEST_NAME))
    storage.remove_tree(url)


def check_files(located: Located, *, verify: bool) -> None:
    """Raise a :class:`CheckpointError` naming the first bad file of ``located`` (sizes; checksums too
    with ``verify``); a checkpoint without a manifest checks nothing here."""
    from lightning_sharded.checkpoint.verify import _raise

    if located.manifest is not None:
        _raise(located.data, find_problems(located.data, located.manifest, checksums=verify))
