"""A sharded load's checksums computed from the bytes it reads, not from a second read.

Checksumming every file before the first read (``check_found(verify=True)``) reads each byte twice,
once for its checksum, once into the model. Where the backend's DCP reader records what it reads
(local files: the :class:`~lightning_sharded.checkpoint.backends.dcp_reader.DirectReader`), the CRC-32
of each range it reads straight into a tensor is computed as the bytes arrive, still in the CPU's
cache. After the read (:meth:`ReadVerification.check`, collective), each file's checksum is completed
by the rank that read most of it, which reads only the bytes no range covered (zip headers, small
entries read through torch's path, other ranks' parts), and compared with the manifest; files that no
rank read this way (``.metadata``, ``meta.pt``) are split across the ranks by size and read whole.
Every rank raises the same error or none. On object storage, both modes check before the first read
instead.

``verify=True`` (``"before"``) reads the model's values into CPU buffers beside the model
(``restore_sharded(keep_model=True)``) and copies them in after :meth:`ReadVerification.check`, so a
damaged checkpoint leaves the model as it was. The single-process tools (``consolidate_checkpoint``,
``load_checkpoint``) check this way with ``alone=True``: they publish or return nothing before
:meth:`ReadVerification.check` passed.

What ``"during"`` gives up for not keeping that copy: presence and sizes are still checked before the
first read, but a file whose bytes differ is found once its bytes are in the model's tensors, before
the optimizers and the rest of the model's state are set; the error says so. A read that fails (a
pickle that does not unpickle) is explained the same way: every file is then checksummed, and a
damaged one is named.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from lightning_sharded.checkpoint import collective
from lightning_sharded.checkpoint.backends import join
from lightning_sharded.checkpoint.backends.dcp_reader import ReadChecksums
from lightning_sharded.checkpoint.checksum import ranges_checksum
from lightning_sharded.checkpoint.detect import Found
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.manifest import FileEntry
from lightning_sharded.checkpoint.problems import Problem
from lightning_sharded.checkpoint.verify import (
    check_found,
    checksum_problem,
    raise_agreed,
    size_problem,
    split_by_size,
)

__all__ = ["AFTER_READ", "UNCHANGED", "VERIFY_MODES", "ReadVerification", "VerifyMode", "verify_mode"]

#: How a load checks checksums, besides ``False`` (not at all) and ``True`` (``"before"``).
VerifyMode = Literal["before", "during"]
VERIFY_MODES: tuple[VerifyMode, ...] = ("before", "during")


def verify_mode(verify: bool | str) -> VerifyMode | None:
    """The mode a ``verify=`` argument asks for: ``None`` (no checksums), ``"before"`` or ``"during"``.

    Raises:
        ValueError: anything else, with the values accepted.
    """
    if isinstance(verify, bool):
        return "before" if verify else None
    if verify == "before":
        return "before"
    if verify == "during":
        return "during"
    raise ValueError(
        f"verify={verify!r} is not a way to check a checkpoint: pass False, True (or 'before': nothing is"
        " loaded from a damaged checkpoint) or 'during' (the load's reads go straight into the model)."
    )


#: What a checksum error found after a ``"during"`` read adds to its message.
AFTER_READ = (
    "The load had already read the model's tensors from it (the optimizers were not set): build the"
    " model again, or restart, before you load another checkpoint."
)
#: What it adds after a ``"before"`` (``True``) read, whose values wait beside the model until checked.
UNCHANGED = "Nothing was loaded from it: the model and the optimizers are as they were."


class ReadVerification:
    """The checksums of one sharded load, from what its reads saw (see the module doc).

    Args:
        found: The sharded checkpoint, with its manifest, on a backend whose reader records checksums.
        alone: Check in this process only, whatever process group is up (the single-process tools);
            otherwise :meth:`check` and :meth:`reading` are collective over the default group.
        then: What a checksum error found after the read adds to its message (what the reader holds).
    """

    def __init__(self, found: Found, *, alone: bool = False, then: str = AFTER_READ) -> None:
        if not self.applies(found):
            raise ValueError("a ReadVerification needs a manifest and a backend that reads checksums")
        self.found = found
        self.alone = alone
        self.then = then
        #: Given to the DCP reader: the ranges it read and their CRC-32.
        self.checksums = ReadChecksums()

    @staticmethod
    def applies(found: Found) -> bool:
        """Whether ``found`` can be verified from its reads (a manifest, and a reader that records)."""
        return found.manifest is not None and found.backend.reads_checksums

    def check_sizes(self, weights_only: bool | None = False) -> None:
        """Before the first read: every file present with its size (collective, unless ``alone``). If one
        is not, every file's checksum is computed too, so the error names every damaged file, as a check
        before the read would.

        Raises:
            CheckpointError: a file is missing or has another size (the same error on every rank).
        """
        try:
            check_found(self.found, verify=False, alone=self.alone, weights_only=weights_only)
        except CheckpointError:
            check_found(self.found, verify=True, alone=self.alone, weights_only=weights_only)
            raise

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around a read that every rank fails alike (a collective read): a ``CheckpointError`` raised in
        it is replaced by the damage the files' checksums show, if any (collective, then)."""
        try:
            yield
        except CheckpointError as err:
            try:
                check_found(self.found, verify=True, alone=self.alone)
            except CheckpointError as damage:
                raise damage from err
            raise

    def check(self) -> None:
        """Compare every file's checksum with the manifest, after the read. Collective.

        Raises:
            CheckpointError: a file's bytes differ from what was written (the same error on every rank).
        """
        found, manifest = self.found, self.found.manifest
        assert manifest is not None
        where = collective.ranks(alone=self.alone)
        covered = collective.all_gather(self.checksums.covered(), where)
        owners: dict[str, int] = {}
        for entry in manifest.files:
            counts = [read.get(entry.path, 0) for read in covered]
            if max(counts):
                owners[entry.path] = counts.index(max(counts))  # the rank that read most of it (lowest)
        unread = split_by_size([e for e in manifest.files if e.path not in owners], where.world_size)
        mine = [e for e in manifest.files if owners.get(e.path) == where.rank] + unread[where.rank]
        try:
            problems = [p for entry in mine if (p := self._problem(entry)) is not None]
            report: tuple[list[Problem], str | None] = (problems, None)
        except OSError as err:
            report = ([], f"Could not read {str(found.data)!r} to check its checksums: {err!r}")
        raise_agreed(report, where, found.data, manifest, self.then)

    def _problem(self, entry: FileEntry) -> Problem | None:
        manifest = self.found.manifest
        assert manifest is not None
        path = Path(join(self.found.data, entry.path))
        size, checksum = ranges_checksum(path, entry.size, self.checksums.ranges.get(entry.path, []))
        return size_problem(entry, size) or checksum_problem(entry, manifest, checksum)
