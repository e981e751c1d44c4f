"""Every way a checkpoint can be wrong, caught by verify and by loads, with the message checked.

The sharded checkpoint is a real 2-rank DCP save (``sharded_ckpt``, see conftest); each test damages a
private copy. A failed load or verify never changes anything on disk.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_sharded import CheckpointError, load_checkpoint, verify_checkpoint
from lightning_sharded.checkpoint import MANIFEST_NAME, read_manifest
from lightning_sharded.checkpoint.tools import consolidate_checkpoint, inspect_checkpoint


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root's parent, with a hash of its bytes."""
    return {
        str(p.relative_to(root.parent)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(root.parent.rglob("*"))
        if p.is_file()
    }


def flip_bit(file: Path, offset: int | None = None) -> None:
    data = bytearray(file.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x10
    file.write_bytes(bytes(data))


def truncate(file: Path, keep: int | None = None) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2 if keep is None else keep])


def expect_error(
    call: Callable[[], object], kind: type[BaseException], pattern: str, root: Path | None = None
) -> str:
    before = snapshot(root) if root is not None else None
    with pytest.raises(kind) as info:
        call()
    message = str(info.value)
    assert re.search(pattern, message), message
    if root is not None:
        assert snapshot(root) == before, "a failed load changed files on disk"
    return message


def test_intact_checkpoint_verifies(sharded_ckpt: Path) -> None:
    report = verify_checkpoint(sharded_ckpt)
    manifest = read_manifest(sharded_ckpt)
    assert manifest is not None
    assert report.has_manifest and report.files == len(manifest.files) + 1 == 5  # the manifest counts
    assert report.bytes == manifest.total_size + (sharded_ckpt / MANIFEST_NAME).stat().st_size
    assert report.notes == []


def test_nonexistent_path(tmp_path: Path) -> None:
    for call in (load_checkpoint, verify_checkpoint, inspect_checkpoint):
        expect_error(
            lambda c=call: c(tmp_path / "nope"), FileNotFoundError, r"no checkpoint at .*nope.*does not exist"
        )  # type: ignore[misc]


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    expect_error(
        lambda: load_checkpoint(tmp_path / "empty"),
        CheckpointError,
        r"'.*empty' is empty: it holds no checkpoint",
    )


def test_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("hi")
    msg = expect_error(lambda: verify_checkpoint(tmp_path / "d"), CheckpointError, r"is not a checkpoint")
    assert "notes.txt" in msg and "Make sure the path points to" in msg


@pytest.mark.parametrize("call", ["verify", "load"])
def test_missing_shard(sharded_ckpt: Path, call: str) -> None:
    (sharded_ckpt / "__1_0.distcp").unlink()
    fn = verify_checkpoint if call == "verify" else load_checkpoint
    expect_error(
        lambda: fn(sharded_ckpt),
        CheckpointError,
        r"is damaged: '__1_0.distcp' \(written by rank 1\) is missing\. Restore it from a copy",
        sharded_ckpt,
    )


@pytest.mark.parametrize("call", ["verify", "load"])
def test_truncated_shard(sharded_ckpt: Path, call: str) -> None:
    size = (sharded_ckpt / "__0_0.distcp").stat().st_size
    truncate(sharded_ckpt / "__0_0.distcp", 100)
    fn = verify_checkpoint if call == "verify" else load_checkpoint
    expect_error(
        lambda: fn(sharded_ckpt),
        CheckpointError,
        rf"'__0_0.distcp' \(written by rank 0\) is truncated: 100 bytes, the manifest says {size}",
        sharded_ckpt,
    )


def test_bit_flip_caught_by_verify_and_checked_loads(sharded_ckpt: Path) -> None:
    flip_bit(sharded_ckpt / "__1_0.distcp")
    pattern = (
        r"'__1_0.distcp' \(written by rank 1\) is corrupted: its crc32 is [0-9a-f]{8}, the manifest says"
    )
    expect_error(lambda: verify_checkpoint(sharded_ckpt), CheckpointError, pattern, sharded_ckpt)
    expect_error(lambda: load_checkpoint(sharded_ckpt, verify=True), CheckpointError, pattern, sharded_ckpt)
    expect_error(
        lambda: consolidate_checkpoint(sharded_ckpt, sharded_ckpt.parent / "out.ckpt", verify=True),
        CheckpointError,
        pattern,
        sharded_ckpt,
    )


def test_every_bad_file_is_named(sharded_ckpt: Path) -> None:
    flip_bit(sharded_ckpt / "__1_0.distcp")
    (sharded_ckpt / "__0_0.distcp").unlink()
    msg = expect_error(
        lambda: verify_checkpoint(sharded_ckpt), CheckpointError, r"'__0_0.distcp' .* is missing"
    )
    assert re.search(r"Also: '__1_0.distcp' \(written by rank 1\) is corrupted", msg), msg


def test_missing_dcp_metadata(sharded_ckpt: Path) -> None:
    (sharded_ckpt / ".metadata").unlink()
    expect_error(
        lambda: load_checkpoint(sharded_ckpt),
        CheckpointError,
        r"has no `\.metadata` file, which torch\.distributed\.checkpoint writes last.*earlier checkpoint",
        sharded_ckpt,
    )


def test_missing_lightning_metadata(sharded_ckpt: Path) -> None:
    (sharded_ckpt / "meta.pt").unlink()
    expect_error(
        lambda: load_checkpoint(sharded_ckpt),
        CheckpointError,
        r"has no `meta\.pt`.*epoch, global step.*restart progress silently",
        sharded_ckpt,
    )


def test_corrupt_lightning_metadata_without_manifest(sharded_ckpt: Path) -> None:
    (sharded_ckpt / MANIFEST_NAME).unlink()
    truncate(sharded_ckpt / "meta.pt", 10)
    expect_error(
        lambda: load_checkpoint(sharded_ckpt),
        CheckpointError,
        r"Lightning metadata '.*meta\.pt' .* cannot be read .*lightning-sharded verify",
        sharded_ckpt,
    )


def test_without_manifest_verify_checks_what_it_can(sharded_ckpt: Path) -> None:
    (sharded_ckpt / MANIFEST_NAME).unlink()
    report = verify_checkpoint(sharded_ckpt)
    assert not report.has_manifest
    assert "no manifest" in report.notes[0] and "no checksums to compare" in report.notes[0]
    assert load_checkpoint(sharded_ckpt)["epoch"] == 1
    truncate(sharded_ckpt / "__1_0.distcp", 50)
    expect_error(
        lambda: load_checkpoint(sharded_ckpt),
        CheckpointError,
        r"'__1_0.distcp' \(written by rank 1\) is truncated: 50 bytes, `\.metadata` needs \d+",
        sharded_ckpt,
    )


def test_damaged_manifest(sharded_ckpt: Path) -> None:
    (sharded_ckpt / MANIFEST_NAME).write_text("{")
    expect_error(lambda: load_checkpoint(sharded_ckpt), CheckpointError, r"not valid JSON", sharded_ckpt)


@pytest.fixture
def full_file(sharded_ckpt: Path) -> Path:
    return consolidate_checkpoint(sharded_ckpt, sharded_ckpt.parent / "full.ckpt", progress=False)


def test_full_file_verifies(full_file: Path) -> None:
    report = verify_checkpoint(full_file)
    assert report.kind.value == "full" and report.files == 1


def test_full_file_truncated(full_file: Path) -> None:
    truncate(full_file)
    expect_error(
        lambda: verify_checkpoint(full_file), CheckpointError, r"is not a complete torch\.save archive"
    )
    expect_error(
        lambda: load_checkpoint(full_file),
        CheckpointError,
        r"'.*full\.ckpt' cannot be read .* truncated or corrupt",
    )
    for read in (load_checkpoint, inspect_checkpoint):
        with pytest.raises(CheckpointError) as err:
            read(full_file)
        assert re.search(r"cannot be read \((\w+Error): ", str(err.value)), str(err.value)
        assert not re.search(r"(\w+Error): \1:", str(err.value)), str(err.value)  # the type once


def test_full_file_bit_flip(full_file: Path) -> None:
    import zipfile

    with zipfile.ZipFile(full_file) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data/0"))
    flip_bit(full_file, info.header_offset + 200)  # inside the first tensor's bytes
    expect_error(
        lambda: verify_checkpoint(full_file),
        CheckpointError,
        r"record '.*data/\d+' does not match the CRC-32",
    )


def test_failed_load_of_crashed_first_save_is_file_not_found(
    fault_run: tuple[Path, dict[str, object]],
) -> None:
    ckpt = fault_run[0] / "fresh_before_publish" / "crashed" / "ckpt"
    expect_error(lambda: load_checkpoint(ckpt), FileNotFoundError, "does not exist", ckpt)
    assert any(p.name.startswith(".ckpt.staging-") for p in ckpt.parent.iterdir())


def test_loads_read_the_old_version_left_between_renames(fault_run: tuple[Path, dict[str, object]]) -> None:
    ckpt = fault_run[0] / "fallback_between_renames" / "crashed" / "ckpt"
    before = snapshot(ckpt)
    assert load_checkpoint(ckpt)["epoch"] == 1
    assert verify_checkpoint(ckpt).path.name.startswith(".ckpt.old-")
    assert snapshot(ckpt) == before
    assert not os.path.exists(ckpt)


def test_bit_flip_without_verify_is_not_silently_different_in_structure(sharded_ckpt: Path) -> None:
    # Without verify, a load checks presence and sizes only: a flipped bit in tensor data loads (that is
    # what verify=True is for), and only that value differs: the keys, shapes, dtypes and every other
    # value are the intact checkpoint's.
    from tests._compare import assert_same
    from tests.distributed.fault_driver import expected

    intact = load_checkpoint(sharded_ckpt)
    weight = expected(1)["state_dict"]["layer.weight"]
    shard = sharded_ckpt / "__0_0.distcp"
    data = shard.read_bytes()
    rows = weight[: weight.shape[0] // 2]  # rank 0's part of the weight
    at = data.find(rows.numpy().tobytes())
    assert at > 0 and data.count(rows.numpy().tobytes()) == 1, "rank 0's weight bytes not found once"
    element = 7
    flip_bit(shard, at + 4 * element + 2)  # a bit of one float32's mantissa
    loaded = load_checkpoint(sharded_ckpt)
    changed = loaded["state_dict"]["layer.weight"]
    assert changed.dtype == weight.dtype and changed.shape == weight.shape
    differs = (changed != weight).flatten().nonzero().flatten().tolist()
    assert differs == [element], differs
    loaded["state_dict"]["layer.weight"] = weight
    assert_same(loaded, intact)


def test_corrupted_record_without_manifest_names_file_rank_and_key(sharded_ckpt: Path) -> None:
    # No manifest, sizes intact: DCP fails to deserialize; the error still names file, rank and entry.
    (sharded_ckpt / MANIFEST_NAME).unlink()
    shard = sharded_ckpt / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[0:4] = b"XXXX"  # the first record's zip signature
    shard.write_bytes(bytes(data))
    expect_error(
        lambda: load_checkpoint(sharded_ckpt),
        CheckpointError,
        r"failed: '__1_0.distcp' \(written by rank 1\) is corrupted: its entry '[\w.]+' at byte 0",
        sharded_ckpt,
    )


@pytest.mark.parametrize(
    ("seen_by", "suffix"),
    [
        ((0, 1), None),  # rank 0 and the writer, rank 1: both checkers saw it
        ((1,), "(seen by rank(s) 1 of 3; rank 1's report)"),  # rank 0 did not
        ((0,), "(seen by rank(s) 0 of 3; rank 0's report)"),  # the writer did not
        ((0, 1, 2), None),  # every rank
    ],
)
def test_a_problem_only_some_of_its_checkers_saw_says_which_ranks_saw_it(
    monkeypatch: pytest.MonkeyPatch, seen_by: tuple[int, ...], suffix: str | None
) -> None:
    """A file's presence and size are checked by rank 0 and by the rank that wrote it. Where only one of
    them reports a problem (a file system that differs between nodes), the error says which ranks saw
    it; where both did, it is the plain error. Every rank raises the same (``raise_agreed``)."""
    from lightning_sharded.checkpoint import collective, integrity
    from lightning_sharded.checkpoint.manifest import FileEntry, Manifest
    from lightning_sharded.checkpoint.problems import Problem

    manifest = Manifest(
        files=[FileEntry("__0_0.distcp", 10, "00000000", 0), FileEntry("__1_0.distcp", 10, "00000000", 1)],
        world_size=3,
    )
    missing = Problem("__1_0.distcp", "is missing", 1)
    reports = [([missing] if r in seen_by else [], None) for r in range(3)]
    monkeypatch.setattr(collective, "all_gather", lambda report, where: reports)
    for rank in range(3):
        with pytest.raises(CheckpointError) as err:
            integrity.raise_agreed(reports[rank], collective.Ranks(rank, 3, 0, None), "ckpt", manifest)
        message = str(err.value)
        assert "'__1_0.distcp' (written by rank 1) is missing" in message, message
        assert message.endswith(suffix) if suffix else "seen by rank" not in message, message


def test_without_a_manifest_rank_0_alone_checks_a_file_s_presence(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint without a manifest (stock Lightning's) names no writer: rank 0 is a file's only
    checker, so a problem it alone saw is the plain error."""
    from lightning_sharded.checkpoint import collective, integrity
    from lightning_sharded.checkpoint.problems import Problem

    missing = Problem("__1_0.distcp", "is missing (`.metadata` references it)", None)
    reports = [([missing], None), ([], None)]
    monkeypatch.setattr(collective, "all_gather", lambda report, where: reports)
    with pytest.raises(CheckpointError) as err:
        integrity.raise_agreed(reports[1], collective.Ranks(1, 2, 0, None), "ckpt", None)
    assert "'__1_0.distcp' is missing" in str(err.value) and "seen by rank" not in str(err.value), err.value
