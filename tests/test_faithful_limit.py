"""The benchmarks' faithful limit (``benchmarks.faithful``) and the resume profile (``benchmarks.profile``,
``benchmarks.timing.PhaseTimers``), in one process: what the probes write and read is what a save wrote
and a resume read, and the profile's phases add up to the time they profile.

No timing assertions: bytes, files, extents and the arithmetic of the timers (with sleeps long enough to
dominate their overhead).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from benchmarks import disk, faithful, profile
from benchmarks.report import above_the_bars
from benchmarks.timing import PhaseTimers

FILES = {
    "__0_0.distcp": (40 << 20) + 123,  # above the write-behind window: written behind
    "__1_0.distcp": 3 << 20,
    ".metadata": 5000,
    "meta.pt": 2669,
    "lightning_sharded.json": 858,
    "rank_state/rank-00000.pt": 14313,
    "rank_state/rank-00001.pt": 14249,
}


def _checkpoint(root: Path) -> Path:
    ckpt = root / "saved.ckpt"
    for rel, size in FILES.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(b"x" * size)
    return ckpt


def _listing(ckpt: Path) -> dict[str, int]:
    return {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in ckpt.rglob("*") if p.is_file()}


def test_the_layout_gives_each_rank_the_files_its_save_writes(tmp_path: Path) -> None:
    layout = faithful.layout_of(_checkpoint(tmp_path))
    assert {f.path: f.size for f in layout.files} == FILES
    assert [f.path for f in layout.own(0)] == ["__0_0.distcp", "rank_state/rank-00000.pt"]
    assert [f.path for f in layout.own(1)] == ["__1_0.distcp", "rank_state/rank-00001.pt"]
    # rank 0 writes the rest once the shards are written: the DCP index first, the manifest last
    assert [f.path for f in layout.last()] == [".metadata", "meta.pt", "lightning_sharded.json"]
    assert layout.directories() == ["rank_state"]
    assert layout.bytes_of(0) + layout.bytes_of(1) == sum(FILES.values())


@pytest.mark.parametrize("behind", [True, False])
def test_the_write_probe_writes_the_saves_files_from_each_ranks_bytes(tmp_path: Path, behind: bool) -> None:
    """Two ranks (threads meeting at a barrier) write a checkpoint of the saved one's layout: the same
    files at the same sizes, each rank's from its own bytes, published by a rename (no staging left)."""
    layout = faithful.layout_of(_checkpoint(tmp_path))
    target = tmp_path / "probe.ckpt"
    own = {
        0: [memoryview(bytes(range(256)) * 4096), memoryview(b"\x01" * 1000)],
        1: [memoryview(b"\x02\x03" * 5000)],
    }
    meet = threading.Barrier(2)
    written: dict[int, disk.Written] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            source = disk.Source(own[r])
            written[r] = faithful.write_like(layout, target, r, source, behind=behind, meet=meet.wait)
        except BaseException as err:  # reported below
            errors.append(err)
            meet.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert _listing(target) == FILES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe.ckpt", "saved.ckpt"]
    for r in (0, 1):
        assert written[r].nbytes == layout.bytes_of(r)
    # rank 0's shard: its first buffer, then its second, then the first again...
    expected = (bytes(own[0][0]) + bytes(own[0][1])) * 50
    assert (target / "__0_0.distcp").read_bytes() == expected[: FILES["__0_0.distcp"]]
    assert (target / "__1_0.distcp").read_bytes() == (b"\x02\x03" * 5000 * 400)[: FILES["__1_0.distcp"]]
    assert written[0].dirty_at_fsync >= 0 and written[0].fsync_s >= 0


def _saved_state(path: Path) -> dict[str, object]:
    from torch.distributed.checkpoint import FileSystemWriter, save

    state = {
        "state_dict": {"big": torch.arange(1 << 19, dtype=torch.float32), "small": torch.ones(3)},
        "optimizer_0": {"state": {"big": {"exp_avg": torch.full((1 << 19,), 2.0)}}, "lr": 0.1},
    }
    save(state, storage_writer=FileSystemWriter(path))
    return state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("reader", ["torch", "ours"])
def test_the_read_probe_reads_each_byte_the_resume_read_once(tmp_path: Path, reader: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader, load

    from lightning_sharded.checkpoint.backends.dcp_reader import DirectReader

    ckpt = tmp_path / "dcp"
    state = _saved_state(ckpt)
    recorded: list[faithful.Extent] = []
    storage = (DirectReader if reader == "ours" else FileSystemReader)(ckpt)
    with faithful.recording_reads(recorded):
        load(state, storage_reader=storage)
    stored = FileSystemReader(ckpt).read_metadata().storage_data
    assert sorted((e.path, e.offset, e.length) for e in recorded) == sorted(
        (info.relative_path, info.offset, info.length) for info in stored.values()
    )  # every item once: ours hands small items to torch's path, which is not counted again
    fresh = sorted(e.fresh for e in recorded if e.length > 1 << 20)
    assert fresh == [False, True]  # the optimizer's moment is made by a resume, the model's weight is not

    extents = faithful.resume_extents(recorded + recorded, ckpt, rank=0)  # read twice: once is enough
    assert sum(e.length for e in extents) == sum(p.stat().st_size for p in ckpt.iterdir())
    assert faithful.read_like(ckpt, extents) == sum(e.length for e in extents)
    faithful.read_into_resume_memory(ckpt, extents)()
    assert [e.path for e in faithful.resume_extents([], ckpt, rank=1)] == []  # no small file of its own

    beyond = [faithful.Extent(extents[0].path, 0, (ckpt / extents[0].path).stat().st_size + 1)]
    with pytest.raises(OSError, match="ended at"):
        faithful.read_like(ckpt, beyond)


def test_the_copy_probe_reads_every_source_and_writes_a_file_of_the_size_asked(tmp_path: Path) -> None:
    sources = [tmp_path / "a", tmp_path / "b"]
    sources[0].write_bytes(b"a" * (9 << 20))
    sources[1].write_bytes(b"b" * 1000)
    target = tmp_path / "out"
    assert faithful.copy_like(sources, target, (9 << 20) + 500) == (9 << 20) + 1000
    assert target.read_bytes() == b"a" * (9 << 20) + b"b" * 500
    assert faithful.copy_like(sources, tmp_path / "more", (10 << 20)) == (9 << 20) + 1000
    assert (tmp_path / "more").stat().st_size == 10 << 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "more", "out"]


class _Work:
    """A root that calls a phase that calls another, and a phase run on a thread of its own."""

    def root(self) -> None:
        time.sleep(0.02)
        self.outer()
        thread = threading.Thread(target=self.threaded)
        thread.start()
        thread.join()

    def outer(self) -> None:
        time.sleep(0.03)
        self.inner()

    def inner(self) -> None:
        time.sleep(0.05)

    def threaded(self) -> None:
        time.sleep(0.04)


def test_the_phases_own_seconds_add_up_to_the_roots_and_threads_stay_apart() -> None:
    timers = PhaseTimers(roots=["root"])
    phases = [(_Work, attr, attr) for attr in ("root", "outer", "inner", "threaded")]
    work = _Work()
    with timers.installed(phases):
        work.inner()  # outside any root: inclusive only
        work.root()
    assert timers.calls == {"inner": 2, "root": 1, "outer": 1, "threaded": 1}
    assert set(timers.own) == {"root", "outer", "inner"}
    assert sum(timers.own.values()) == pytest.approx(timers.seconds["root"], rel=1e-9)
    assert timers.own["inner"] == pytest.approx(timers.seconds["inner"] / 2, rel=0.5)
    assert timers.own["outer"] == pytest.approx(timers.seconds["outer"] - timers.own["inner"], rel=1e-6)
    assert timers.own["root"] >= 0.06  # its own sleep and the wait for the thread, not its callees'
    assert set(timers.threads) == {"threaded"} and timers.threads["threaded"] >= 0.04


def test_every_timed_phase_exists_and_the_profile_says_when_it_does_not_add_up() -> None:
    from benchmarks.timing import resolve

    missing = [
        (p.owner, p.attr)
        for p in profile.PHASES
        if p.owner != "STRATEGY" and not hasattr(resolve(p.owner), p.attr)
    ]
    assert not missing, f"timed phases that no longer exist (renamed?): {missing}"
    assert set(profile.ROOTS) <= {p.label for p in profile.PHASES}

    def record(own: dict[str, float], wall: float) -> dict[str, object]:
        return {"load own": own, "load threads": {"read threads: CRC-32": 0.5}, "load s": wall}

    whole = {profile.ROOTS[0]: 0.1, "ours: DirectReader reads (waiting)": 0.8}
    good = [{"phases-ours-mp": record(whole, 0.9)}, {"phases-ours-mp": record(whole, 0.9)}]
    section = profile.section(good)
    assert not section["problems"]
    groups = section["rows"]["ShardedModelParallelStrategy"][1]["groups"]
    assert groups[profile.READING] == 0.8 and groups[profile.LIGHTNING] == 0.1
    short = [{"phases-ours-fsdp": record(whole, 1.2)}, {"phases-ours-fsdp": record(whole, 0.9)}]
    assert [p.split(":")[0] for p in profile.section(short)["problems"]] == ["ShardedFSDPStrategy, rank 0"]


def test_a_save_or_load_above_its_bar_is_flagged_not_reported() -> None:
    rows = {
        "ours-mp": {"save / disk write": 1.03, "load / disk read": 0.7, "save / whole-file write": 1.8},
        "ours-fsdp": {"save / disk write": 0.9, "load / disk read": 1.2},
    }
    assert above_the_bars(rows) == ["ours-mp: save / disk write 1.03", "ours-fsdp: load / disk read 1.20"]
