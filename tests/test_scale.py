"""What one rank's save and load cost at N = 8 and 64 simulated ranks (``python -m benchmarks.scale
--quick``).

Counts only, never times. The point is what must not grow with the world size: a rank other than 0
never reads the small files every rank needs (``.metadata``, ``meta.pt``, the manifest: read once, on
rank 0, and broadcast), and touches nothing of the other ranks'; rank 0's operations on those shared
files, and every rank's collectives, stay the same at 8 and at 64 ranks. On S3 the same, in requests:
our layer adds none to a save on a rank other than 0 and one (the size of its own shard) to a load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SMALL_FILES = (".metadata", "meta.pt", "manifest", "index layout")
#: The per-rank index files: a rank's own, and the others'.
INDEXES = ("own index", "other indexes")
SHARED = (*SMALL_FILES, "directory")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("scale")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.scale",
            "--quick",
            "--no-times",
            "--no-stock",
            "--out",
            str(out),
            "--dir",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "scale.json").read_text())  # type: ignore[no-any-return]


def ops(
    figures: dict[str, Any], section: str, who: tuple[str, ...], classes: tuple[str, ...]
) -> dict[str, int]:
    """``{"<origin> <kind> <class>": n}`` of one rank's run, for the origins and file classes asked."""
    return {
        f"{origin} {kind} {cls}": n
        for origin in who
        for kind, per_class in figures[section].get(origin, {}).items()
        for cls, n in per_class.items()
        if cls in classes
    }


def runs(report: dict[str, Any], backend: str) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """``(phase, rank, figures at N=8, figures at N=64)``; rank is "0" or "last" (N-1)."""
    small, large = report[backend]["8"]["ours"], report[backend]["64"]["ours"]
    return [
        (phase, label, small[phase][r8], large[phase][r64])
        for phase in ("save", "load")
        for label, r8, r64 in (("0", "0", "0"), ("last", "7", "63"))
    ]


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_no_rank_other_than_0_reads_the_shared_small_files(report: dict[str, Any], backend: str) -> None:
    section = "s3" if backend == "s3" else "files"
    for phase, rank, small, large in runs(report, backend):
        if rank != "last":
            continue
        for figures in (small, large):
            # Neither our layer nor DCP (given the index rank 0 read) reads them on this rank.
            reads = {
                k: n
                for k, n in ops(figures, section, ("ours", "dcp", "other"), SMALL_FILES).items()
                if k.split()[1] in ("read", "GET")
            }
            assert reads == {}, (phase, reads)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_per_rank_operations_on_shared_files_do_not_grow_with_n(report: dict[str, Any], backend: str) -> None:
    section = "s3" if backend == "s3" else "files"
    for phase, rank, small, large in runs(report, backend):
        # Rank 0 lists the checkpoint once (one stat per file, linear there by design); every other
        # count of ours, on every rank, is the same at 8 and at 64 ranks.
        classes = SHARED if rank == "0" else (*SHARED, "own shard", "other shards", *INDEXES)
        at_8, at_64 = ops(small, section, ("ours",), classes), ops(large, section, ("ours",), classes)
        assert at_8 == at_64, (phase, rank, at_8, at_64)
        if rank == "last":
            # Loading at the world size it was saved at, a rank reads its own index file, no other.
            assert ops(large, section, ("ours",), ("other shards", "other indexes")) == {}, (
                phase,
                large[section],
            )
        assert {k: n for k, (n, _) in small["collectives"].get("ours", {}).items()} == {
            k: n for k, (n, _) in large["collectives"].get("ours", {}).items()
        }, (phase, rank)


def test_our_s3_requests_per_rank_other_than_0(report: dict[str, Any]) -> None:
    every = (
        ".metadata",
        "meta.pt",
        "manifest",
        "index layout",
        "directory",
        "own shard",
        "other shards",
        *INDEXES,
    )
    for phase, rank, _, large in runs(report, "s3"):
        if rank != "last":
            continue
        ours = ops(large, "s3", ("ours",), every)
        # A save: its own index file (DCP puts the shard). A load: the sizes of its own shard and index
        # file (HEADs: the index file's size is asked for twice), and its own index file (one GET).
        expected = (
            {"ours PUT own index": 1}
            if phase == "save"
            else {"ours HEAD own shard": 1, "ours HEAD own index": 2, "ours GET own index": 1}
        )
        assert ours == expected, (phase, ours)


def test_rank_0_gathers_the_manifest_entries_alone(report: dict[str, Any]) -> None:
    for n in ("8", "64"):
        save = report["local"][n]["ours"]["save"]
        last = save[str(int(n) - 1)]["collectives"]["ours"]
        # The entries travel to rank 0 only: what the last rank sends is one small report, not N.
        assert last["gather_object"][1] < 400, last
        assert "all_gather_object" not in last, last


def test_manifest_grows_linearly_with_a_small_constant(report: dict[str, Any]) -> None:
    # Each rank adds two entries: its shard file and its per-rank index file.
    small, large = (report["local"][n]["ours"]["manifest_bytes"] for n in ("8", "64"))
    per_rank = (large - small) / (64 - 8)
    assert 0 < per_rank < 2 * 120, per_rank


def test_a_reader_given_the_index_never_reads_metadata(tmp_path: Path) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    from lightning_sharded.checkpoint.backends.dcp_reader import DirectReader, fsspec_reader
    from lightning_sharded.checkpoint.backends.dcp_writer import ChecksummingWriter

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}}
    _save_state_dict(state, ChecksummingWriter(tmp_path), no_dist=True)
    index = DirectReader(tmp_path).read_metadata()
    (tmp_path / ".metadata").unlink()  # any read of it would now fail
    for reader in (DirectReader(tmp_path, metadata=index), fsspec_reader(f"file://{tmp_path}", index)):
        given = reader.read_metadata()
        assert given.state_dict_metadata == index.state_dict_metadata
        assert given.storage_meta.load_id == reader.load_id  # this load's id, on a copy
        target = {"model": {"w": torch.zeros(2, 3)}}
        _load_state_dict(target, reader, no_dist=True)
        assert torch.equal(target["model"]["w"], state["model"]["w"])
    with pytest.raises(FileNotFoundError):
        DirectReader(tmp_path).read_metadata()


def test_rank_0s_s3_requests_do_not_grow_with_n(report: dict[str, Any]) -> None:
    # Rank 0 checks every file of the checkpoint on a save (the seal) and a load (the manifest's
    # sizes): by listing each folder (one LIST page per 1,000 files), never a HEAD per rank's file.
    every = (*SHARED, "own shard", "other shards", *INDEXES)
    for phase, rank, small, large in runs(report, "s3"):
        if rank != "0":
            continue
        at_8, at_64 = ops(small, "s3", ("ours",), every), ops(large, "s3", ("ours",), every)
        assert at_8 == at_64, (phase, at_8, at_64)
