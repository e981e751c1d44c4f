"""``consolidate_checkpoint(format="safetensors")``: a checkpoint's weights as a Hugging Face directory.

A sharded checkpoint Lightning or this library wrote is exported by :mod:`.export_direct` where nothing
needs torch (no cast; each shard file read once, in order, no torch imported), any other by
:mod:`.hf_export_torch`. Both write each file's header first (every shape and dtype is known from the
source's index), then its tensors; the directory is published atomically, with the index and the
config beside the weights. The rules are in ``docs/huggingface.md``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_sharded.checkpoint import names
from lightning_sharded.checkpoint.backends import Location, basename, local_path, location
from lightning_sharded.checkpoint.checksum import bytes_checksum
from lightning_sharded.checkpoint.commit import commit_directory
from lightning_sharded.checkpoint.destination import output_file
from lightning_sharded.checkpoint.detect import detect
from lightning_sharded.checkpoint.integrity import prepare_read
from lightning_sharded.checkpoint.progress import format_size
from lightning_sharded.checkpoint.tools import export_direct
from lightning_sharded.checkpoint.tools.safetensors_format import CONFIG_NAME, parse_dtype, parse_size

if TYPE_CHECKING:
    import torch

    from lightning_sharded.checkpoint.tools import hf_export_torch

__all__ = ["export_safetensors"]

log = logging.getLogger(__name__)


def export_safetensors(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None,
    prefix: str | None,
    max_shard_size: int | str,
    config: str | os.PathLike[str] | None,
    overwrite: bool,
    verify: bool,
    progress: bool | None,
    weights_only: bool | None,
) -> Location:
    """The ``format="safetensors"`` of :func:`~.consolidate.consolidate_checkpoint`; see there."""
    started = time.perf_counter()
    target = parse_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    prefix = prefix or ""
    if local_path(location(dst)) is None:  # safetensors files are written as local files
        raise ValueError(
            f"consolidate_checkpoint(format='safetensors') writes a local directory, not {os.fspath(dst)!r}:"
            " export to a local path, then upload the directory."
        )
    config_bytes = _read_config(config)
    found = detect(src)
    out = local_path(output_file(src, found.data, dst, overwrite=overwrite))
    assert out is not None
    weights: export_direct.DirectWeights | hf_export_torch.TorchWeights
    direct = export_direct.plan(found, prefix, target, max_bytes)
    if isinstance(direct, str):
        log.info("%s is exported through torch: %s", found.data, direct)
        from lightning_sharded.checkpoint.tools import hf_export_torch

        weights = hf_export_torch.prepare(
            src,
            found,
            verify=verify,
            weights_only=weights_only,
            prefix=prefix,
            target=target,
            max_bytes=max_bytes,
        )
    else:
        if direct.skipped:
            log.info("Not exported (not tensors): %s", ", ".join(direct.skipped))
        then = f"Nothing was written at {str(out)!r}."
        direct.verification = prepare_read(found, verify, weights_only, then=then)
        weights = direct
    files = weights.files
    total = sum(e.nbytes for group in files for e in group)

    def write(staging: Path) -> dict[str, tuple[int, str]]:
        written, weight_map = weights.write(staging, progress, f"exporting {basename(found.data)}")
        extra: dict[str, bytes] = {}
        if len(files) > 1:
            index_doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            extra[names.SAFETENSORS_INDEX] = (json.dumps(index_doc, indent=2) + "\n").encode()
        if config_bytes is not None:
            extra[CONFIG_NAME] = config_bytes
        for name, data in extra.items():
            with open(staging / name, "xb") as raw:
                raw.write(data)
            written[name] = bytes_checksum(data)
        return written

    tensors = sum(len(group) for group in files)
    metadata = {"format": "safetensors", "source": str(found.data), "tensors": tensors}
    commit_directory(out, write, metadata=metadata, alone=True)
    log.info(
        "Exported %d tensors (%s) of %s into %s, %d file(s), in %.2fs",
        tensors,
        format_size(total),
        found.data,
        out,
        len(files),
        time.perf_counter() - started,
    )
    return out


def _read_config(config: str | os.PathLike[str] | None) -> bytes | None:
    if config is None:
        return None
    path = Path(config)
    try:
        data = path.read_bytes()
        if not isinstance(json.loads(data), dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"There is no config file at {str(path)!r} to copy beside the weights."
        ) from None
    except ValueError as err:
        raise ValueError(
            f"The config {str(path)!r} is not a JSON object ({err}): pass the config.json of the model"
            " (`model.config.save_pretrained(DIR)` writes one)."
        ) from None
    return data
