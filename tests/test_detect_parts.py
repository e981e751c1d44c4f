"""What the detector says of a path that is no checkpoint of its own: one file of a checkpoint directory
(named with the directory to pass instead, by every tool and load alike), and Hugging Face weights
(named as such; ``inspect`` lists them from their headers, ``verify`` checks headers and sizes)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_sharded import (
    CheckpointError,
    consolidate_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    verify_checkpoint,
)
from lightning_sharded.checkpoint.detect import CheckpointKind, checkpoint_files, detect
from lightning_sharded.checkpoint.manifest import MANIFEST_NAME
from lightning_sharded.cli import main
from tests.distributed.tiny_models import TinyShardedModel

#: Every entry point that reads a checkpoint, as a user calls it.
READERS: dict[str, Callable[[str], Any]] = {
    "detect": detect,
    "inspect_checkpoint": inspect_checkpoint,
    "verify_checkpoint": verify_checkpoint,
    "load_checkpoint": load_checkpoint,
    "consolidate_checkpoint": lambda path: consolidate_checkpoint(path, "out.ckpt"),
    "load_from_checkpoint": TinyShardedModel.load_from_checkpoint,
}

PARTS = {
    "ckpt/__0_0.distcp": "the shard file of rank 0",
    "ckpt/__1_0.distcp": "the shard file of rank 1",
    "ckpt/.metadata": "its index",
    "ckpt/meta.pt": "its Lightning metadata",
    f"ckpt/{MANIFEST_NAME}": "its manifest",
    "ckpt/rank_state/rank-00001.pt": "the per-rank state of rank 1",
    "ckpt/rank_state": "its folder of per-rank state files",
    "ckpt/index/rank-00001.json": "the per-rank index of rank 1",
    "ckpt/index/layout.json": "its index layout",
    "ckpt/index": "its per-rank index folder",
}


@pytest.fixture
def here(sharded_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory, holding ``ckpt`` (2 ranks, with a ``rank_state`` and an ``index`` folder)."""
    (sharded_ckpt / "rank_state").mkdir()
    shutil.copy(sharded_ckpt / "meta.pt", sharded_ckpt / "rank_state" / "rank-00001.pt")
    (sharded_ckpt / "index").mkdir()  # the per-rank index's files, as this library's saves write them
    (sharded_ckpt / "index" / "layout.json").write_text("{}")
    (sharded_ckpt / "index" / "rank-00001.json").write_text("{}")
    monkeypatch.chdir(sharded_ckpt.parent)
    return sharded_ckpt.parent


@pytest.mark.parametrize("part", sorted(PARTS))
def test_a_part_of_a_checkpoint_names_its_directory_everywhere(
    here: Path, part: str, capsys: pytest.CaptureFixture[str]
) -> None:
    noun = "directory" if part.endswith(("rank_state", "index")) else "file"
    expected = f"The {noun} {part!r} is one part of the sharded checkpoint 'ckpt' ({PARTS[part]}"
    messages = set()
    for name, read in READERS.items():
        with pytest.raises(CheckpointError) as err:
            read(part)
        message = str(err.value)
        assert message.startswith(expected), (name, message)
        assert "pass the directory 'ckpt' instead" in message, (name, message)
        messages.add(message)
    for command in (["inspect", part], ["verify", part], ["consolidate", part, "out.ckpt"]):
        assert main(command) == 1
        err_text = capsys.readouterr().err
        messages.add(err_text.split(": error: ", 1)[1].strip())
    assert len(messages) == 1, messages  # the same words from every tool
    assert not (here / "out.ckpt").exists()


def test_a_lone_meta_pt_is_read_as_the_file_it_is(here: Path) -> None:
    (here / "copy").mkdir()
    shutil.copy(here / "ckpt" / "meta.pt", here / "copy" / "meta.pt")
    assert detect("copy/meta.pt").kind is CheckpointKind.FULL


def test_the_manifest_counts_as_a_file(here: Path) -> None:
    files = checkpoint_files(detect("ckpt"))
    assert MANIFEST_NAME in files and files[MANIFEST_NAME] == (here / "ckpt" / MANIFEST_NAME).stat().st_size


def _headers(directory: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor's dtype and shape, as the safetensors package reads them."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                piece = f.get_slice(key)
                dtype = {"F32": torch.float32, "BF16": torch.bfloat16}[piece.get_dtype()]
                out[key] = (str(dtype), list(piece.get_shape()))
    return out


def test_an_export_is_weights_for_inspect_and_verify_and_refused_as_a_checkpoint(here: Path) -> None:
    export = consolidate_checkpoint("ckpt", "hf", format="safetensors", dtype="bfloat16")
    assert detect("hf", safetensors=True).kind is CheckpointKind.SAFETENSORS
    for name, read in READERS.items():
        if name in ("inspect_checkpoint", "verify_checkpoint"):
            continue  # they describe weights (below)
        with pytest.raises(CheckpointError) as err:
            read("hf")
        assert str(err.value).startswith("The directory 'hf' is a Hugging Face weights directory"), name
        assert "lightning_sharded.load_pretrained(module, 'hf')" in str(err.value), name
    info = inspect_checkpoint("hf")
    assert info.kind == "safetensors" and info.has_manifest
    assert {e.key: (e.dtype, e.shape) for e in info.entries} == _headers(export)
    report = verify_checkpoint("hf")
    assert report.kind is CheckpointKind.SAFETENSORS and report.has_manifest and report.notes == []
    on_disk = sorted(p for p in export.iterdir())
    assert (report.files, report.bytes) == (len(on_disk), sum(p.stat().st_size for p in on_disk))
    assert (info.files, info.disk_size) == (report.files, report.bytes)
    weights = export / "model.safetensors"
    with open(weights, "r+b") as f:  # one bit of the data: only the manifest's checksum sees it
        f.seek(weights.stat().st_size - 1)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CheckpointError, match=r"'model.safetensors' \(written by rank 0\) is corrupted"):
        verify_checkpoint("hf")


def test_hugging_face_weights_without_a_manifest(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = here / "pretrained"
    hf.mkdir()
    save_file(
        {"a.weight": torch.ones(4, 2), "a.bias": torch.zeros(4)}, str(hf / "model-00001-of-00002.safetensors")
    )
    save_file({"b.weight": torch.ones(3, dtype=torch.bfloat16)}, str(hf / "model-00002-of-00002.safetensors"))
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    weight_map = {"a.weight": first, "a.bias": first, "b.weight": second}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (hf / "config.json").write_text("{}")
    info = inspect_checkpoint("pretrained")
    assert info.kind == "safetensors" and not info.has_manifest
    assert {e.key: (e.dtype, e.shape, e.size) for e in info.entries} == {
        "a.bias": ("torch.float32", [4], 16),
        "a.weight": ("torch.float32", [4, 2], 32),
        "b.weight": ("torch.bfloat16", [3], 6),
    }
    report = verify_checkpoint("pretrained")
    assert report.files == 3 and not report.has_manifest  # the two weights files and the index
    assert "no checksums to compare with" in report.notes[0]
    assert main(["verify", "pretrained"]) == 0
    assert "(safetensors, 3 files, " in capsys.readouterr().out
    with pytest.raises(
        CheckpointError, match=r"Hugging Face weights directory \(model.safetensors.index.json\)"
    ):
        load_checkpoint("pretrained")
    single = verify_checkpoint("pretrained/model-00002-of-00002.safetensors")
    assert single.kind is CheckpointKind.SAFETENSORS and single.files == 1
    with pytest.raises(CheckpointError, match="is a safetensors file, not a Lightning checkpoint"):
        load_checkpoint("pretrained/model-00002-of-00002.safetensors")

    data = (hf / second).read_bytes()
    (hf / second).write_bytes(data[:-2])
    for check in (verify_checkpoint, inspect_checkpoint):
        with pytest.raises(CheckpointError, match=r"'model-00002-of-00002.safetensors' is truncated: "):
            check("pretrained")
    (hf / second).unlink()
    with pytest.raises(CheckpointError, match=r"'model-00002-of-00002.safetensors' is missing \(the index"):
        verify_checkpoint("pretrained")
