"""``verify_checkpoint``: everything that can be checked of a checkpoint, in one process (what it checks
is in its docstring; the checks a load runs are in :mod:`~lightning_sharded.checkpoint.integrity`)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import zipfile
from dataclasses import dataclass, field

from lightning_sharded.checkpoint import hf_layout, names, unpickling
from lightning_sharded.checkpoint.backends import Backend, Location, basename, local_path, location
from lightning_sharded.checkpoint.checksum import CHUNK_SIZE
from lightning_sharded.checkpoint.dcp_index import index_problems, model_key, read_index, top_level_keys
from lightning_sharded.checkpoint.detect import CheckpointKind, Found, checkpoint_files, detect
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.integrity import find_problems
from lightning_sharded.checkpoint.pickles import check_pickles
from lightning_sharded.checkpoint.problems import Problem, damaged
from lightning_sharded.checkpoint.progress import format_size, progress_bar

log = logging.getLogger(__name__)

__all__ = ["VerifyReport", "verify_checkpoint"]


@dataclass
class VerifyReport:
    """What :func:`verify_checkpoint` checked.

    Attributes:
        path: The checkpoint read (the previous version, when an interrupted save left the path empty).
        kind: ``"sharded"``, ``"full"`` or ``"safetensors"`` (Hugging Face weights).
        files: Number of files of the checkpoint, the manifest included
            (:func:`~lightning_sharded.checkpoint.detect.checkpoint_files`, as ``inspect`` counts them).
        bytes: Their bytes.
        has_manifest: A directory with a manifest (sizes and checksums checked against it).
        notes: What could not be checked, in words.
    """

    path: Location
    kind: CheckpointKind
    files: int = 0
    bytes: int = 0
    has_manifest: bool = False
    notes: list[str] = field(default_factory=list)


def _full_file_problems(backend: Backend, file: Location, progress: bool | None) -> list[Problem]:
    """A ``torch.save`` zip archive: every record's CRC-32 (stored by torch.save) must match."""
    try:
        with backend.open_file(file) as f, zipfile.ZipFile(f) as archive:
            records = archive.infolist()
            total = sum(info.file_size for info in records)
            with progress_bar(total, progress, f"verifying {basename(file)}") as tick:
                for info in records:
                    try:
                        with archive.open(info) as record:  # checks the CRC-32 once read to the end
                            while chunk := record.read(CHUNK_SIZE):
                                tick(len(chunk))
                    except zipfile.BadZipFile:
                        what = f"record {info.filename!r} does not match the CRC-32 torch.save stored"
                        return [Problem(basename(file), f"is corrupted: {what}")]
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        what = f"({err}): it is truncated or corrupt, or was written by a torch older than 1.6"
        return [Problem(basename(file), f"is not a complete torch.save archive {what}")]
    return []


def _raise(path: Location, problems: list[Problem]) -> None:
    error = damaged(path, problems)
    if error is not None:
        raise error


def verify_checkpoint(
    path: str | os.PathLike[str], *, progress: bool | None = None, weights_only: bool | None = True
) -> VerifyReport:
    """Check every file of a checkpoint, checksums included; works in one plain process.

    - a sharded directory with a manifest: every listed file present, with its size and checksum;
    - a sharded directory without one (stock Lightning): nothing to compare checksums with, so it
      checks that ``.metadata`` reads and that every file it references is there and long enough
      (the report's ``notes`` say so);
    - a full file: the CRC-32 of every record of the ``torch.save`` archive;
    - Hugging Face weights (a ``.safetensors`` file or directory): every header reads and every file is
      as long as its header says; with a manifest (``consolidate --format safetensors``), every listed
      file's size and checksum too;
    - then, without unpickling anything, every pickle (the full file; ``.metadata``, ``meta.pt`` and
      DCP's non-tensor entries): a type that a safe load would refuse fails the check, or, with
      ``weights_only=False``, is named in the report's ``notes``.

    Args:
        path: A sharded checkpoint directory, a full checkpoint file, or Hugging Face weights.
        progress: Show a progress bar on stderr while reading; ``None`` shows one for checkpoints of
            64 MiB or more.
        weights_only: ``True`` (or ``None``): a checkpoint that ``load_checkpoint`` would refuse
            fails; ``False`` (for a file you trust): it passes, with a note. Nothing is unpickled either way.

    Returns:
        What was checked: ``files`` and ``bytes`` count the checkpoint's files as ``inspect`` does.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: the path is not a checkpoint, or a file is missing, truncated or corrupted;
            the message names the first bad file, the rank that wrote it, and the others. With
            ``weights_only``, also a pickle that holds a type that is not allowed (the message names it).
    """
    started = time.perf_counter()
    found = detect(path, safetensors=True)
    report = VerifyReport(found.data, found.kind)
    if found.kind is CheckpointKind.FULL:
        _raise(found.data, _full_file_problems(found.backend, found.data, progress))
    elif found.kind is CheckpointKind.SAFETENSORS:
        _verify_weights(found, report, progress)
    elif found.manifest is None:
        _verify_index(found, report)
    else:
        _verify_manifest(found, report, progress)
    files = checkpoint_files(found)
    report.files, report.bytes = len(files), sum(files.values())
    if found.kind is not CheckpointKind.SAFETENSORS:  # safetensors holds no pickle
        report.notes += check_pickles(found.backend, found.data, found.kind, weights_only)
    if found.kind is CheckpointKind.SHARDED:  # the model state under a model key, as loads need it; an
        # index read safely, so one holding a refused type (noted by the pickle check) is not checked
        with contextlib.suppress(unpickling.RefusedPickleError):
            tops = top_level_keys(read_index(found.backend, found.data, weights_only=True, standins=True))
            model_key(tops, found.data)
    log.info(
        "Verified %s (%s, %d files, %s) in %.2fs",
        found.data,
        found.kind.value,
        report.files,
        format_size(report.bytes),
        time.perf_counter() - started,
    )
    return report


def _verify_weights(found: Found, report: VerifyReport, progress: bool | None) -> None:
    """Hugging Face weights: every header reads, every file as long as its header says; with a manifest
    (our export) the checksums too."""
    header_problems = hf_layout.list_weights(found.backend, found.data).problems
    if found.manifest is not None:
        _verify_manifest(found, report, progress, header_problems)
        return
    _raise(found.data, header_problems)
    report.notes.append(
        "no manifest (weights not written by lightning_sharded): there are no checksums to compare with;"
        " checked that every safetensors header reads and that every file is as long as its header says"
    )


def _verify_index(found: Found, report: VerifyReport) -> None:
    """A sharded directory without a manifest: the shard files against its ``.metadata``."""
    backend, real = found.backend, found.data
    try:  # read safely, flag or not: verify never unpickles
        problems = index_problems(backend, real, read_index(backend, real, weights_only=True, standins=True))
    except unpickling.RefusedPickleError:
        problems = []  # the pickle check refuses it, or notes it with the flag
        report.notes.append(
            "the shard files were not checked against `.metadata`: reading it would run code from it"
        )
    except CheckpointError as err:
        detail = repr(err.__cause__) if err.__cause__ is not None else str(err)
        problems = [Problem(names.DCP_METADATA, f"cannot be read ({detail})")]
    _raise(real, problems)
    report.notes.append(
        "no manifest (a checkpoint written without lightning_sharded): there are no checksums to compare"
        " with; checked that `.metadata` reads and that every shard file it references is present and"
        " long enough"
    )


def _verify_manifest(
    found: Found, report: VerifyReport, progress: bool | None, header_problems: list[Problem] | None = None
) -> None:
    """Every file the manifest lists: present, with its size and checksum (and the weights' headers)."""
    manifest = found.manifest
    assert manifest is not None
    with progress_bar(manifest.total_size, progress, f"verifying {basename(found.data)}") as tick:
        problems = find_problems(found.backend, found.data, manifest, checksums=True, on_bytes=tick)
    if found.kind is CheckpointKind.SHARDED and names.DCP_METADATA not in {e.path for e in manifest.files}:
        problems.append(Problem(names.DCP_METADATA, "is not listed in the manifest"))
    seen = {p.path for p in problems}
    _raise(found.data, problems + [p for p in header_problems or [] if p.path not in seen])
    report.has_manifest = True
    if manifest.frozen is not None:
        source = manifest.frozen.source
        on_disk = local_path(location(source))  # a URL is not looked up offline
        gone = ", which does not exist" if on_disk is not None and not os.path.exists(on_disk) else ""
        report.notes.append(
            f"trainable only: {len(manifest.frozen.keys)} frozen parameter(s) are not in this checkpoint;"
            f" a load reads them from {source}{gone} (not checked here)"
        )
