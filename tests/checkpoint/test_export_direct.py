"""The safetensors export without torch (``export_direct``): the directory the torch path writes, byte for
byte, for every layout of chunks and dtype, one file or several, with a prefix; a cast and a frozen part
left to the torch path; each shard byte read once (only the model's without ``verify``) and checked
before anything is published."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharded import CheckpointError, consolidate_checkpoint
from lightning_sharded.checkpoint import checksum
from lightning_sharded.checkpoint.backends import local as local_backend
from lightning_sharded.checkpoint.detect import detect
from lightning_sharded.checkpoint.manifest import MANIFEST_NAME
from lightning_sharded.checkpoint.tools import export_direct, hf_export_torch
from tests.checkpoint.test_consolidate_direct import failing_third_piece, full_values, save, shard_reads
from tests.test_verify_errors import flip_bit

pytestmark = pytest.mark.usefixtures("process_group")  # ShardedTensor's chunks need a (one-rank) group


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file of an exported directory, its manifest as the files it lists (size and checksum)."""
    found = {p.name: p.read_bytes() for p in directory.iterdir() if p.name != MANIFEST_NAME}
    listed = json.loads((directory / MANIFEST_NAME).read_text())["files"]
    found[MANIFEST_NAME] = json.dumps(sorted(listed, key=lambda e: e["path"])).encode()
    return found


def export_both(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any
) -> tuple[Path, Path]:
    """``src`` exported without torch (checked: the torch path is not called), then through torch."""
    direct, through = tmp_path / "direct", tmp_path / "through-torch"
    with monkeypatch.context() as m:
        m.setattr(hf_export_torch, "prepare", lambda *a, **k: pytest.fail("the torch path was taken"))
        consolidate_checkpoint(src, direct, format="safetensors", progress=False, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(export_direct, "plan", lambda *a: "through torch, as the test asks")
        consolidate_checkpoint(src, through, format="safetensors", progress=False, **kwargs)
    return direct, through


def exported(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    values: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        values.update(load_file(file))
    return values


@pytest.mark.parametrize("max_shard_size", ["5GB", 200], ids=["one-file", "files"])
def test_the_export_is_the_torch_path_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_shard_size: int | str
) -> None:
    src = save(tmp_path / "ckpt", {"epoch": 0})
    read_back: list[str] = []  # the weights files the commit checksums by reading them back
    real = local_backend.file_checksum
    monkeypatch.setattr(
        local_backend, "file_checksum", lambda path, **k: read_back.append(Path(path).name) or real(path, **k)
    )
    direct, through = export_both(src, tmp_path, monkeypatch, max_shard_size=max_shard_size)
    assert files_of(direct) == files_of(through)
    weights = sorted(p.name for p in direct.glob("*.safetensors"))
    assert (len(weights) == 1) == (max_shard_size == "5GB"), weights
    # Only a file holding a chunk written in runs of rows (columns, blocks) is read back: the others'
    # checksums come from the copy's pieces.
    index = direct / "model.safetensors.index.json"
    where = json.loads(index.read_text())["weight_map"] if index.exists() else {}
    runs = {where.get(key, "model.safetensors") for key in ("cols", "grid", "cube")}
    assert sorted(n for n in read_back if n in weights) == sorted(runs), (read_back, runs)
    values = exported(direct)
    for key in ("rows", "cols", "grid", "cube"):  # every layout of chunks, placed
        assert torch.equal(values[key], full_values()[key]), key
    assert values["empty"].shape == (0, 4) and values["step"].item() == 7 and "exp_avg" not in values


def test_a_prefix_exports_its_keys_without_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = {
        "llm.embed": torch.randn(8, 4).bfloat16(),
        "llm.norm": torch.ones(4, dtype=torch.bfloat16),
        "llm.ids": torch.arange(3),
    }
    src = save(tmp_path / "ckpt", {"epoch": 0}, llm)
    direct, through = export_both(src, tmp_path, monkeypatch, prefix="llm.")
    assert files_of(direct) == files_of(through)
    values = exported(direct)
    assert sorted(values) == ["embed", "ids", "norm"] and torch.equal(values["embed"], llm["llm.embed"])
    # A dtype every floating tensor already has needs no cast: still done without torch, the same.
    for path in (direct, through):
        for p in path.iterdir():
            p.unlink()
        path.rmdir()
    direct, through = export_both(src, tmp_path, monkeypatch, prefix="llm.", dtype=torch.bfloat16)
    assert files_of(direct) == files_of(through)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"dtype": "bfloat16"}, "is cast from float32 to bfloat16"),
        ({"prefix": "nothing."}, "no model tensor"),
    ],
    ids=["cast", "no-tensor"],
)
def test_what_needs_torch_is_left_to_it(tmp_path: Path, kwargs: dict[str, Any], why: str) -> None:
    src = save(tmp_path / "ckpt", {"epoch": 0})
    reason = export_direct.plan(detect(src), kwargs.get("prefix", ""), kwargs.get("dtype"), 1 << 30)
    assert isinstance(reason, str) and why in reason, reason
    if "prefix" in kwargs:  # the torch path's error
        with pytest.raises(CheckpointError, match="has no model tensor whose key starts with the prefix"):
            consolidate_checkpoint(src, tmp_path / "out", format="safetensors", **kwargs)
        return
    values = exported(Path(consolidate_checkpoint(src, tmp_path / "out", format="safetensors", **kwargs)))
    assert values["rows"].dtype == torch.bfloat16 and torch.equal(
        values["rows"], full_values()["rows"].bfloat16()
    )


def test_each_shard_byte_is_read_once_and_only_the_model_s_without_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = {f"w{i}": torch.randn(256, 1024) for i in range(2)}  # 2 MiB: the optimizer's 2 MiB are not read
    src = save(tmp_path / "ckpt", {"epoch": 0}, {**big, "opt_pad": torch.zeros(1)})
    shards = sum(p.stat().st_size for p in src.glob("*.distcp"))
    monkeypatch.setattr(checksum, "_SPLIT_FROM", 1)  # every range in two parts, read at once
    read = shard_reads(monkeypatch)
    consolidate_checkpoint(src, tmp_path / "verified", format="safetensors", progress=False)
    assert sum(read) == shards
    read.clear()
    out = consolidate_checkpoint(src, tmp_path / "unverified", format="safetensors", verify=False)
    model = sum(v.numel() * v.element_size() for v in exported(Path(out)).values())
    assert model <= sum(read) < shards, (model, sum(read), shards)
    assert files_of(tmp_path / "verified") == files_of(Path(out))


@pytest.mark.parametrize("where", ["a copied chunk", "the optimizer's bytes"])
def test_a_damaged_shard_fails_before_publishing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    src = save(tmp_path / "ckpt", {"epoch": 0})
    plan = export_direct.plan(detect(src), "", None, 1 << 30)
    assert isinstance(plan, export_direct.DirectWeights), plan
    (rel, (path, _, segments)), *_ = plan.shards.items()
    if where == "a copied chunk":
        at = segments[0].start + 1
    else:  # inside the optimizer's first chunk of exp_avg: bytes the export checks but does not copy
        at = path.read_bytes().index(full_values()["exp_avg"][:6].numpy().tobytes()) + 1
        assert not any(s.start <= at < s.end for s in segments)
    flip_bit(path, at)
    dst = tmp_path / "out"
    with pytest.raises(
        CheckpointError, match=rf"{rel}.* is corrupted: its crc32 is .*Nothing was written at"
    ):
        consolidate_checkpoint(src, dst, format="safetensors", progress=False)
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    # Without verify, what is copied is copied as it is, as the torch path copies it.
    direct, through = export_both(src, tmp_path, monkeypatch, verify=False)
    assert files_of(direct) == files_of(through)
    assert torch.equal(exported(direct)["rows"], full_values()["rows"]) == (where != "a copied chunk")


def test_a_failed_write_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save(tmp_path / "ckpt", {"epoch": 0})
    dst = tmp_path / "out"
    consolidate_checkpoint(src, dst, format="safetensors", progress=False)
    before = files_of(dst)
    placed = failing_third_piece(monkeypatch)
    with pytest.raises(OSError, match=r"Input/output error"):
        consolidate_checkpoint(src, dst, format="safetensors", overwrite=True, progress=False)
    assert len(placed) >= 3, placed  # the copy had begun
    assert files_of(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]  # no staged leftover


def test_each_output_s_write_back_is_started_on_the_bytes_written_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export into several files starts each file's write-back on that file's own writes (a range of
    another file's would leave its pages dirty in the page cache, and start nothing useful)."""
    from lightning_sharded.checkpoint.tools import direct_copy
    from lightning_sharded.checkpoint.writeback import RangedWriteBehind

    written: list[tuple[int, int, int]] = []
    started: list[tuple[int, int, int]] = []
    real_write, real_wrote = direct_copy.pwrite_all, RangedWriteBehind.wrote

    def write(fd: int, data: Any, offset: int) -> None:
        written.append((fd, offset, len(data)))
        real_write(fd, data, offset)

    def wrote(self: RangedWriteBehind, start: int, nbytes: int) -> None:
        started.append((self._fd, start, nbytes))
        real_wrote(self, start, nbytes)

    monkeypatch.setattr(direct_copy, "pwrite_all", write)
    monkeypatch.setattr(RangedWriteBehind, "wrote", wrote)
    src = save(tmp_path / "ckpt", {"epoch": 0})
    out = tmp_path / "hf"
    consolidate_checkpoint(src, out, format="safetensors", progress=False, max_shard_size=200)
    assert len({fd for fd, _, _ in written}) == len(list(out.glob("*.safetensors"))) > 1
    assert sorted(started) == sorted(written)
