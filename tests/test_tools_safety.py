"""The offline tools never destroy or launder data: consolidate's destination rules, verify-first,
the atomic commit of its output, and inspect's checks. Each refusal checks that nothing changed on disk.

The source is a real 2-rank DCP save (``sharded_ckpt``, see conftest), copied for each test.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_sharded import CheckpointError, consolidate_checkpoint, load_checkpoint, verify_checkpoint
from lightning_sharded.checkpoint.backends.local import leftovers
from lightning_sharded.checkpoint.manifest import MANIFEST_NAME
from lightning_sharded.checkpoint.tools import inspect_checkpoint
from tests.distributed.fault_driver import expected
from tests.distributed.launch import REPO
from tests.fault_injection import FAULT_ENV
from tests.test_tools_cli import lightning_form
from tests.test_verify_errors import flip_bit, snapshot, truncate

CORRUPTED = r"'__1_0.distcp' \(written by rank 1\) is corrupted: its crc32 is [0-9a-f]{8}, the manifest says"


def consolidate(src: Path, dst: str | Path, **kwargs: object) -> Path:
    out = consolidate_checkpoint(src, dst, progress=False, **kwargs)  # type: ignore[arg-type]
    assert isinstance(out, Path)
    return out


def refused(root: Path, call: object, kind: type[BaseException], pattern: str) -> str:
    """``call()`` raises ``kind`` matching ``pattern``, and no file under ``root`` changed."""
    before = snapshot(root / "x")  # snapshot() lists everything under its argument's parent
    with pytest.raises(kind, match=pattern) as info:
        call()  # type: ignore[operator]
    assert snapshot(root / "x") == before, "a refused consolidate changed files on disk"
    return str(info.value)


# ------------------------------------------------------------------------------- destination rules


@pytest.mark.parametrize("existing", ["file", "empty directory", "sharded checkpoint directory"])
def test_replaces_only_with_overwrite(sharded_ckpt: Path, tmp_path: Path, existing: str) -> None:
    dst = tmp_path / "out.ckpt"
    if existing == "file":
        dst.write_text("someone's notes")
    elif existing == "empty directory":
        dst.mkdir()
    else:
        shutil.copytree(sharded_ckpt, dst)
    message = refused(tmp_path, lambda: consolidate(sharded_ckpt, dst), FileExistsError, "exists")
    assert message == (
        f"The destination {str(dst)!r} exists (a{'n' if existing[0] == 'e' else ''} {existing}). To replace"
        " it, pass --force (overwrite=True in Python), or choose another destination."
    )
    assert consolidate(sharded_ckpt, dst, overwrite=True) == dst
    assert dst.is_file() and leftovers(dst) == []
    assert_full(dst)


def assert_full(file: Path) -> None:
    from tests._compare import assert_same

    assert_same(torch.load(file, weights_only=True), lightning_form(1))


def test_never_replaces_a_directory_of_something_else(sharded_ckpt: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "notes.txt").write_text("keep me")
    for overwrite in (False, True):
        message = refused(
            tmp_path,
            lambda o=overwrite: consolidate(sharded_ckpt, runs, overwrite=o),
            IsADirectoryError,
            "is a directory that is not a checkpoint",
        )
        assert "(it holds notes.txt)" in message and "end the destination with a slash" in message
        assert repr(str(runs) + os.sep) in message


def test_never_the_source(sharded_ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(sharded_ckpt, target_is_directory=True)
    cases = [
        (sharded_ckpt, sharded_ckpt),  # SRC == DST
        (sharded_ckpt, str(sharded_ckpt) + "/"),  # inside it, named as itself
        (sharded_ckpt, sharded_ckpt / "full.ckpt"),  # inside it
        (sharded_ckpt, tmp_path),  # holds it
        (tmp_path / "link", sharded_ckpt),  # the same directory through a symlink
        (sharded_ckpt, tmp_path / "link"),
    ]
    for src, dst in cases:
        message = refused(
            tmp_path,
            lambda s=src, d=dst: consolidate(s, d, overwrite=True),
            ValueError,
            "is the source checkpoint",
        )
        assert "would destroy the only copy" in message, message
    assert verify_checkpoint(sharded_ckpt).has_manifest


def test_the_old_version_of_an_interrupted_save_counts_as_there(sharded_ckpt: Path, tmp_path: Path) -> None:
    # A crash between the two renames of a fallback publish leaves `.out.ckpt.old-<token>`, which loads
    # of `out.ckpt` read and the next save renames back: writing `out.ckpt` would replace it.
    dst = tmp_path / "out.ckpt"
    old = tmp_path / f".out.ckpt.old-{'0' * 24}"
    shutil.copytree(sharded_ckpt, old)
    refused(tmp_path, lambda: consolidate(sharded_ckpt, dst), FileExistsError, "a sharded checkpoint")


def test_a_trailing_slash_means_inside(
    sharded_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out = consolidate(Path("ckpt"), "runs/")  # runs/ does not exist yet: created
    assert out == Path("runs/ckpt") and out.is_file()
    (tmp_path / "runs" / "notes.txt").write_text("keep me")
    refused(tmp_path, lambda: consolidate(Path("ckpt"), "runs/"), FileExistsError, "'runs/ckpt' exists")
    assert consolidate(Path("ckpt"), "runs/", overwrite=True) == out
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["ckpt", "notes.txt"]
    assert_full(out)


def test_the_destination_folder_must_be_a_directory(sharded_ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    refused(
        tmp_path,
        lambda: consolidate(sharded_ckpt, tmp_path / "notes.txt" / "out.ckpt"),
        NotADirectoryError,
        r"'.*notes.txt' is a file, not a directory",
    )


def unwritable(tmp_path: Path) -> Path:
    """A folder this process cannot create files in (root ignores permissions: /proc then)."""
    if os.geteuid() == 0:
        return Path("/proc")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


def test_an_unwritable_destination_is_one_clear_oserror(sharded_ckpt: Path, tmp_path: Path) -> None:
    dst = unwritable(tmp_path) / "lightning-sharded-test.ckpt"
    with pytest.raises(
        OSError, match=rf"^Cannot write the checkpoint file {str(dst)!r}: .*Nothing was written"
    ):
        consolidate(sharded_ckpt, dst)
    assert not dst.exists() and leftovers(dst) == []


def test_only_the_known_formats(sharded_ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Unknown format 'onnx'.*\['lightning', 'safetensors'\]"):
        consolidate(sharded_ckpt, tmp_path / "out", format="onnx")
    for kwargs in ({"dtype": torch.bfloat16}, {"prefix": "model."}, {"config": "config.json"}):
        with pytest.raises(ValueError, match="Leave dtype, prefix and config at None"):
            consolidate(sharded_ckpt, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------- verify first


def flip_a_bit_of_the_weight(ckpt: Path) -> tuple[int, int]:
    """Flip one bit inside rank 1's rows of ``layer.weight`` (in ``__1_0.distcp``); the (row, col) hit."""
    shard = ckpt / "__1_0.distcp"
    rows = expected(1)["state_dict"]["layer.weight"][4:]
    at = shard.read_bytes().find(rows.numpy().tobytes())
    assert at > 0, "rank 1's rows of layer.weight not found in its shard file"
    flip_bit(shard, at + 4 * 7 + 1)  # float 7 of rank 1's rows: row 5, column 1 of the full tensor
    return 5, 1


def test_a_corrupted_shard_is_not_laundered(sharded_ckpt: Path, tmp_path: Path) -> None:
    row, col = flip_a_bit_of_the_weight(sharded_ckpt)
    with pytest.raises(CheckpointError, match=CORRUPTED):
        verify_checkpoint(sharded_ckpt)
    dst = tmp_path / "out.ckpt"
    message = refused(tmp_path, lambda: consolidate(sharded_ckpt, dst), CheckpointError, CORRUPTED)
    assert message.startswith(f"The checkpoint {str(sharded_ckpt)!r} is damaged: '__1_0.distcp'")
    assert not dst.exists() and leftovers(dst) == []
    # What the check prevents: without it, the bad value is copied into a file with fresh checksums.
    consolidate(sharded_ckpt, dst, verify=False)
    assert verify_checkpoint(dst).kind.value == "full"
    weight = torch.load(dst, weights_only=True)["state_dict"]["layer.weight"]
    good = expected(1)["state_dict"]["layer.weight"]
    assert (weight != good).nonzero().tolist() == [[row, col]]


@pytest.mark.parametrize("where", ["tensor", "header", "meta.pt", ".metadata"])
def test_verify_checks_the_bytes_the_tools_read(
    sharded_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """consolidate and load_checkpoint checksum the source as they read it (each byte read once, no
    checksum pass first), and a damaged file anywhere fails them, named, before anything is published."""
    from lightning_sharded.checkpoint import integrity
    from lightning_sharded.checkpoint.backends import dcp_reader, local

    covered: dict[str, int] = {}
    real = local.ranges_checksum

    def recording(file: Path, size: int, known: list[tuple[int, int, int]]) -> tuple[int, str]:
        covered[Path(file).name] = sum(length for _, length, _ in known)
        return real(file, size, known)

    real_check = integrity.check_found

    def sizes_only(found: object, *, verify: bool = False, **kwargs: object) -> None:
        assert not verify, "the tool checksummed the files before reading them"
        real_check(found, verify=verify, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dcp_reader, "_DIRECT_FROM", 1)  # this checkpoint's tensors are small: read directly
    expected_weight = expected(1)["state_dict"]["layer.weight"]
    with monkeypatch.context() as whole:  # a whole checkpoint: no checksum pass before the reads
        whole.setattr(local, "ranges_checksum", recording)
        whole.setattr(integrity, "check_found", sizes_only)
        assert torch.equal(
            load_checkpoint(sharded_ckpt, verify=True)["state_dict"]["layer.weight"], expected_weight
        )
        assert covered["__0_0.distcp"] > 0 and covered["__1_0.distcp"] > 0  # the tensors, hashed as read
        out = consolidate(sharded_ckpt, tmp_path / "good.ckpt")
    assert torch.equal(torch.load(out, weights_only=True)["state_dict"]["layer.weight"], expected_weight)

    if where == "tensor":
        flip_a_bit_of_the_weight(sharded_ckpt)
        file = "__1_0.distcp"
    else:
        file = "__1_0.distcp" if where == "header" else where
        flip_bit(sharded_ckpt / file, 40 if where == "header" else None)  # the first pickle, or the middle
    pattern = rf"'{re.escape(file)}'.*is corrupted: its crc32 is [0-9a-f]{{8}}, the manifest says"
    dst = tmp_path / "out.ckpt"
    message = refused(tmp_path, lambda: consolidate(sharded_ckpt, dst), CheckpointError, pattern)
    assert not dst.exists() and leftovers(dst) == []
    if where == "tensor":  # found after the read: the message says nothing was published
        assert f"Nothing was written at {str(dst)!r}." in message
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(sharded_ckpt, verify=True)


def test_load_checkpoint_verify(sharded_ckpt: Path) -> None:
    flip_a_bit_of_the_weight(sharded_ckpt)
    assert load_checkpoint(sharded_ckpt)["epoch"] == 1  # sizes only, by default
    with pytest.raises(CheckpointError, match=CORRUPTED):
        load_checkpoint(sharded_ckpt, verify=True)


def test_without_a_manifest_consolidate_says_it_could_not_verify(
    sharded_ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (sharded_ckpt / MANIFEST_NAME).unlink()
    with caplog.at_level("WARNING", logger="lightning_sharded"):
        assert_full(consolidate(sharded_ckpt, tmp_path / "out.ckpt"))
    assert "has no manifest" in caplog.text and "there are no checksums to verify" in caplog.text


# ------------------------------------------------------------------------------- atomic output


def test_a_failed_consolidate_leaves_nothing(sharded_ckpt: Path, tmp_path: Path) -> None:
    # No manifest and sizes intact: only reading the tensors finds the bad record, mid-write.
    (sharded_ckpt / MANIFEST_NAME).unlink()
    shard = sharded_ckpt / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[0:4] = b"XXXX"
    shard.write_bytes(bytes(data))
    dst = tmp_path / "out.ckpt"
    dst.write_text("previous")
    with pytest.raises(
        CheckpointError, match=r"'__1_0.distcp' \(written by rank 1\) is corrupted: its entry"
    ):
        consolidate(sharded_ckpt, dst, overwrite=True)
    assert dst.read_text() == "previous" and leftovers(dst) == []


def test_a_killed_consolidate_leaves_the_destination_as_it_was(sharded_ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out.ckpt"

    def killed(*flags: str) -> None:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.fault_injection",
                "lightning_sharded.cli",
                "consolidate",
                str(sharded_ckpt),
                str(dst),
                *flags,
            ],
            env={**os.environ, FAULT_ENV: "before_publish", "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == -9, proc.stderr  # SIGKILL with the output complete, not yet published

    killed()
    assert not dst.exists() and len(leftovers(dst)) == 1  # a hidden staging file, never `out.ckpt`
    dst.write_text("previous")
    killed("--force")
    assert dst.read_text() == "previous"
    consolidate(sharded_ckpt, dst, overwrite=True)  # the next write removes what the killed ones left
    assert leftovers(dst) == []
    assert_full(dst)


# ------------------------------------------------------------------------------- inspect


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_inspect_checks_presence_and_sizes(sharded_ckpt: Path, damage: str) -> None:
    shard = sharded_ckpt / "__0_0.distcp"
    size = shard.stat().st_size
    if damage == "missing":
        shard.unlink()
        what = "is missing"
    else:
        truncate(shard, 100)
        what = f"is truncated: 100 bytes, the manifest says {size}"
    with pytest.raises(CheckpointError, match=rf"is damaged: '__0_0.distcp' \(written by rank 0\) {what}"):
        inspect_checkpoint(sharded_ckpt)
    (sharded_ckpt / MANIFEST_NAME).unlink()  # without a manifest, from `.metadata`
    with pytest.raises(
        CheckpointError, match=r"is damaged: '__0_0.distcp' \(written by rank 0\) is (missing|trunc)"
    ):
        inspect_checkpoint(sharded_ckpt)


def test_inspect_reads_no_shard_data_so_a_flipped_bit_there_is_verify_s_to_find(sharded_ckpt: Path) -> None:
    # inspect checks presence and sizes and reads the index, never a shard file's bytes (no checksums).
    shard = sharded_ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x04
    shard.write_bytes(bytes(data))
    info = inspect_checkpoint(sharded_ckpt)
    assert info.entries
    with pytest.raises(CheckpointError, match=r"'__0_0.distcp' \(written by rank 0\) is corrupted"):
        verify_checkpoint(sharded_ckpt)


def _bytes_read() -> int:
    """Bytes this process has read through ``read`` calls so far (``rchar``: page cache or disk)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="no /proc/self/io here")
def test_inspect_reads_the_index_and_the_small_entries_never_a_tensor_s_bytes(tmp_path: Path) -> None:
    # What `inspect --help` says it reads: `.metadata`, the manifest, `meta.pt` and the non-tensor
    # entries (the param groups, bytes each); not the shards' tensors, nor their checksums.
    from tests.checkpoint.one_process import save_sharded, stepped

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    optimizer = torch.optim.Adam(model.parameters())
    stepped(model, optimizer, 1024)
    path = save_sharded(tmp_path / "ckpt", model, optimizer)  # 8 MiB of weights, 24 with Adam's state
    inspect_checkpoint(path)  # once, so that what the first call imports is not counted
    before = _bytes_read()
    info = inspect_checkpoint(path)
    read = _bytes_read() - before
    shards = sum(p.stat().st_size for p in path.glob("*.distcp"))
    assert info.total_size > 24 << 20 and shards > info.total_size
    assert read < 1 << 20, f"inspect read {read} bytes of a checkpoint of {shards}"


def test_inspect_counts_files_as_verify_does(sharded_ckpt: Path, tmp_path: Path) -> None:
    full = consolidate(sharded_ckpt, tmp_path / "full.ckpt")
    (sharded_ckpt / "notes.txt").write_text("not part of the checkpoint")
    stock = tmp_path / "stock"
    shutil.copytree(sharded_ckpt, stock)
    (stock / MANIFEST_NAME).unlink()
    for path in (sharded_ckpt, stock, full):
        info, report = inspect_checkpoint(path), verify_checkpoint(path)
        assert (info.files, info.disk_size) == (report.files, report.bytes), path
    # .metadata, meta.pt, two shard files and the manifest, as `ls` shows them (notes.txt is no part)
    info = inspect_checkpoint(sharded_ckpt)
    on_disk = [p for p in sharded_ckpt.rglob("*") if p.is_file() and p.name != "notes.txt"]
    assert (info.files, info.disk_size) == (5, sum(p.stat().st_size for p in on_disk))
    assert inspect_checkpoint(stock).files == 4  # no manifest
    assert inspect_checkpoint(full).disk_size == full.stat().st_size


def test_inspect_shows_values_not_sizes(sharded_ckpt: Path, tmp_path: Path) -> None:
    info = inspect_checkpoint(sharded_ckpt)
    values = {e.key: (e.dtype, e.value, e.size) for e in info.entries if e.value is not None}
    assert values == {
        "optimizer_0.param_groups.0.lr": ("float", "0.1", 0),
        "optimizer_0.param_groups.0.params": ("list", "['layer.weight', 'layer.bias']", 0),
    }
    tensors = [e for e in info.entries if e.value is None]
    assert info.total_size == sum(e.size for e in tensors) == 2 * (192 + 32) + 2 * 4
    full = inspect_checkpoint(consolidate(sharded_ckpt, tmp_path / "full.ckpt"))
    assert {e.key: e.value for e in full.entries if e.value is not None} == {
        "optimizer_states.0.param_groups.0.lr": "0.1",
        "optimizer_states.0.param_groups.0.params": "[0, 1]",
    }
    assert full.total_size == info.total_size


def test_a_file_that_is_not_a_checkpoint_gets_one_message_everywhere(tmp_path: Path) -> None:
    text, empty, pickled = tmp_path / "notes.txt", tmp_path / "empty.ckpt", tmp_path / "list.pt"
    text.write_text("hello, not a checkpoint\n")
    empty.write_bytes(b"")
    torch.save([1, 2], pickled)
    tail = "Make sure the path points to either a directory with sharded checkpoint files"
    for path, why in (
        (text, r"it is not a torch.save file \(it starts with b'hell', not a zip archive or a pickle\)"),
        (empty, r"it is empty \(0 bytes\)"),
    ):
        for call in (
            inspect_checkpoint,
            verify_checkpoint,
            load_checkpoint,
            lambda p: consolidate(p, tmp_path / "o"),
        ):
            with pytest.raises(
                CheckpointError, match=rf"^The file '.*{path.name}' is not a checkpoint: {why}\. {tail}"
            ):
                call(path)
    for call in (inspect_checkpoint, load_checkpoint):
        with pytest.raises(
            CheckpointError, match=r"^The file '.*list.pt' is not a checkpoint: it holds a list"
        ):
            call(pickled)
    assert not (tmp_path / "o").exists()


def test_legacy_torch_save_files_are_still_full_checkpoints(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3}, legacy, _use_new_zipfile_serialization=False)
    assert legacy.read_bytes()[:2] == pickle.PROTO + bytes([2])  # the legacy format: a pickle first
    assert load_checkpoint(legacy)["epoch"] == 3
