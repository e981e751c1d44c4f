"""The safetensors export through torch: any checkpoint torch reads (a full file, a trainable-only one,
objects only torch reads, a ``dtype`` cast), its tensors read a batch at a time, cast and appended, so
memory holds one batch. :mod:`.hf_export` takes this path where :mod:`.export_direct` declines.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_sharded.checkpoint.checksum import HashingStream
from lightning_sharded.checkpoint.detect import CheckpointKind, Found
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.load.checks import frozen_of
from lightning_sharded.checkpoint.progress import progress_bar
from lightning_sharded.checkpoint.tools.frozen import FROZEN_SLOT, frozen_listing, read_frozen
from lightning_sharded.checkpoint.tools.reader import open_sharded
from lightning_sharded.checkpoint.tools.safetensors_format import (
    FLOATING,
    ST_DTYPES,
    Entry,
    dtype_name,
    encode_header,
    file_name,
    plan_files,
    storage_order,
)
from lightning_sharded.checkpoint.tools.weight_sources import full_weights
from lightning_sharded.checkpoint.writeback import WriteBehind

__all__ = ["BATCH_BYTES", "TorchWeights", "prepare"]

log = logging.getLogger(__name__)

#: Tensors are read from the source in batches of about this many bytes (a larger tensor alone).
BATCH_BYTES = 16 << 20


@dataclass(frozen=True)
class _Tensor:
    """One model tensor of the source: its key there, its key in the output, shape and dtype."""

    source_key: str
    out_key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _source(
    found: Found, verify: bool, weights_only: bool | None, prefix: str
) -> tuple[list[_Tensor], Callable[[dict[str, torch.Tensor]], None]]:
    """The model tensors of a checkpoint whose keys start with ``prefix``, and a way to read some of them
    into given buffers (by source key); a trainable-only checkpoint's frozen ones read from its source."""
    if found.kind is CheckpointKind.SHARDED:
        reader = open_sharded(found, verify, weights_only)  # the verify-first rule: damage fails here
        tensors = [
            _Tensor(key, name[len(prefix) :], tuple(md.size), md.properties.dtype)
            for key, name, md in reader.model_tensors()
            if name.startswith(prefix)
        ]
        model_key = reader.model_key()
        skipped = [k for k in reader.objects if reader.path_of(k)[0] == model_key]
        if skipped:
            log.info("Not exported (not tensors): %s", ", ".join(sorted(skipped)))
        frozen = found.manifest.frozen if found.manifest is not None else None

        def read(targets: dict[str, torch.Tensor]) -> None:
            reader.read_tensors(targets, None)

    else:
        checkpoint, state = full_weights(found.backend, found.data, weights_only)
        tensors = [
            _Tensor(key, key[len(prefix) :], tuple(value.shape), value.dtype)
            for key, value in state.items()
            if isinstance(value, torch.Tensor) and key.startswith(prefix)
        ]
        frozen = frozen_of(checkpoint, str(found.data))

        def read(targets: dict[str, torch.Tensor]) -> None:
            for key, target in targets.items():
                target.copy_(state[key])

    if frozen is None:
        return tensors, read
    listing = frozen_listing(frozen, str(found.data), weights_only, "export from a copy that has it")
    extra = {
        FROZEN_SLOT + key: _Tensor(
            FROZEN_SLOT + key,
            key[len(prefix) :],
            listing.shapes[key[len(frozen.prefix) :]],
            listing.dtypes[key[len(frozen.prefix) :]],
        )
        for key in frozen.keys
        if key.startswith(prefix)
    }
    log.info(
        "%s holds the trainable weights only: its frozen part is read from %s", found.data, frozen.source
    )

    def read_all(targets: dict[str, torch.Tensor]) -> None:
        mine = {k[len(FROZEN_SLOT) :]: v for k, v in targets.items() if k in extra}
        if mine:
            read_frozen(frozen, listing, mine, weights_only)
        rest = {k: v for k, v in targets.items() if k not in extra}
        if rest:
            read(rest)

    return [*tensors, *extra.values()], read_all


@dataclass
class TorchWeights:
    """The weights of any checkpoint torch reads (the export's fallback): each output file's entries, read
    a batch at a time, cast with torch."""

    files: list[list[Entry]]
    sources: dict[str, _Tensor]
    read: Callable[[dict[str, torch.Tensor]], None]

    def write(
        self, staging: Path, progress: bool | None, desc: str
    ) -> tuple[dict[str, tuple[int, str]], dict[str, str]]:
        """Every weights file in ``staging``; each one's size and checksum, and each key's file."""
        total = sum(e.nbytes for group in self.files for e in group)
        with progress_bar(total, progress, desc) as tick:
            return _write_weights(staging, self.files, self.sources, self.read, tick)


def prepare(
    src: str | os.PathLike[str],
    found: Found,
    *,
    verify: bool,
    weights_only: bool | None,
    prefix: str,
    target: str | None,
    max_bytes: int,
) -> TorchWeights:
    """The export of ``found`` through torch: the source checked (every checksum first, with ``verify``)
    and its model tensors listed; a ``CheckpointError`` for a checkpoint with none to export."""
    model, read = _source(found, verify, weights_only, prefix)
    entries = _entries(src, model, prefix, target)
    return TorchWeights(plan_files(entries, max_bytes), {t.out_key: t for t in model}, read)


def _entries(
    src: str | os.PathLike[str], model: list[_Tensor], prefix: str, target_dtype: str | None
) -> list[Entry]:
    """The output's tensors (floating ones cast to ``target_dtype``), each of a dtype safetensors stores."""
    if not model:
        raise CheckpointError(
            f"The checkpoint {str(src)!r} has no model tensor whose key starts with the prefix {prefix!r}:"
            " nothing to export. Check the prefix (`lightning-sharded inspect` lists the keys)."
        )
    for t in model:
        if dtype_name(t.dtype) not in ST_DTYPES:
            raise CheckpointError(
                f"The tensor {t.source_key!r} of {str(src)!r} is {t.dtype}, which safetensors cannot store."
            )
    names = [dtype_name(t.dtype) for t in model]
    return [
        Entry(t.out_key, t.shape, target_dtype if target_dtype and name in FLOATING else name)
        for t, name in zip(model, names, strict=True)
    ]


def _write_weights(
    staging: Path,
    files: list[list[Entry]],
    sources: dict[str, _Tensor],
    read: Callable[[dict[str, torch.Tensor]], None],
    tick: Callable[[int], None],
) -> tuple[dict[str, tuple[int, str]], dict[str, str]]:
    """Each file's header, then its tensors, read a batch at a time, cast and appended; returns each file's
    size and checksum, and each key's file."""
    written: dict[str, tuple[int, str]] = {}
    weight_map: dict[str, str] = {}
    for index, group in enumerate(files, start=1):
        name = file_name(index, len(files))
        ordered = storage_order(group)
        with open(staging / name, "xb") as raw:
            # A save's write-behind: written plainly, each new page of the file is fresh memory, which this
            # project's VMs hand out at 0.2-0.5 GB/s once a process has taken a few GB (the probes' "plain
            # write" row); behind, the file keeps about WINDOW bytes in the page cache, reused.
            behind = WriteBehind(raw.fileno())
            with HashingStream(raw, write_behind=behind) as f:  # closed: no thread left
                f.write(encode_header(ordered))
                for batch in plan_files(ordered, BATCH_BYTES):  # a batch in memory at a time
                    buffers = {
                        sources[e.key].source_key: torch.empty(e.shape, dtype=sources[e.key].dtype)
                        for e in batch
                    }
                    read(buffers)
                    for e in batch:
                        value = (
                            buffers.pop(sources[e.key].source_key).to(getattr(torch, e.dtype)).contiguous()
                        )
                        if value.numel():  # no copy: the tensor's own bytes
                            f.write(value.reshape(-1).view(torch.uint8).numpy())
                        tick(e.nbytes)
                        del value
                written[name] = f.result()
            raw.flush()
            behind.finish()
        weight_map.update(dict.fromkeys((e.key for e in group), name))
    return written, weight_map
