"""One bit flipped in the data region of any file of a checkpoint, the last in manifest order included,
is a checksum mismatch of that file for every checking reader: ``verify_checkpoint``,
``load_checkpoint(verify=True)``, a restore with ``verify=True`` or ``verify="during"``, and the
safetensors export (which checks every checksum before it reads).

The flip lands mid-file (for a shard file: inside a tensor's bytes), where no reader's own parsing
notices it first: only the checksum can. Two checkpoints: one of this library's one-process save
(with the per-rank index) and the 2-rank DCP save of ``conftest.sharded_ckpt`` (rank 1's shard file).
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sharded import CheckpointError, consolidate_checkpoint, load_checkpoint, verify_checkpoint
from lightning_sharded.checkpoint import load, read_manifest
from tests.checkpoint.one_process import save_sharded

#: The files of :func:`_one_rank`'s checkpoint, in manifest order (the test below holds the order).
ONE_RANK = [".metadata", "__0_0.distcp", "index/layout.json", "index/rank-00000.json", "meta.pt"]
#: The files of the 2-rank checkpoint (``fault_driver.py``), in manifest order.
TWO_RANKS = [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model whose weight fills most of its shard file, and Adam stepped once."""
    model = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded checkpoint of this library's save, in one process."""
    torch.manual_seed(0)
    model, optimizer = _model()
    path = tmp_path_factory.mktemp("bit-flips") / "ckpt"
    return save_sharded(path, model, optimizer, model_key="model", global_step=2)


def _restore(path: Path, verify: Any) -> None:
    """A restore of ``path`` into a fresh model of its kind (a checksum error is what is expected)."""
    if "__1_0.distcp" in {p.name for p in path.iterdir()}:  # fault_driver's layout: ``layer``, Adam
        model: nn.Module = nn.Module()
        model.layer = nn.Linear(6, 8)
    else:
        torch.manual_seed(1)
        model, _ = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load.restore_checkpoint(path, model, [optimizer], verify=verify, weights_only=False)


def _damaged(source: Path, tmp_path: Path, name: str) -> Path:
    """A copy of ``source`` with one bit flipped in the middle of ``name``."""
    path = tmp_path / "ckpt"
    shutil.copytree(source, path)
    file = path / name
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x04
    file.write_bytes(bytes(data))
    return path


def test_the_files_are_those_listed_in_manifest_order(one_rank: Path, sharded_ckpt: Path) -> None:
    manifest = read_manifest(one_rank)
    assert manifest is not None and [e.path for e in manifest.files] == ONE_RANK
    manifest = read_manifest(sharded_ckpt)
    assert manifest is not None and [e.path for e in manifest.files] == TWO_RANKS


READERS = {
    "verify_checkpoint": lambda path: verify_checkpoint(path),
    # the checksum pass before the first read (no reads that record checksums: the export's own)
    "consolidate(format='safetensors')": lambda path: consolidate_checkpoint(
        path, path.parent / "hf", format="safetensors", progress=False
    ),
    "load_checkpoint(verify=True)": lambda path: load_checkpoint(path, verify=True, weights_only=False),
    "restore(verify=True)": lambda path: _restore(path, True),
    "restore(verify='during')": lambda path: _restore(path, "during"),
}


def _assert_mismatch_of(path: Path, name: str, rank: int) -> None:
    pattern = (
        rf"'{re.escape(name)}' \(written by rank {rank}\) is corrupted:"
        r" its crc32 is [0-9a-f]{8}, the manifest says"
    )
    for reader, read in READERS.items():
        with pytest.raises(CheckpointError) as raised:
            read(path)
        assert re.search(pattern, str(raised.value)), (reader, str(raised.value))


@pytest.mark.parametrize("name", ONE_RANK)
def test_a_flipped_bit_in_any_file_is_its_checksum_mismatch(
    one_rank: Path, tmp_path: Path, name: str
) -> None:
    _assert_mismatch_of(_damaged(one_rank, tmp_path, name), name, 0)


@pytest.mark.parametrize("name", TWO_RANKS)
def test_a_flipped_bit_in_any_file_of_two_ranks_is_its_checksum_mismatch(
    sharded_ckpt: Path, tmp_path: Path, name: str
) -> None:
    source = tmp_path / "intact"
    sharded_ckpt.rename(source)
    _assert_mismatch_of(_damaged(source, tmp_path, name), name, 1 if name.startswith("__1_") else 0)


@pytest.mark.parametrize("verify", [True, "during"])
def test_a_file_of_another_size_and_a_flipped_bit_elsewhere_are_both_named(
    one_rank: Path, tmp_path: Path, verify: Any
) -> None:
    # The size check before the first read fails on meta.pt; the checksums are then computed too, so the
    # error also names the shard file whose size is right and whose bytes are not.
    path = _damaged(one_rank, tmp_path, "__0_0.distcp")
    with (path / "meta.pt").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError) as raised:
        _restore(path, verify)
    message = str(raised.value)
    assert "'meta.pt'" in message and "'__0_0.distcp'" in message, message
    assert re.search(r"'__0_0.distcp' \(written by rank 0\) is corrupted", message), message
