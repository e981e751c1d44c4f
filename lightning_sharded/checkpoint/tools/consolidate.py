"""``consolidate_checkpoint``: a sharded checkpoint into one full file, in one process, memory bounded.

A Lightning checkpoint is written by :mod:`.consolidate_direct` where that can be done without torch
(each shard file read once, in order; no torch imported), else by :mod:`.consolidate_mapped` (torch);
``format="safetensors"`` by :mod:`.hf_export`. The output is the same.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from lightning_sharded.checkpoint.backends import Location, basename
from lightning_sharded.checkpoint.commit import commit_file
from lightning_sharded.checkpoint.destination import output_file, write_error
from lightning_sharded.checkpoint.detect import CheckpointKind, detect
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.integrity import prepare_read
from lightning_sharded.checkpoint.progress import format_size

if TYPE_CHECKING:
    import torch

__all__ = ["FORMATS", "consolidate_checkpoint"]

log = logging.getLogger(__name__)

#: The output formats of :func:`consolidate_checkpoint`.
FORMATS = ("lightning", "safetensors")


def consolidate_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str = "lightning",
    dtype: torch.dtype | str | None = None,
    prefix: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    progress: bool | None = None,
    weights_only: bool | None = True,
    max_shard_size: int | str = "5GB",
    config: str | os.PathLike[str] | None = None,
) -> Location:
    """Convert a sharded checkpoint directory into one full checkpoint file, or a checkpoint's weights
    into a Hugging Face safetensors directory; in one process.

    The output is what stock Lightning writes for a single device: plain :func:`torch.load` reads it,
    ``Trainer.fit(ckpt_path=dst)`` resumes from it (optimizer state in ``optimizer_states``) and
    ``LightningModule.load_from_checkpoint(dst)`` loads it, without this library.

    Nothing is destroyed: the destination is checked first
    (:mod:`~lightning_sharded.checkpoint.destination`), and with ``verify`` a damaged source fails,
    naming the file, before anything is published. With ``format="safetensors"`` the source may be any
    checkpoint and ``dst`` is a local directory in Hugging Face's layout, which ``transformers``'
    ``from_pretrained(dst)`` loads (``docs/huggingface.md``). The sharded checkpoints Lightning and this
    library write (local files, objects torch's safe load builds without their classes' code; for
    ``"safetensors"``, no cast asked for) are done without importing torch: each shard file read once,
    in order, each chunk's bytes written straight to their place, memory bounded by two 8 MiB blocks
    per reading thread. Any other goes through torch, memory bounded by two buffers of the largest
    tensor (or 32 MiB; one 16 MiB batch for ``"safetensors"``); ``-v`` (the ``INFO`` log) says why.
    Both write the same bytes, published atomically (``docs/cli.md``).

    Args:
        src: A sharded checkpoint directory.
        dst: The output file, or a directory to write it into (with a trailing ``/``: then the file
            takes the source's name), or an fsspec URL (``s3://...``: written locally first, then
            uploaded as one object).
        format: ``"lightning"``, a full Lightning checkpoint file, or ``"safetensors"``, a Hugging Face
            weights directory.
        dtype: ``"safetensors"`` only: cast floating tensors to it (``torch.bfloat16`` or
            ``"bfloat16"``, ``"float16"``, ``"float32"``); ``None`` keeps every dtype.
        prefix: ``"safetensors"`` only: export the keys that start with it, without it (``"llm."``
            for a LightningModule that holds the Hugging Face model as ``self.llm``).
        overwrite: Replace a file, an empty directory or a sharded checkpoint at the output.
        verify: Compare every source file's checksum with the manifest (computed from the reads)
            before the output is published.
        progress: Show a progress bar on stderr; ``None`` shows one for checkpoints of 64 MiB or more.
        weights_only: ``True`` (or ``None``): the source's pickles are read safely, as in
            ``load_checkpoint``; ``False`` unpickles anything, running the file's code.
        max_shard_size: ``"safetensors"`` only: the largest file, ``"5GB"`` (10**9 bytes per GB, as
            Hugging Face counts), ``"500MB"``, ``"2GiB"`` or a number of bytes; a larger tensor gets a
            file of its own.
        config: ``"safetensors"`` only: a ``config.json`` to copy beside the weights.

    Returns:
        The path of the output file (the output directory for ``"safetensors"``).

    Raises:
        FileNotFoundError: nothing at ``src``.
        CheckpointError: ``src`` is not a sharded checkpoint, or is damaged (names the file), or (with
            ``weights_only``) holds a type that is not allowed.
        ValueError: an unknown ``format``, a ``dtype`` or ``prefix`` with ``"lightning"``, an unknown
            ``dtype`` or ``max_shard_size``, a URL ``dst`` for ``"safetensors"``, or ``dst`` is the source.
        FileExistsError: something is at the output and ``overwrite`` is ``False``.
        IsADirectoryError: the output is a directory that is not a checkpoint.
        OSError: the output cannot be written (its message names it); nothing was written.
    """
    if format not in FORMATS:
        raise ValueError(f"Unknown format {format!r} for consolidate_checkpoint: use one of {list(FORMATS)}.")
    if format == "safetensors":
        from lightning_sharded.checkpoint.tools.hf_export import export_safetensors

        return export_safetensors(
            src,
            dst,
            dtype=dtype,
            prefix=prefix,
            max_shard_size=max_shard_size,
            config=config,
            overwrite=overwrite,
            verify=verify,
            progress=progress,
            weights_only=weights_only,
        )
    if dtype is not None or prefix is not None or config is not None:
        raise ValueError(
            "consolidate_checkpoint(format='lightning') writes a Lightning checkpoint as it is: every key, in"
            " its own dtype. Leave dtype, prefix and config at None (they are for format='safetensors')."
        )
    return _to_lightning_file(
        src, dst, overwrite=overwrite, verify=verify, progress=progress, weights_only=weights_only
    )


def _to_lightning_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    overwrite: bool,
    verify: bool,
    progress: bool | None,
    weights_only: bool | None,
) -> Location:
    """``format="lightning"``: the sharded checkpoint at ``src`` as one full file, without torch where
    :func:`.consolidate_direct.plan` finds a plan, else through torch."""
    from lightning_sharded.checkpoint.tools import consolidate_direct

    started = time.perf_counter()
    found = detect(src)
    if found.kind is CheckpointKind.FULL:
        raise CheckpointError(
            f"{str(src)!r} is already a full checkpoint file: there is nothing to consolidate. Copy it"
            " instead."
        )
    out = output_file(src, found.data, dst, overwrite=overwrite)
    plan = consolidate_direct.plan(found, out)
    if isinstance(plan, str):
        log.info("%s is consolidated through torch: %s", found.data, plan)
        from lightning_sharded.checkpoint.tools import consolidate_mapped

        tensors = consolidate_mapped.consolidate(
            found, out, verify=verify, progress=progress, weights_only=weights_only
        )
    else:
        then = f"Nothing was written at {str(out)!r}."
        verification = prepare_read(found, verify, weights_only, then=then)
        desc = f"consolidating {basename(found.data)}"
        try:
            commit_file(out, lambda tmp: plan.write(tmp, verification, progress, desc))
        except OSError as err:
            raise write_error(out, err) from err
        tensors = plan.tensors_bytes
    log.info(
        "Consolidated %s into %s (%s of tensors) in %.2fs",
        found.data,
        out,
        format_size(tensors),
        time.perf_counter() - started,
    )
    return out
