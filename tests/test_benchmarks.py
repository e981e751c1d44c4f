"""Smoke test of the benchmark suite: ``python -m benchmarks.run --quick`` runs end to end (2 real ranks).

No timing assertions: only that every section is there and every ratio is a finite positive number, that
the disk's probes wrote the files the saves wrote and read what the resumes read (bytes), and that each
rank's resume profile adds up to its wall time.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("disk", "throughput", "async", "memory", "hooks", "verify", "training", "tools", "profile")


@pytest.mark.slow
def test_quick_benchmark_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--quick",
            "--out",
            str(out),
            "--dir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "results.json").read_text())
    assert (out / "results.png").stat().st_size > 0
    assert not report["errors"], report["errors"]
    for section in SECTIONS:
        ratios = report[section]["ratios"]
        assert ratios, f"section {section!r} has no ratios"
        bad = {k: v for k, v in ratios.items() if not (math.isfinite(v) and v > 0)}
        assert not bad, f"{section}: {bad}"
    rows = report["throughput"]["rows"]
    for case in ("torch", "dcp", "stock-mp", "stock-fsdp"):
        assert case in rows, f"no throughput figures for {case}"
    disk = report["disk"]
    assert disk["write GB/s"] > 0 and disk["read GB/s"] > 0
    lightning_cases = ("stock-mp", "stock-fsdp", "ours-mp", "ours-fsdp")
    # The write probe wrote exactly the files of each save (their bytes), the read probe what each
    # rank's resume read: about half the checkpoint per rank (its shards, a few shared bytes), once.
    assert disk["written / checkpoint bytes"] == dict.fromkeys(lightning_cases, 1.0)
    assert sorted(disk["read bytes per rank"]) == sorted(lightning_cases)
    for case, rank_bytes in disk["read bytes per rank"].items():
        total = rows[case]["bytes"]
        assert 0.95 * total <= sum(rank_bytes) <= 1.05 * total, (case, rank_bytes, total)
        assert all(b >= 0.4 * total for b in rank_bytes), (case, rank_bytes, total)
    from benchmarks.report import PAIRED_READ, PAIRED_WRITE

    for case in lightning_cases:  # every save and resume against the probes of its own call
        pairs = report["throughput"]["pairs"][case]
        assert [len(pairs[PAIRED_WRITE]), len(pairs[PAIRED_READ])] == [report["config"]["repeats"]] * 2
        assert rows[case][PAIRED_READ] == pytest.approx(statistics.median(pairs[PAIRED_READ]))
    from benchmarks.profile import READING, TORCH_READS

    profiles = report["profile"]
    assert not profiles["problems"], profiles["problems"]
    assert set(profiles["rows"]) == {"ShardedModelParallelStrategy", "ShardedFSDPStrategy"}
    for label, ranks in profiles["rows"].items():
        for profile in ranks:
            assert profile["sum s"] == pytest.approx(profile["wall s"], rel=0.01), label
            reads = profile["groups"][READING] + profile["groups"][TORCH_READS]
            assert reads > 0, (label, profile["groups"])
    markdown = (out / "results.md").read_text()
    assert "**disk write** (the bar)" in markdown and "**sum of the phases**" in markdown
    assert "/ disk" in proc.stdout and "resume profile" in proc.stdout


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_the_writer_experiment_writes_the_staged_bytes(tmp_path: Path, kind: str) -> None:
    """The writer experiment's thread and process (``benchmarks.staging``) write exactly the staged bytes
    (the work a save does), and a second save writes the buffers as staged again."""
    import torch

    from benchmarks.staging import Staged, make_writer

    tensors = [torch.arange(3 << 20, dtype=torch.float32), torch.ones(5, 7, dtype=torch.bfloat16)]
    staged, writer = Staged(), make_writer(kind)
    try:
        for version in (1, 2):
            new = staged.stage([t * version for t in tensors])
            assert new == (version == 1)  # the buffers are reused
            path = tmp_path / f"v{version}.bin"
            writer.start(staged, str(path), new)
            while writer.writing:
                time.sleep(0.01)
            expected = b"".join(bytes((t * version).reshape(-1).view(torch.uint8).numpy()) for t in tensors)
            assert path.read_bytes() == expected
    finally:
        writer.close()


def test_the_benchmarks_import_nothing_from_the_tests_and_have_no_cycle() -> None:
    from tests.imports import find_cycle, read_graph

    graph = read_graph(REPO, "benchmarks")
    assert "benchmarks.ranks" in graph.edges["benchmarks.run"]  # the graph is read
    assert {m: "tests" for m, external in graph.external.items() if "tests" in external} == {}
    assert find_cycle(graph.edges) is None, "import cycle: " + " -> ".join(find_cycle(graph.edges) or [])


def test_the_one_timer_times_every_kind_of_function_and_always_restores() -> None:
    """``benchmarks.timing``: a method, classmethod, staticmethod, an instance's method and a module's
    function are timed per call, and every one is what it was after the block, raised or not."""
    import types

    from benchmarks.timing import PhaseTimers, timer

    class Base:
        def method(self) -> str:
            return "method"

        @classmethod
        def klass(cls) -> str:
            return cls.__name__

        @staticmethod
        def static() -> str:
            return "static"

    class Child(Base):
        pass

    module = types.ModuleType("fake")
    module.function = lambda: "function"  # type: ignore[attr-defined]
    instance = Child()
    before = {
        name: dict(vars(owner)) for name, owner in (("Base", Base), ("Child", Child), ("module", module))
    }
    timers = PhaseTimers()
    phases = [
        (Child, "method", "child method"),  # inherited: timed on Child only
        (Base, "klass", "classmethod"),
        (Base, "static", "staticmethod"),
        (module, "function", "function"),
    ]
    with timers.installed(phases):
        assert "method" in vars(Child)
        assert (instance.method(), Child.klass(), instance.static(), module.function()) == (  # type: ignore[attr-defined]
            "method",
            "Child",
            "static",
            "function",
        )
        assert Base().method() == "method"  # Base's own method is not timed
    assert timers.calls == {"child method": 1, "classmethod": 1, "staticmethod": 1, "function": 1}
    assert all(seconds >= 0 for seconds in timers.seconds.values())
    after = {
        name: dict(vars(owner)) for name, owner in (("Base", Base), ("Child", Child), ("module", module))
    }
    assert after == before

    seconds: list[float] = []
    with pytest.raises(RuntimeError, match="boom"), timer(instance, "method", seconds.append):
        assert instance.method() == "method"
        raise RuntimeError("boom")
    assert seconds and "method" not in vars(instance)  # the instance's attribute is gone again


def test_the_fresh_memory_probe_times_every_block_of_every_round(tmp_path: Path) -> None:
    from benchmarks import fresh_memory

    out = tmp_path / "fresh.json"
    args = ["--block-gb", "0.004", "--blocks", "3", "--rounds", "2", "--pause-s", "0", "--out", str(out)]
    fresh_memory.main(args)
    figures = json.loads(out.read_text())
    assert figures["block bytes"] == 4_000_000
    assert figures["held bytes at each block"] == [4_000_000, 8_000_000, 12_000_000]
    assert [len(row) for row in figures["GB/s"]] == [3, 3]
    assert all(rate > 0 for row in figures["GB/s"] for rate in row)
    for rates, ratios in zip(figures["GB/s"], figures["ratio to the round's fastest"], strict=True):
        assert ratios == pytest.approx([rate / max(rates) for rate in rates])
        assert max(ratios) == 1.0


@pytest.mark.parametrize("way", ["huge-pages", "direct-read"])
def test_the_fresh_memory_probe_touches_each_block_the_way_asked(tmp_path: Path, way: str) -> None:
    """Every block of a ``--way`` holds what that way wrote: ones, or the bytes of the read file (the
    read into memory touched before timed too, per round)."""
    from benchmarks import fresh_memory

    seen: list[bytes] = []
    real = fresh_memory._first_touch

    def recording(*args: Any) -> Any:
        block = real(*args)

        def recorded() -> Any:
            memory = block()
            seen.append(bytes(memory[:4096]) + bytes(memory[-4096:]))
            return memory

        return recorded

    out = tmp_path / "fresh.json"
    args = ["--block-gb", "0.004194304", "--blocks", "2", "--rounds", "2", "--pause-s", "0", "--way", way]
    with mock.patch.object(fresh_memory, "_first_touch", recording):
        fresh_memory.main([*args, "--scratch", str(tmp_path), "--out", str(out)])
    figures = json.loads(out.read_text())
    assert figures["way"] == way and [len(row) for row in figures["GB/s"]] == [2, 2]
    assert len(seen) == 4 and len(set(seen)) == 1
    if way == "huge-pages":
        assert seen[0] == b"\x01" * 8192
    else:
        assert seen[0] != b"\x00" * 8192 and seen[0] != b"\x01" * 8192  # the file's random bytes
        assert len(figures["the same read into memory touched before, GB/s"]) == 2
        assert isinstance(figures["O_DIRECT"], bool)
    assert list(tmp_path.iterdir()) == [out]  # the read file is gone


def test_a_read_that_keeps_failing_is_raised_after_one_buffered_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--way direct-read`` goes on buffered when ``O_DIRECT`` is refused mid-file, once: a read that
    fails buffered too (a disk error) is raised, not retried for ever."""
    import errno
    import mmap
    import os

    from benchmarks import fresh_memory

    source = tmp_path / "source"
    source.write_bytes(b"x" * 8192)
    calls: list[int] = []

    def failing(*args: Any) -> int:
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError(f"the read was retried {len(calls)} times")
        raise OSError(errno.EIO, "Input/output error")

    try:  # whether this file system takes O_DIRECT (tmpfs does not): then a buffered retry follows
        os.close(os.open(source, os.O_RDONLY | os.O_DIRECT))
        direct = True
    except (AttributeError, OSError):
        direct = False
    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(OSError, match="Input/output error"):
        fresh_memory._read_into(source, mmap.mmap(-1, 8192))
    assert len(calls) == (2 if direct else 1)


def test_free_page_reporting_is_read_from_the_balloon_s_feature_bits(tmp_path: Path) -> None:
    from benchmarks.fresh_memory import free_page_reporting

    assert free_page_reporting(tmp_path / "none") is None
    balloon = "0110010" + "0" * 57  # bit 5 set: VIRTIO_BALLOON_F_REPORTING
    for name, device, features in (("virtio0", "0x0002", "1" * 64), ("virtio1", "0x0005", balloon)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "device").write_text(device + "\n")
        (tmp_path / name / "features").write_text(features + "\n")
    assert free_page_reporting(tmp_path) is True
    (tmp_path / "virtio1" / "features").write_text("0110000" + "0" * 57)
    assert free_page_reporting(tmp_path) is False


def test_each_repeat_is_paired_with_the_probe_of_its_own_call() -> None:
    """``paired``: repeat ``i`` of a save (or resume) against probe ``i`` of the same case, the slowest
    rank's seconds and every rank's bytes; a disk that halves its speed between two repeats leaves the
    paired ratios equal where the ratio against the run's median moves."""
    from benchmarks.disk import READ, WRITE
    from benchmarks.report import paired

    def rank(save: list[float], probe: list[float]) -> dict[str, object]:
        return {
            "ours-fsdp": {
                "save s": save,
                WRITE.key: probe,
                WRITE.bytes_key: [500, 500],
                "load s": save,
                READ.key: probe,
                READ.bytes_key: [400, 400],
            }
        }

    # Rank 1 is the slower rank of each call: its seconds count. The second call's disk is half as fast.
    per_rank = [rank([1.0, 2.0], [0.5, 1.0]), rank([1.25, 2.5], [1.0, 2.0])]
    # 1000 bytes in 1.25 s against 1000 probed bytes in 1.0 s, then 2.5 s against 2.0 s.
    assert paired(per_rank, "ours-fsdp", "save s", WRITE, 1000) == pytest.approx([0.8, 0.8])
    # The read probe read 800 bytes: 1000 / 1.25 against 800 / 1.0.
    assert paired(per_rank, "ours-fsdp", "load s", READ, 1000) == pytest.approx([1.0, 1.0])


def test_the_save_pages_experiment_times_each_kind_and_its_before_starts_mid_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``benchmarks.save_pages``: every kind timed every round (2 real ranks); its ``mid-page`` writer is
    the write-behind as it was (the write-back started up to each piece's last byte), not the one now."""
    import os

    from benchmarks import save_pages
    from lightning_sharded.checkpoint.writeback import WriteBehind
    from tests._pages import write_back_starts

    started = write_back_starts(monkeypatch)
    with open(tmp_path / "f", "wb", buffering=0) as f:
        behind = WriteBehind(f.fileno())
        f.write(os.urandom(10_000))
        save_pages._mid_page_advance(behind, 10_000)
    assert started == [(0, 10_000)]

    out = tmp_path / "pages.json"
    save_pages.main(["--gb-per-rank", "0.01", "--rounds", "2", "--dir", str(tmp_path), "--out", str(out)])
    figures = json.loads(out.read_text())
    assert figures["bytes per rank"] == save_pages.PIECE * 4  # one tensor of 64 MiB at the least
    assert {kind: len(s) for kind, s in figures["seconds"].items()} == dict.fromkeys(save_pages.KINDS, 2)
    assert figures["median / faithful write (time)"]["faithful write"] == 1.0
    assert not list(tmp_path.glob("lsbench-pages-*"))  # its files are removed
