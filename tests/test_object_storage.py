"""Checkpoints on object storage, against a real S3 API (the moto server on loopback).

One server for the module. One batch of 2-rank Lightning jobs (fits with saves to ``s3://``, and
resumes from there) runs once for the whole module; the tests then check what it wrote, crash saves
over it, damage copies of it, and read it with the tools. The ranks reach the server through the
``AWS_*`` environment of :class:`tests.s3_server.S3Server`.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharded import CheckpointError, consolidate_checkpoint, load_checkpoint, verify_checkpoint
from lightning_sharded.checkpoint import MANIFEST_NAME
from lightning_sharded.checkpoint.backends import backend_for
from lightning_sharded.checkpoint.detect import detect
from lightning_sharded.checkpoint.load import restore_checkpoint
from tests._compare import assert_restored, model_keys, optimizer_keys, run_cli
from tests.distributed.launch import SCENARIO, Batch, Results, run_ranks
from tests.fault_injection import FAULT_ENV
from tests.s3_server import S3Server

FSDP = ("--strategy", "fsdp", "--sharded-tensor")
MP = ("--strategy", "mp", "--sharded-tensor")
SINGLE = ("--strategy", "single", "--sharded-tensor")
STRATEGIES = {"fsdp": FSDP, "mp": MP}
KINDS = ("sharded", "full")


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


@pytest.fixture(scope="module")
def fs(s3: S3Server) -> Any:
    import s3fs

    return s3fs.S3FileSystem()


@pytest.fixture(scope="module")
def fitted(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Results:
    """Fits at 2 ranks saving to S3 (both strategies, sharded and full), then resumes from there."""
    batch = Batch(tmp_path_factory.mktemp("fits"), env=s3.env)
    for name, flags in STRATEGIES.items():
        for kind in KINDS:
            url = s3.url(f"fits/{name}-{kind}")
            extra = ("--top-k", s3.url("topk")) if (name, kind) == ("fsdp", "sharded") else ()
            batch.add(f"{name}-{kind}", 2, "fit", *flags, "--ckpt", url, "--state-dict-type", kind, *extra)
            batch.add(f"{name}-{kind}/resume", 2, "resume", *flags, "--ckpt", url)
    batch.add("kill/old", 2, "fit", *MP, "--ckpt", s3.url("kill/ckpt"))
    batch.run()
    return Results(batch.outs)


def names(fs: Any, url: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[1] for p in fs.ls(url))


def copy(fs: Any, src: str, dst: str) -> None:
    fs.invalidate_cache()
    fs.copy(src, dst, recursive=True)
    fs.invalidate_cache()


# ---------------------------------------------------------------------------------- save, resume


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("kind", KINDS)
def test_save_to_s3_and_resume_from_it_at_two_ranks(
    fitted: Results, fs: Any, s3: S3Server, strategy: str, kind: str
) -> None:
    assert_restored(fitted[f"{strategy}-{kind}"], fitted[f"{strategy}-{kind}/resume"])
    url = s3.url(f"fits/{strategy}-{kind}")
    if kind == "full":
        assert fs.isfile(url), "a full checkpoint is one object"
        return
    listed = names(fs, url)
    assert len(listed) == 2 and listed[1] == MANIFEST_NAME and listed[0].startswith("data-"), listed
    manifest = json.loads(fs.cat_file(f"{url}/{MANIFEST_NAME}"))
    assert manifest["data_dir"] == listed[0] and manifest["world_size"] == 2
    version = f"/{listed[0]}/"
    stored = {p.split(version, 1)[1]: fs.info(p)["size"] for p in fs.find(f"{url}/{listed[0]}")}
    assert {e["path"]: e["size"] for e in manifest["files"]} == stored
    rank_files = {"rank_state/rank-00000.pt", "rank_state/rank-00001.pt"}  # the per-rank state
    assert {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp", *rank_files} <= set(stored)


def test_model_checkpoint_save_top_k_on_s3(fitted: Results, fs: Any, s3: S3Server) -> None:
    """``ModelCheckpoint(dirpath="s3://...", save_top_k=2)``: saves every step, removes all but two."""
    fitted["fsdp-sharded"]
    kept = names(fs, s3.url("topk"))
    assert len(kept) == 2, kept
    for name in kept:
        url = s3.url(f"topk/{name}")
        assert names(fs, url)[1] == MANIFEST_NAME
        step = int(name.split("step=")[1].split(".")[0])
        assert load_checkpoint(url)["global_step"] == step


# ------------------------------------------------------------------------------------- crashes


def test_a_rank_killed_before_the_publish_leaves_the_previous_checkpoint(
    fitted: Results, fs: Any, s3: S3Server, tmp_path: Path
) -> None:
    """SIGKILL rank 1 once its part of the new version is written, before the manifest PUT: the old
    checkpoint still resumes with the old values; the next save publishes and removes the leftovers."""
    url = s3.url("kill/ckpt")
    old = fitted["kill/old"]
    published = names(fs, url)
    with pytest.raises(AssertionError) as failed:
        run_ranks(
            SCENARIO,
            2,
            "fit",
            *MP,
            "--ckpt",
            url,
            "--steps",
            "5",
            "--out",
            str(tmp_path / "crash.pt"),
            timeout=90,
            env={**s3.env, FAULT_ENV: "after_write@1"},
        )
    assert "rank 1 (exit -9)" in str(failed.value), str(failed.value)[-2000:]
    after = names(fs, url)
    leftovers = sorted(set(after) - set(published))
    assert len(leftovers) == 1 and leftovers[0].startswith("data-"), after
    assert detect(url).data == f"{url}/{next(n for n in published if n.startswith('data-'))}"
    loaded = load_checkpoint(url)["state_dict"]
    for key in [k for k in old if k.startswith("model.")]:
        assert torch.equal(loaded[key[len("model.") :]], old[key]), key

    # The leftover alone is no checkpoint: loads say it was not published, naming the URL.
    orphan = s3.url("kill/orphan")
    copy(fs, f"{url}/{leftovers[0]}", f"{orphan}/{leftovers[0]}")
    with pytest.raises(CheckpointError, match=rf"'{orphan}' is not published: it has no manifest"):
        load_checkpoint(orphan)
    with pytest.raises(CheckpointError, match="is not published"):
        load_checkpoint(f"{url}/{leftovers[0]}")  # pointing at the unpublished version itself

    batch = Batch(tmp_path, env=s3.env)
    batch.add("resume", 2, "resume", *MP, "--ckpt", url)
    batch.add("new", 2, "fit", *MP, "--ckpt", url, "--steps", "4")
    batch.run()
    results = Results(batch.outs)
    assert_restored(old, results["resume"])
    final = names(fs, url)
    assert len(final) == 2 and final[1] == MANIFEST_NAME and final[0] not in after, final
    assert load_checkpoint(url)["global_step"] == results["new"]["global_step"] == 4


POINTS = {"after_write": 1, "before_publish": 1, "after_publish": 2, "during_remove": 2}
DRIVER = Path(__file__).parent / "distributed" / "s3_fault_driver.py"


def drive(s3: S3Server, tmp_path: Path, phase: str) -> dict[str, list[int]]:
    out = tmp_path / f"{phase}.json"
    subprocess.run(
        [sys.executable, str(DRIVER), phase, s3.url("points"), str(out), *POINTS],
        env={**os.environ, **s3.env},
        check=True,
        timeout=120,
    )
    result: dict[str, list[int]] = json.loads(out.read_text())
    return result


def test_single_process_saves_killed_at_each_point(s3: S3Server, fs: Any, tmp_path: Path) -> None:
    """A save killed before the manifest PUT leaves version 1; after it, version 2; never a mix; the
    next save leaves one version."""
    crashed = drive(s3, tmp_path, "crash")
    assert crashed == {point: [0, -signal.SIGKILL] for point in POINTS}
    for point, survivor in POINTS.items():
        loaded = load_checkpoint(s3.url(f"points/{point}"), verify=True)
        assert loaded["global_step"] == survivor, point
        assert torch.equal(loaded["state_dict"]["w"], torch.full((4,), float(survivor))), point
    assert drive(s3, tmp_path, "save") == {point: [0] for point in POINTS}
    for point in POINTS:
        url = s3.url(f"points/{point}")
        published = detect(url).data.rsplit("/", 1)[1]
        assert [n for n in names(fs, url) if n.startswith("data-")] == [published], point
        assert load_checkpoint(url)["global_step"] == 3


class _Unpicklable:
    """A value whose pickling fails with a known error (``meta.pt`` of a failed write)."""

    def __reduce__(self) -> Any:
        raise pickle.PicklingError("_Unpicklable refuses to be pickled")


def test_a_failed_write_changes_nothing(s3: S3Server, fs: Any) -> None:
    from lightning_sharded.checkpoint import save as io

    url = s3.url("failed/ckpt")
    io.write_sharded_checkpoint(url, {"model": {"w": torch.ones(3)}}, {"global_step": 1}, rank=0)
    before = names(fs, url)
    # the write's own error reaches the caller as it is (not wrapped, not another type)
    with pytest.raises(pickle.PicklingError, match=r"^_Unpicklable refuses to be pickled$"):
        io.write_sharded_checkpoint(url, {"model": {"w": torch.ones(3)}}, {"bad": _Unpicklable()}, rank=0)
    assert names(fs, url) == before
    assert load_checkpoint(url)["global_step"] == 1


# ------------------------------------------------------------------------------ tools and CLI


def test_verify_catches_a_corrupted_object(
    fitted: Results, fs: Any, s3: S3Server, capsys: pytest.CaptureFixture[str]
) -> None:
    src, url = s3.url("fits/mp-sharded"), s3.url("damaged/mp")
    fitted["mp-sharded"]
    copy(fs, src, url)
    code, out, _ = run_cli(capsys, "verify", url)
    assert code == 0 and out.startswith(f"OK: {url}/data-") and "(sharded, 10 files," in out, out
    version = detect(url).data
    shard = f"{version}/__1_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    code, out, err = run_cli(capsys, "verify", url)
    assert code == 1 and out == ""
    assert f"The checkpoint '{version}' is damaged: '__1_0.distcp' (written by rank 1) is corrupted" in err
    with pytest.raises(CheckpointError, match=r"'__1_0.distcp' \(written by rank 1\) is corrupted"):
        load_checkpoint(url, verify=True)
    # verify="during" needs a reader that records checksums: on object storage it checks before reading.
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"'__1_0.distcp' \(written by rank 1\) is corrupted"):
        restore_checkpoint(url, model, strict=False, verify="during")
    assert torch.equal(model.weight, before)
    fs.rm(shard)
    with pytest.raises(CheckpointError, match=r"'__1_0.distcp' \(written by rank 1\) is missing"):
        verify_checkpoint(url)


def test_inspect_an_s3_checkpoint(fitted: Results, s3: S3Server, capsys: pytest.CaptureFixture[str]) -> None:
    url = s3.url("fits/fsdp-sharded")
    code, out, _ = run_cli(capsys, "inspect", url)
    assert code == 0
    assert out.splitlines()[0].split() == ["key", "shape", "dtype", "size", "shards", "value"]
    assert "kind:        sharded (manifest)" in out and "world size:  2" in out
    assert f"global step: {fitted['fsdp-sharded']['global_step']}" in out
    assert f"path:        {url}/data-" in out
    code, out, _ = run_cli(capsys, "inspect", url, "--json")
    data = json.loads(out)
    assert data["world_size"] == 2 and data["has_manifest"] and data["files"] == 10
    assert data["rank_state_ranks"] == 2  # rank_state/rank-0000{0,1}.pt, nested under the version
    assert any(e["key"].startswith("model.layer1") and e["shards"] == 2 for e in data["entries"])
    code, out, _ = run_cli(capsys, "inspect", s3.url("fits/fsdp-full"))
    assert code == 0 and "kind:        full" in out
    data_dir = data["path"]  # the published version, under the checkpoint
    manifest_size = backend_for(url).size(f"{url}/{MANIFEST_NAME}")  # beside the version, counted too
    assert data["disk_size"] == sum(e.size for e in detect(url).manifest.files) + manifest_size
    for part, what in (
        (f"{data_dir}/__1_0.distcp", "the shard file of rank 1"),
        (f"{url}/{MANIFEST_NAME}", "its manifest"),
    ):
        with pytest.raises(CheckpointError) as err:
            detect(part)
        assert str(err.value).startswith(
            f"The file {part!r} is one part of the sharded checkpoint {url!r} ({what}"
        )


def test_consolidate_from_s3_then_a_stock_single_device_resume(
    fitted: Results, s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, local = s3.url("fits/fsdp-sharded"), tmp_path / "full.ckpt"
    code, out, _ = run_cli(capsys, "consolidate", url, str(local))
    assert code == 0 and out.startswith(f"Wrote {local}")
    full = torch.load(local, weights_only=True)
    for key, value in load_checkpoint(url)["state_dict"].items():
        assert torch.equal(full["state_dict"][key], value), key
    # Back to S3 as one object, too.
    assert consolidate_checkpoint(url, s3.url("consolidated/full.ckpt")) == s3.url("consolidated/full.ckpt")
    verify_checkpoint(s3.url("consolidated/full.ckpt"))

    batch = Batch(tmp_path, env=s3.env)
    batch.add("single", 1, "resume", *SINGLE, "--ckpt", str(local))
    batch.run()
    saved = fitted["fsdp-sharded"]
    keys = [k for k in model_keys(saved) + optimizer_keys(saved) if k != "opt0.lr"]  # not gathered at 1
    assert_restored(saved, Results(batch.outs)["single"], keys)


def test_errors_name_the_url(s3: S3Server, fs: Any, capsys: pytest.CaptureFixture[str]) -> None:
    missing = s3.url("nothing/here")
    with pytest.raises(FileNotFoundError, match=f"There is no checkpoint at '{missing}'"):
        load_checkpoint(missing)
    code, _, err = run_cli(capsys, "inspect", missing)
    assert code == 1 and missing in err
    foreign = s3.url("foreign")
    fs.pipe_file(f"{foreign}/notes.txt", b"hello")
    with pytest.raises(CheckpointError, match=f"The prefix '{foreign}' is not a checkpoint.*notes.txt"):
        verify_checkpoint(foreign)


def test_mixin_load_from_checkpoint_reads_an_s3_directory(s3: S3Server, tmp_path: Path) -> None:
    import lightning as L

    from lightning_sharded.checkpoint import save as io
    from tests.distributed.tiny_models import TinyShardedModel

    model = TinyShardedModel(hidden=6)
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model)
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()
    url = s3.url("mixin/ckpt")
    io.save_checkpoint(url, checkpoint, sharded=True, model_key="model", rank=0)
    loaded = TinyShardedModel.load_from_checkpoint(url)
    assert loaded.hparams["hidden"] == 6
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    with pytest.raises(FileNotFoundError, match="mixin/nothing"):
        TinyShardedModel.load_from_checkpoint(s3.url("mixin/nothing"))


def test_verify_names_a_missing_or_cut_file_in_a_folder_of_the_version(
    fitted: Results, fs: Any, s3: S3Server
) -> None:
    # Files in the version's folders (the per-rank state, the per-rank index) are checked from one
    # listing of each folder: one cut or removed is named as the shards are.
    src, url = s3.url("fits/mp-sharded"), s3.url("damaged/nested")
    fitted["mp-sharded"]
    copy(fs, src, url)
    version = detect(url).data
    state = f"{version}/rank_state/rank-00001.pt"
    fs.pipe_file(state, bytes(fs.cat_file(state))[:-1])
    fs.invalidate_cache()
    cut = r"'rank_state/rank-00001.pt' \(written by rank 1\) is truncated"
    with pytest.raises(CheckpointError, match=cut):
        verify_checkpoint(url)
    fs.rm(f"{version}/index/rank-00000.json")
    fs.invalidate_cache()
    with pytest.raises(CheckpointError, match=r"'index/rank-00000.json' \(written by rank 0\) is missing"):
        verify_checkpoint(url)
