"""The manifest: JSON round trip, checksums, and the errors for damaged or newer manifests."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from lightning_sharded.checkpoint import read_manifest
from lightning_sharded.checkpoint.checksum import file_checksum
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    PARTIAL_FORMAT_VERSION,
    READABLE_FORMAT_VERSION,
    FileEntry,
    FrozenPart,
    Manifest,
)


def test_round_trip(tmp_path: Path) -> None:
    manifest = Manifest(
        files=[FileEntry("b", 2, "00000002", 1), FileEntry("a", 1, "00000001", 0)],
        world_size=2,
        metadata={"epoch": 3, "global_step": 30},
    )
    (tmp_path / MANIFEST_NAME).write_text(manifest.to_json())
    loaded = read_manifest(tmp_path)
    assert loaded is not None
    assert [e.path for e in loaded.files] == ["a", "b"]
    assert loaded.world_size == 2 and loaded.epoch == 3 and loaded.global_step == 30
    assert loaded.format_version == FORMAT_VERSION
    assert loaded.torch_version.startswith("2.")
    assert loaded.total_size == 3


def test_checksum_is_crc32_of_the_content(tmp_path: Path) -> None:
    data = bytes(range(256)) * 50_000
    (tmp_path / "f").write_bytes(data)
    assert file_checksum(tmp_path / "f") == (len(data), f"{zlib.crc32(data):08x}")


def test_no_manifest_is_none(tmp_path: Path) -> None:
    assert read_manifest(tmp_path) is None


def test_damaged_manifest(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(
        CheckpointError, match=r"is not valid JSON of a lightning_sharded manifest.*delete the manifest"
    ):
        read_manifest(tmp_path)


def test_newer_manifest(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text(
        json.dumps({"format_version": READABLE_FORMAT_VERSION + 1, "files": []})
    )
    with pytest.raises(CheckpointError, match="Upgrade lightning_sharded"):
        read_manifest(tmp_path)


def test_manifest_module_does_not_need_torch() -> None:
    code = (
        "import sys, importlib.util;"
        "spec = importlib.util.spec_from_file_location('m', sys.argv[1]);"
        "errors = importlib.util.spec_from_file_location('lightning_sharded.checkpoint.errors', sys.argv[2]);"
        "e = importlib.util.module_from_spec(errors); sys.modules[errors.name] = e;"
        "errors.loader.exec_module(e);"
        "m = importlib.util.module_from_spec(spec); sys.modules['m'] = m; spec.loader.exec_module(m);"
        "assert 'torch' not in sys.modules; print('ok')"
    )
    pkg = Path(__file__).resolve().parents[1] / "lightning_sharded" / "checkpoint"
    out = subprocess.run(
        [sys.executable, "-c", code, str(pkg / "manifest.py"), str(pkg / "errors.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "ok", out.stderr


def test_local_manifests_keep_format_1_without_data_dir(tmp_path: Path) -> None:
    text = Manifest(files=[FileEntry("a", 1, "00000000")]).to_json()
    assert "data_dir" not in json.loads(text) and json.loads(text)["format_version"] == 1
    remote = Manifest(files=[], format_version=2, data_dir="data-0123456789abcdef01234567")
    assert Manifest.from_json(remote.to_json()).data_dir == "data-0123456789abcdef01234567"


def test_a_trainable_only_manifest_names_its_frozen_part_at_format_3_and_others_are_unchanged() -> None:
    frozen = FrozenPart("/data/base", ("base.0.bias", "base.0.weight"), "base.")
    text = Manifest(files=[], frozen=frozen).to_json()
    data = json.loads(text)
    assert data["format_version"] == PARTIAL_FORMAT_VERSION == 3
    assert data["frozen"] == {
        "source": "/data/base",
        "keys": ["base.0.bias", "base.0.weight"],
        "prefix": "base.",
    }
    assert Manifest.from_json(text).frozen == frozen
    remote = Manifest(files=[], format_version=2, frozen=frozen)  # object storage: 3 as well
    assert remote.format_version == 3
    # A manifest written before the field existed reads as a complete checkpoint's.
    old = {"files": [], "format_version": 1, "world_size": 2}
    assert Manifest.from_json(json.dumps(old)).frozen is None
    assert "frozen" not in json.loads(Manifest(files=[]).to_json())
    with pytest.raises(CheckpointError, match="not valid JSON of a lightning_sharded manifest"):
        Manifest.from_json(json.dumps({**old, "format_version": 3, "frozen": {"source": "x"}}))
