"""Hostile checkpoints built from what an attacker reaches for first: ``eval``, ``exec``, ``getattr`` (on an
allowed class), ``__import__``, ``functools.partial``, ``os.system``, ``subprocess.Popen`` and a refused
call nested in an allowed one (:func:`tests.hostile.payloads`). Each is put in a full file's
hyperparameters, in a sharded checkpoint's ``meta.pt``, as its ``.metadata`` and as one of the values
DCP stores as bytes in a shard file (the manifest rewritten to match), and every reader refuses it,
naming the global, with no side effect: ``load_checkpoint``,
``verify_checkpoint``, ``consolidate_checkpoint``, a resume (``restore_checkpoint``, the strategies'
load) and ``inspect_checkpoint`` (which lists a refused object as not unpickled where it can describe
the rest). Each payload is first unpickled plainly, to show it really creates the marker file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_sharded import (
    CheckpointError,
    consolidate_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    verify_checkpoint,
)
from lightning_sharded.checkpoint.load import restore_checkpoint
from lightning_sharded.checkpoint.names import MANIFEST_NAME
from tests.checkpoint.test_unpickling import rewrite_manifest_entry
from tests.hostile import IMPORT_MARKER_ENV, payloads

KINDS = sorted(payloads("m"))


@pytest.fixture
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "marker"
    monkeypatch.setenv(IMPORT_MARKER_ENV, str(path))
    monkeypatch.delitem(sys.modules, "tests.hostile_import", raising=False)
    yield path


def _ran(marker: Path, result: Any) -> bool:
    """Whether the payload's code ran (a process it started is waited for)."""
    for value in result.values() if isinstance(result, dict) else [result]:
        if isinstance(value, subprocess.Popen):
            value.wait()
    return marker.exists()


def _resume(path: Path) -> None:
    """A resume's load, as the strategies call it (torch's default ``weights_only``)."""
    model = nn.Module()
    model.layer = nn.Linear(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        restore_checkpoint(path, model, [torch.optim.Adam(model.parameters())])


def _refused(call: Callable[[], Any], names: tuple[str, ...], reader: str) -> str:
    """The name the refusal of ``call`` gives (one of ``names``)."""
    with pytest.raises(CheckpointError) as info:
        call()
    held = re.search(r" holds (.+?), which", str(info.value))
    said = [name for name in names if held is not None and name in held.group(1).split(", ")]
    assert said, (reader, str(info.value))
    return said[0]


@pytest.mark.parametrize("kind", KINDS)
def test_every_reader_refuses_it_and_nothing_runs(
    kind: str, marker: Path, sharded_ckpt: Path, tmp_path: Path
) -> None:
    payload, names = payloads(marker)[kind]
    assert _ran(marker, pickle.loads(pickle.dumps(payload))), "the payload is not hostile"
    marker.unlink()
    sys.modules.pop("tests.hostile_import", None)

    # 1. a full file, the payload in its hyperparameters
    full = tmp_path / "full.ckpt"
    torch.save(
        {
            "epoch": 0,
            "global_step": 1,
            "pytorch-lightning_version": L.__version__,
            "state_dict": {"layer.weight": torch.ones(8, 6), "layer.bias": torch.ones(8)},
            "hyper_parameters": {"hidden": 8, "notes": payload},
        },
        full,
    )
    # 2. a sharded checkpoint whose meta.pt holds it
    meta = tmp_path / "meta.ckpt"
    shutil.copytree(sharded_ckpt, meta)
    values = torch.load(meta / "meta.pt", weights_only=True)
    values["callbacks"] = {"Notes": {"text": payload}}
    torch.save(values, meta / "meta.pt")
    rewrite_manifest_entry(meta, "meta.pt")
    # 3. a sharded checkpoint whose .metadata is it
    metadata = tmp_path / "metadata.ckpt"
    shutil.copytree(sharded_ckpt, metadata)
    (metadata / ".metadata").write_bytes(pickle.dumps(payload))
    rewrite_manifest_entry(metadata, ".metadata")

    out = tmp_path / "out.ckpt"
    for path in (full, meta, metadata):
        readers: dict[str, Callable[[], Any]] = {
            "load_checkpoint": lambda p=path: load_checkpoint(p),
            "verify_checkpoint": lambda p=path: verify_checkpoint(p),
        }
        readers["resume"] = lambda p=path: _resume(p)
        if path is not full:  # consolidating a full file is refused before it is read
            readers["consolidate_checkpoint"] = lambda p=path: consolidate_checkpoint(p, out, progress=False)
        if path is metadata:  # inspect needs .metadata to describe the shards
            readers["inspect_checkpoint"] = lambda p=path: inspect_checkpoint(p)
        for reader, call in readers.items():
            _refused(call, names, f"{reader} of {path.name}")
            assert not marker.exists(), f"{reader} of {path.name} ran the checkpoint's code"
    # inspect describes the rest and marks the refused object, without building it
    # (as the file spells it: torch.save's protocol 2 writes builtins as __builtin__)
    names = (*names, *(n.replace("builtins.", "__builtin__.") for n in names))
    listed = inspect_checkpoint(full).not_unpickled
    assert set(listed) <= {"hyper_parameters.notes", "hyper_parameters.notes.k"}, listed
    assert listed and set(listed.values()) <= set(names), listed
    bare = tmp_path / "bare.ckpt"  # without a manifest, inspect reads meta.pt (with one, it does not)
    shutil.copytree(meta, bare, ignore=shutil.ignore_patterns(MANIFEST_NAME))
    listed = inspect_checkpoint(bare).not_unpickled
    assert set(listed) <= {"callbacks.Notes.text", "callbacks.Notes.text.k"}, listed
    assert listed and set(listed.values()) <= set(names), listed
    assert not marker.exists() and not out.exists()
    assert "tests.hostile_import" not in sys.modules
    assert os.environ[IMPORT_MARKER_ENV] == str(marker)


def hostile_bytes_entry(
    src: Path, dst: Path, payload: Any, fqn: str = "optimizer_0.param_groups.0.lr"
) -> None:
    """A copy of the sharded checkpoint ``src`` whose value ``fqn`` (stored by DCP as bytes: a pickle)
    is ``payload``: its bytes appended to the shard file, the index and the manifest rewritten to match."""
    shutil.copytree(src, dst)
    index = pickle.loads((dst / ".metadata").read_bytes())
    key = next(k for k in index.storage_data if k.fqn == fqn)
    info = index.storage_data[key]
    data = io.BytesIO()
    torch.save(payload, data)
    shard = dst / str(info.relative_path)
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(data.getvalue())
    index.storage_data[key] = dataclasses.replace(info, offset=offset, length=len(data.getvalue()))
    (dst / ".metadata").write_bytes(pickle.dumps(index))
    rewrite_manifest_entry(dst, ".metadata")
    rewrite_manifest_entry(dst, str(info.relative_path))


@pytest.mark.parametrize("kind", KINDS)
def test_a_value_stored_as_bytes_in_a_shard_file_is_refused_by_every_reader(
    kind: str, marker: Path, sharded_ckpt: Path, tmp_path: Path
) -> None:
    # DCP's own load planner unpickles such a value with weights_only=False: a resume ran its code.
    payload, names = payloads(marker)[kind]
    path = tmp_path / "bytes.ckpt"
    hostile_bytes_entry(sharded_ckpt, path, payload)
    sys.modules.pop("tests.hostile_import", None)
    out = tmp_path / "out.ckpt"
    readers: dict[str, Callable[[], Any]] = {
        "resume": lambda: _resume(path),
        "load_checkpoint": lambda: load_checkpoint(path),
        "consolidate_checkpoint": lambda: consolidate_checkpoint(path, out, progress=False),
    }
    for reader, call in readers.items():
        _refused(call, names, reader)
        assert not marker.exists(), f"{reader} ran the checkpoint's code"
    assert not out.exists()
    # With weights_only=False (the user trusts the file), the resume reads it as DCP does: the code runs.
    model = nn.Module()
    model.layer = nn.Linear(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        # What the payload builds is no learning rate: the optimizer may reject it afterwards.
        with contextlib.suppress(Exception):
            restore_checkpoint(path, model, [torch.optim.Adam(model.parameters())], weights_only=False)
    deadline = time.monotonic() + 30  # subprocess.Popen's process makes the marker when it runs
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the trusted resume did not read the value"
