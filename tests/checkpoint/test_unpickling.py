"""Opening a checkpoint never runs its code: every tool refuses hostile pickles, and every checkpoint
that this library and stock Lightning write (hyperparameters, callbacks, LR schedulers) opens without
the flag.

Hostile checkpoints hold a :class:`tests.hostile.Marker`, whose unpickling creates a marker file: a
full file (in its hyperparameters), and sharded directories with a hostile ``meta.pt`` (manifest
entry rewritten to match), a hostile non-tensor item inside a ``.distcp`` file, a hostile
``.metadata``. Each is also opened once with ``weights_only=False``, which does create the marker:
the fixtures really are hostile.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict

from lightning_sharded import (
    CheckpointError,
    ShardedStateMixin,
    consolidate_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    verify_checkpoint,
)
from lightning_sharded.checkpoint import unpickling
from lightning_sharded.checkpoint.checksum import file_checksum
from lightning_sharded.checkpoint.commit import commit_directory
from lightning_sharded.checkpoint.names import LIGHTNING_METADATA, MANIFEST_NAME
from lightning_sharded.checkpoint.unpickling import without_torch
from tests._compare import assert_identical, run_cli
from tests.distributed.launch import run_ranks
from tests.distributed.lightning_pickles import HPARAMS, PickleModel, callbacks
from tests.distributed.tiny_models import TinyShardedModel
from tests.hostile import HOSTILE_NAME, Marker

SCRIPT = Path(__file__).parents[1] / "distributed" / "lightning_pickles.py"
STRATEGIES = ("mp", "fsdp", "stock-mp", "stock-fsdp")


def message(what: str) -> str:
    return str(unpickling.RefusedPickleError(what, HOSTILE_NAME))


def rewrite_manifest_entry(directory: Path, name: str) -> None:
    """What an attacker who replaced ``name`` does next: make the manifest's size and checksum match."""
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    entry = next(e for e in manifest["files"] if e["path"] == name)
    entry["size"], entry["checksum"] = file_checksum(directory / name)
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


# ------------------------------------------------------------------------------------- hostile


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "marker"


@pytest.fixture
def hostile_file(tmp_path: Path, marker: Path) -> Path:
    path = tmp_path / "hostile.ckpt"
    torch.save(
        {
            "epoch": 0,
            "global_step": 1,
            "pytorch-lightning_version": L.__version__,
            "state_dict": {"net.0.weight": torch.ones(8, 4)},
            "hyper_parameters": {"hidden": 8, "notes": Marker(marker)},
        },
        path,
    )
    return path


@pytest.fixture
def hostile_meta(sharded_ckpt: Path, marker: Path) -> Path:
    """This library's 2-rank checkpoint whose ``meta.pt`` was replaced, and its manifest entry with it."""
    meta = torch.load(sharded_ckpt / "meta.pt", weights_only=True)
    meta["callbacks"] = {"Notes": {"text": Marker(marker)}}
    meta["pytorch-lightning_version"] = L.__version__
    torch.save(meta, sharded_ckpt / "meta.pt")
    rewrite_manifest_entry(sharded_ckpt, "meta.pt")
    return sharded_ckpt


@pytest.fixture
def hostile_metadata(sharded_ckpt: Path, marker: Path) -> Path:
    """DCP's ``.metadata`` replaced by a hostile pickle, the manifest rewritten to match."""
    (sharded_ckpt / ".metadata").write_bytes(pickle.dumps(Marker(marker)))
    rewrite_manifest_entry(sharded_ckpt, ".metadata")
    return sharded_ckpt


@pytest.fixture
def hostile_item(tmp_path: Path, marker: Path) -> Path:
    """A DCP checkpoint (one process, with manifest) whose optimizer parameter group holds a Marker."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    weight = torch.arange(6.0).reshape(2, 3)
    state = {
        "state_dict": {"w": weight},
        "optimizer_0": {
            "state": {"w": {"exp_avg": weight * 2}},
            "param_groups": [{"lr": 0.1, "params": ["w"], "notes": Marker(marker)}],
        },
    }

    def write(staging: Path) -> None:
        _save_state_dict(state, FileSystemWriter(staging), no_dist=True)
        torch.save({"epoch": 0, "global_step": 1}, staging / "meta.pt")

    path = tmp_path / "item.ckpt"
    commit_directory(path, write, metadata={"epoch": 0, "global_step": 1})
    return path


ITEM = "'optimizer_0.param_groups.0.notes'"


def test_hostile_full_file(
    hostile_file: Path, marker: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = message(f"The checkpoint file {str(hostile_file)!r}")
    for tool in (load_checkpoint, verify_checkpoint):
        with pytest.raises(CheckpointError) as info:
            tool(hostile_file)
        assert str(info.value) == expected, tool
    code, out, err = run_cli(capsys, "verify", str(hostile_file))
    assert (code, out) == (1, "") and expected in err
    # inspect lists the rest and marks what it did not unpickle
    info = inspect_checkpoint(hostile_file)
    assert info.not_unpickled == {"hyper_parameters.notes": HOSTILE_NAME}
    assert [(e.key, e.dtype) for e in info.entries] == [
        ("hyper_parameters.notes", "not unpickled"),
        ("state_dict.net.0.weight", "torch.float32"),
    ]
    assert (info.epoch, info.global_step) == (0, 1)
    code, out, _ = run_cli(capsys, "inspect", str(hostile_file))
    assert code == 0 and f"not unpickled: hyper_parameters.notes holds {HOSTILE_NAME}" in out
    assert "If you trust the file, use --unsafe-unpickle." in out
    code, _, err = run_cli(capsys, "consolidate", str(hostile_file), str(tmp_path / "out.ckpt"))
    assert code == 1 and "already a full checkpoint file" in err
    with pytest.raises(pickle.UnpicklingError, match=HOSTILE_NAME):  # a file: stock Lightning's torch.load
        TinyShardedModel.load_from_checkpoint(hostile_file)
    with pytest.raises(pickle.UnpicklingError, match=HOSTILE_NAME):
        torch.load(hostile_file)
    assert not marker.exists()

    code, out, _ = run_cli(capsys, "verify", str(hostile_file), "--unsafe-unpickle")
    assert code == 0 and f"holds {HOSTILE_NAME}, which a safe load refuses" in out
    assert not marker.exists()  # verify reads pickles statically, even with the flag
    code, out, _ = run_cli(capsys, "inspect", str(hostile_file), "--unsafe-unpickle")
    assert code == 0 and "global step: 1" in out and "not unpickled" not in out and marker.exists()
    marker.unlink()
    assert load_checkpoint(hostile_file, weights_only=False)["global_step"] == 1 and marker.exists()


def test_hostile_meta_pt_with_a_matching_manifest(
    hostile_meta: Path, marker: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = message(f"The Lightning metadata {str(hostile_meta / 'meta.pt')!r}")
    out_file = tmp_path / "out.ckpt"
    for call in (
        lambda: load_checkpoint(hostile_meta),
        lambda: verify_checkpoint(hostile_meta),
        lambda: consolidate_checkpoint(hostile_meta, out_file, progress=False),
        lambda: TinyShardedModel.load_from_checkpoint(hostile_meta),
    ):
        with pytest.raises(CheckpointError) as info:
            call()
        assert str(info.value) == expected
    for argv in (["verify", str(hostile_meta)], ["consolidate", str(hostile_meta), str(out_file)]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 1 and expected in err, argv
    # inspect takes epoch and step from the manifest: it does not unpickle meta.pt at all
    code, out, _ = run_cli(capsys, "inspect", str(hostile_meta))
    assert code == 0 and "global step: 10" in out and "not unpickled" not in out
    # without a manifest it reads meta.pt, and marks what it did not unpickle
    bare = tmp_path / "bare.ckpt"
    shutil.copytree(hostile_meta, bare, ignore=shutil.ignore_patterns(MANIFEST_NAME))
    info = inspect_checkpoint(bare)
    assert info.not_unpickled == {"callbacks.Notes.text": HOSTILE_NAME} and info.global_step == 10
    assert not marker.exists() and not out_file.exists()

    report = verify_checkpoint(hostile_meta, weights_only=False)
    assert report.has_manifest and any(HOSTILE_NAME in note for note in report.notes)
    assert not marker.exists()
    model = TinyShardedModel.load_from_checkpoint(hostile_meta, weights_only=False, strict=False)
    assert (
        isinstance(model, TinyShardedModel) and marker.exists()
    )  # weights_only=False is passed through, and the file really is hostile


def test_hostile_item_inside_a_distcp_file(
    hostile_item: Path, marker: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = message(
        f"The entry {ITEM} of the sharded checkpoint {str(hostile_item)!r} (in '__0_0.distcp', written by"
        " rank 0)"
    )
    out_file = tmp_path / "out.ckpt"
    for call in (
        lambda: load_checkpoint(hostile_item),
        lambda: verify_checkpoint(hostile_item),
        lambda: consolidate_checkpoint(hostile_item, out_file, progress=False),
    ):
        with pytest.raises(CheckpointError) as info:
            call()
        assert str(info.value) == expected
    for argv in (["verify", str(hostile_item)], ["consolidate", str(hostile_item), str(out_file)]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 1 and expected in err, argv
    # inspect shows the other entries' values and marks the refused one, without unpickling it
    code, out, _ = run_cli(capsys, "inspect", str(hostile_item))
    assert code == 0 and any(
        line.split()[:4] == [ITEM[1:-1], "-", "not", "unpickled"] for line in out.splitlines()
    )
    assert inspect_checkpoint(hostile_item).not_unpickled == {ITEM[1:-1]: HOSTILE_NAME}
    assert not marker.exists() and not out_file.exists()

    code, _, _ = run_cli(capsys, "consolidate", str(hostile_item), str(out_file), "--unsafe-unpickle")
    assert code == 0 and marker.exists()


def test_hostile_dcp_metadata(
    hostile_metadata: Path, marker: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = message(f"The DCP metadata {str(hostile_metadata / '.metadata')!r}")
    for tool in (load_checkpoint, inspect_checkpoint, verify_checkpoint):
        with pytest.raises(CheckpointError) as info:
            tool(hostile_metadata)
        assert str(info.value) == expected, tool
    for command in ("inspect", "verify"):
        code, _, err = run_cli(capsys, command, str(hostile_metadata))
        assert code == 1 and expected in err, command
    assert not marker.exists()
    with pytest.raises(CheckpointError):  # not a DCP Metadata once unpickled
        load_checkpoint(hostile_metadata, weights_only=False)
    assert marker.exists()


def test_hostile_dcp_metadata_without_a_manifest(
    hostile_metadata: Path, marker: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a manifest the file checks read `.metadata` first (against it): safely too."""
    (hostile_metadata / MANIFEST_NAME).unlink()
    expected = message(f"The DCP metadata {str(hostile_metadata / '.metadata')!r}")
    out_file = tmp_path / "out.ckpt"
    for call in (
        lambda: load_checkpoint(hostile_metadata),
        lambda: inspect_checkpoint(hostile_metadata),
        lambda: verify_checkpoint(hostile_metadata),
        lambda: consolidate_checkpoint(hostile_metadata, out_file, progress=False),
        lambda: TinyShardedModel.load_from_checkpoint(hostile_metadata),
    ):
        with pytest.raises(CheckpointError) as info:
            call()
        assert str(info.value) == expected
    code, out, _ = run_cli(capsys, "verify", str(hostile_metadata), "--unsafe-unpickle")
    what = f"The DCP metadata {str(hostile_metadata / '.metadata')!r}"
    assert code == 0 and f"note: {what} holds {HOSTILE_NAME}, which a safe load refuses" in out
    assert "note: the shard files were not checked against `.metadata`: reading it would run code" in out
    assert not marker.exists() and not out_file.exists()


# ------------------------------------------------------------------- what Lightning writes opens


class PickleShardedModel(ShardedStateMixin, PickleModel):
    """The checkpoints' model with the mixin: ``load_from_checkpoint`` reads the directories."""


@pytest.fixture(scope="module")
def pickles_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pickles")
    run_ranks(SCRIPT, 2, str(out), *STRATEGIES, timeout=300)
    return out


def check_hparams(hparams: Any) -> None:
    assert hparams["hidden"] == 8
    assert type(hparams["cfg"]) is AttributeDict and hparams["cfg"] == HPARAMS["cfg"]
    assert hparams["cfg"].betas == (0.9, 0.99)
    assert hparams["args"] == argparse.Namespace(seed=1, name="run")
    assert hparams["data_dir"] == Path("/data/train")


def check_lightning_state(checkpoint: dict[str, Any]) -> None:
    check_hparams(checkpoint["hyper_parameters"])
    assert checkpoint["global_step"] == 4
    (schedule,) = checkpoint["lr_schedulers"]
    assert schedule["step_size"] == 2 and schedule["base_lrs"] == [0.01]
    names = sorted(checkpoint["callbacks"])
    assert names[0].startswith("EarlyStopping") and names[1].startswith("ModelCheckpoint")
    assert checkpoint["callbacks"][names[0]]["patience"] == 3
    assert checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == 4
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("name", STRATEGIES)
def test_checkpoints_of_every_strategy_open_without_the_flag(
    pickles_run: Path, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (ckpt,) = (pickles_run / name).glob("*.ckpt")
    check_lightning_state(load_checkpoint(ckpt))
    report = verify_checkpoint(ckpt)
    assert report.has_manifest == (not name.startswith("stock"))
    assert not [note for note in report.notes if "safe load" in note]
    assert inspect_checkpoint(ckpt).global_step == 4
    out_file = tmp_path / "full.ckpt"
    for argv in (["inspect", str(ckpt)], ["verify", str(ckpt)], ["consolidate", str(ckpt), str(out_file)]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, (argv, err)
    full = load_checkpoint(out_file)
    check_lightning_state(full)
    assert verify_checkpoint(out_file).notes == []
    model = PickleShardedModel.load_from_checkpoint(ckpt)
    check_hparams(model.hparams)
    for key, value in full["state_dict"].items():
        assert torch.equal(model.state_dict()[key], value), key


# The command line with every import of torch, Lightning or numpy failing.
NO_TORCH = """
import sys
class Refuse:
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in ("torch", "lightning", "numpy"):
            raise ImportError(f"{name} imported")
sys.meta_path.insert(0, Refuse())
from lightning_sharded.cli import main
sys.exit(main(sys.argv[1:]))
"""


def without_torch_cli(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    """``lightning-sharded ARGV`` in a process where importing torch, Lightning or numpy fails."""
    return subprocess.run([sys.executable, "-c", NO_TORCH, *map(str, argv)], capture_output=True, text=True)


@pytest.mark.parametrize("name", STRATEGIES)
def test_verify_and_inspect_of_every_strategy_s_checkpoint_need_no_torch(
    pickles_run: Path,
    name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What stock Lightning and this library write (hyperparameters, callbacks, schedulers, per-rank
    state) is verified without importing torch (1.3 s of the command's start), and this library's
    checkpoints are inspected without it, as torch reads them; a checkpoint that holds anything else
    still asks torch (``test_without_torch.py``), and a hostile one is still refused."""
    (ckpt,) = (pickles_run / name).glob("*.ckpt")
    done = without_torch_cli("verify", ckpt)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("OK:")
    if not name.startswith("stock"):  # stock Lightning's meta.pt holds tensors (callbacks' scores)
        done = subprocess.run(
            [sys.executable, "-c", NO_TORCH, "inspect", ckpt], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        with monkeypatch.context() as m:  # the same command with torch reading every pickle
            m.setattr(without_torch, "read_plain", lambda source: without_torch.NOT_READ)
            m.setattr(without_torch, "read_dcp_metadata", lambda f: None)
            code, out, err = run_cli(capsys, "inspect", str(ckpt))
        assert code == 0, err
        assert done.stdout == out and "optimizer_0.param_groups.0.lr" in out
    copy = shutil.copytree(ckpt, tmp_path / "copy")
    meta = unpickling.safe_load(copy / LIGHTNING_METADATA, what="meta.pt")
    meta["extra"] = complex(1, 2)  # torch allows it; the list that spares torch's import does not have it
    torch.save(meta, copy / LIGHTNING_METADATA)
    if (copy / MANIFEST_NAME).exists():
        rewrite_manifest_entry(copy, LIGHTNING_METADATA)
    assert verify_checkpoint(copy).path == copy
    done = without_torch_cli("verify", copy)
    assert done.returncode == 1 and "torch imported" in done.stderr, done.stderr  # torch was asked


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_s_checkpoint_consolidates_without_torch(
    pickles_run: Path, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``consolidate`` of what stock Lightning and this library write (hyperparameters, callbacks' scores,
    schedulers, per-rank state) imports no torch (2 s of a 2 GB checkpoint's 4 s), and writes the file
    the torch path writes."""
    from lightning_sharded.checkpoint.tools import consolidate_direct

    (ckpt,) = (pickles_run / name).glob("*.ckpt")
    done = without_torch_cli("consolidate", "--no-progress", ckpt, tmp_path / "direct.ckpt")
    assert done.returncode == 0, done.stderr
    monkeypatch.setattr(consolidate_direct, "plan", lambda found, out: "through torch, as the test asks")
    consolidate_checkpoint(ckpt, tmp_path / "through-torch.ckpt", progress=False)
    assert_identical(
        torch.load(tmp_path / "direct.ckpt", weights_only=False),
        torch.load(tmp_path / "through-torch.ckpt", weights_only=False),
    )
    check_lightning_state(load_checkpoint(tmp_path / "direct.ckpt"))


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_s_checkpoint_exports_safetensors_without_torch(
    pickles_run: Path, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The safetensors export of what stock Lightning and this library write imports no torch, and writes
    the files the torch path writes, byte for byte."""
    from lightning_sharded.checkpoint.tools import export_direct
    from tests.checkpoint.test_export_direct import files_of

    (ckpt,) = (pickles_run / name).glob("*.ckpt")
    args = ("consolidate", "--format", "safetensors", "--no-progress", "--max-shard-size", "100B")
    done = without_torch_cli(*args, ckpt, tmp_path / "direct")
    assert done.returncode == 0, done.stderr
    monkeypatch.setattr(export_direct, "plan", lambda *a: "through torch, as the test asks")
    consolidate_checkpoint(
        ckpt, tmp_path / "through-torch", format="safetensors", progress=False, max_shard_size="100B"
    )
    assert len(list((tmp_path / "direct").glob("*.safetensors"))) > 1
    assert files_of(tmp_path / "direct") == files_of(tmp_path / "through-torch")


def test_single_device_file_with_callbacks_opens_without_the_flag(tmp_path: Path) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=L.pytorch.loggers.CSVLogger(tmp_path / "logs"),
        callbacks=callbacks(tmp_path / "ckpts"),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(PickleModel(**HPARAMS))
    (ckpt,) = (tmp_path / "ckpts").glob("*.ckpt")
    check_lightning_state(load_checkpoint(ckpt))
    assert verify_checkpoint(ckpt).notes == []
    info = inspect_checkpoint(ckpt)
    assert info.global_step == 4 and any(e.key == "state_dict.net.0.weight" for e in info.entries)
    check_hparams(PickleShardedModel.load_from_checkpoint(ckpt, weights_only=False).hparams)


# ---------------------------------------------------------------------------------- the mechanism


def test_the_context_keeps_the_users_safe_globals() -> None:
    class Mine:
        pass

    torch.serialization.add_safe_globals([Mine, argparse.Namespace])
    before = torch.serialization.get_safe_globals()
    try:
        with unpickling.safe_globals():
            names = {g[1] if isinstance(g, tuple) else g for g in torch.serialization.get_safe_globals()}
            assert "pathlib.PosixPath" in names and unpickling.ATTRIBUTE_DICT_NAMES[0] in names
        after = torch.serialization.get_safe_globals()
        assert set(after) == set(before)  # exactly what it was (torch keeps a set: no order)
        assert Mine in after and argparse.Namespace in after
        assert not [g for g in after if isinstance(g, tuple) and g[1] == "pathlib.PosixPath"]
    finally:
        torch.serialization.clear_safe_globals()


def test_attribute_dicts_come_back_as_attribute_dicts_shared_as_saved() -> None:
    inner = AttributeDict(lr=0.1, sub=AttributeDict(k=[1, 2]))
    buffer = io.BytesIO()
    torch.save({"a": inner, "b": [inner], "plain": {"x": 1}, "t": torch.ones(2)}, buffer)
    buffer.seek(0)
    loaded = unpickling.safe_load(buffer, what="x")
    assert type(loaded["a"]) is AttributeDict and type(loaded["a"].sub) is AttributeDict
    assert loaded["a"] is loaded["b"][0] and loaded["a"].sub.k == [1, 2]
    assert type(loaded["plain"]) is dict and torch.equal(loaded["t"], torch.ones(2))


def test_refusals_name_the_type(tmp_path: Path) -> None:
    import os

    class System:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("true",))

    buffer = io.BytesIO()
    torch.save({"x": System()}, buffer)
    buffer.seek(0)
    with pytest.raises(CheckpointError, match=r"^The thing holds posix\.system, which is not on the list"):
        unpickling.safe_load(buffer, what="The thing")
    with pytest.raises(CheckpointError, match=r"^The pickle holds posix\.system, which"):
        unpickling.load_pickle(io.BytesIO(pickle.dumps(System())), what="The pickle")
    assert unpickling.unsafe_globals(buffer.getvalue()) == ["posix.system"]
    buffer.seek(0)
    inert = unpickling.inert_load(buffer)
    assert isinstance(inert["x"], unpickling.NotUnpickled) and inert["x"].name == "posix.system"


def test_weights_only_none_follows_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert unpickling.resolve_weights_only(None) is True
    assert unpickling.resolve_weights_only(False) is False
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert unpickling.resolve_weights_only(None) is False
    assert unpickling.resolve_weights_only(True) is True
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    assert unpickling.resolve_weights_only(False) is True


def test_load_pickle_builds_only_the_allowed_globals_unless_told_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_pickle`` (DCP's ``.metadata``): refused by default; unpickled as asked with
    ``weights_only=False`` or torch's ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (a mutant returning ``None``
    there survived the suite)."""
    marker = tmp_path / "ran"
    data = pickle.dumps({"x": Marker(marker), "n": 3})
    with pytest.raises(CheckpointError, match=HOSTILE_NAME):
        unpickling.load_pickle(io.BytesIO(data), what="The test pickle")
    assert not marker.exists()
    loaded = unpickling.load_pickle(io.BytesIO(data), what="The test pickle", weights_only=False)
    assert marker.exists() and loaded["n"] == 3
    marker.unlink()
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert unpickling.load_pickle(io.BytesIO(data), what="The test pickle", weights_only=None)["n"] == 3
    assert marker.exists()


def test_a_copy_of_a_hostile_directory_is_still_refused_after_a_clean_load(
    hostile_item: Path, sharded_ckpt: Path, marker: Path
) -> None:
    """The allow-list is added per load and removed after: nothing leaks into later plain loads."""
    load_checkpoint(sharded_ckpt)
    copy = hostile_item.with_name("copy.ckpt")
    shutil.copytree(hostile_item, copy)
    with pytest.raises(CheckpointError, match=HOSTILE_NAME):
        load_checkpoint(copy)
    assert torch.serialization.get_safe_globals() == [] or all(
        not isinstance(g, tuple) for g in torch.serialization.get_safe_globals()
    )
    assert not marker.exists()


def test_the_strategies_resume_keeps_lightnings_rule(pickles_run: Path, process_group: None) -> None:
    """Resuming passes fit()'s weights_only to torch.load as stock Lightning does; None is torch's default."""
    from lightning_sharded.checkpoint.load import restore_checkpoint

    (ckpt,) = (pickles_run / "mp").glob("*.ckpt")
    model = PickleModel(**HPARAMS)
    with pytest.raises(CheckpointError) as info:
        restore_checkpoint(ckpt, model)
    assert str(info.value) == (
        f"The Lightning metadata {str(ckpt / 'meta.pt')!r} holds"
        " lightning.fabric.utilities.data.AttributeDict, which torch.load refuses with weights_only=None"
        " (the default is torch's, True). If you trust the checkpoint (your own run),"
        " resume with trainer.fit(..., weights_only=False), as with stock Lightning."
    )
    restored = restore_checkpoint(ckpt, model, weights_only=False)
    check_hparams(restored.metadata["hyper_parameters"])
    for key, value in load_checkpoint(ckpt)["state_dict"].items():
        assert torch.equal(model.state_dict()[key], value), key


def test_hostile_file_at_a_url(hostile_file: Path, marker: Path) -> None:
    import fsspec

    url = f"memory://hostile-{marker.parent.name}/sent.ckpt"
    fsspec.filesystem("memory").pipe(url.removeprefix("memory://"), hostile_file.read_bytes())
    expected = message(f"The checkpoint file {url!r}")
    for tool in (load_checkpoint, verify_checkpoint):
        with pytest.raises(CheckpointError) as info:
            tool(url)
        assert str(info.value) == expected, tool
    assert inspect_checkpoint(url).not_unpickled == {"hyper_parameters.notes": HOSTILE_NAME}
    assert not marker.exists()


def test_verify_reports_an_object_entry_it_cannot_read(hostile_item: Path, marker: Path) -> None:
    """Without a manifest (stock Lightning) nothing else catches a damaged non-tensor entry."""
    from lightning_sharded.checkpoint.backends import backend_for
    from lightning_sharded.checkpoint.dcp_index import read_index

    (hostile_item / MANIFEST_NAME).unlink()
    metadata = read_index(backend_for(hostile_item), hostile_item, weights_only=True)
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == ITEM[1:-1]]
    with open(hostile_item / "__0_0.distcp", "r+b") as f:
        f.seek(int(info.offset))
        f.write(b"\0\0\0\0")
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(hostile_item)
    assert str(err.value).startswith(
        f"The checkpoint {str(hostile_item)!r} is damaged: '__0_0.distcp' (written by rank 0) is corrupted:"
        f" its entry {ITEM} at byte {int(info.offset)} cannot be read (ValueError: "
    )
    assert not marker.exists()


def test_a_refusal_survives_pickling_as_dcp_gathers_it_from_rank_to_rank() -> None:
    err = unpickling.RefusedPickleError("The entry 'x' of 'ckpt'", "builtins.eval")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    assert (back.what, back.name) == (err.what, err.name)
