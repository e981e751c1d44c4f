"""load_checkpoint, consolidate_checkpoint, inspect and the `lightning-sharded` CLI, in one process."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharded import CheckpointError, consolidate_checkpoint, load_checkpoint
from lightning_sharded.checkpoint.commit import commit_directory, leftovers
from lightning_sharded.checkpoint.tools import inspect_checkpoint
from lightning_sharded.cli import main
from tests._compare import assert_same, run_cli
from tests.distributed.fault_driver import expected

REPO = Path(__file__).resolve().parents[1]


def lightning_form(version: int) -> dict[str, Any]:
    """``fault_driver.expected(version)`` as a full Lightning checkpoint (optimizer keyed by index)."""
    full = expected(version)
    opt = full.pop("optimizer_0")
    full["optimizer_states"] = [
        {
            "state": {0: opt["state"]["layer.weight"], 1: opt["state"]["layer.bias"]},
            "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        }
    ]
    return full


def save_single_process(path: Path, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """A sharded checkpoint written by one process with DCP (no process group), through commit_directory."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    def write(staging: Path) -> None:
        _save_state_dict(state, FileSystemWriter(staging), no_dist=True)
        torch.save(meta, staging / "meta.pt")

    commit_directory(
        path, write, metadata={"epoch": meta.get("epoch"), "global_step": meta.get("global_step")}
    )


def test_load_checkpoint_of_a_two_rank_directory(sharded_ckpt: Path) -> None:
    assert_same(load_checkpoint(sharded_ckpt), lightning_form(1))


def test_load_checkpoint_of_a_full_file(sharded_ckpt: Path, tmp_path: Path) -> None:
    out = consolidate_checkpoint(sharded_ckpt, tmp_path / "full.ckpt", progress=False)
    assert_same(load_checkpoint(out), lightning_form(1))
    assert_same(torch.load(out, weights_only=True), lightning_form(1))


def test_fsdp_model_key_and_extra_keys(tmp_path: Path) -> None:
    weight = torch.arange(6.0).reshape(2, 3)
    state = {
        "model": {"w": weight},
        "optimizer_0": {
            "state": {"w": {"exp_avg": weight * 2}},
            "param_groups": [{"lr": 1.0, "params": ["w"]}],
        },
    }
    save_single_process(tmp_path / "ckpt", state, {"epoch": 2, "global_step": 7})
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert_same(loaded["state_dict"], {"w": weight})
    assert_same(
        loaded["optimizer_states"],
        [{"state": {0: {"exp_avg": weight * 2}}, "param_groups": [{"lr": 1.0, "params": [0]}]}],
    )
    assert (loaded["epoch"], loaded["global_step"]) == (2, 7)


def test_missing_optimizer_number_and_no_model(tmp_path: Path) -> None:
    save_single_process(
        tmp_path / "a", {"state_dict": {"w": torch.ones(2)}, "optimizer_1": {"x": torch.ones(1)}}, {}
    )
    with pytest.raises(CheckpointError, match=r"optimizer states \['optimizer_1'\], not numbered 0, 1"):
        load_checkpoint(tmp_path / "a")
    save_single_process(tmp_path / "b", {"weights": {"w": torch.ones(2)}}, {})
    with pytest.raises(
        CheckpointError, match=r"has no model state: none of the keys \['state_dict', 'model'\]"
    ):
        load_checkpoint(tmp_path / "b")


def test_consolidate_output_is_a_valid_archive_published_atomically(
    sharded_ckpt: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "out" / "full.ckpt"
    dst.parent.mkdir()
    dst.write_text("previous")
    with pytest.raises(FileExistsError, match="exists"):
        consolidate_checkpoint(sharded_ckpt, dst, progress=False)
    assert dst.read_text() == "previous"
    out = consolidate_checkpoint(sharded_ckpt, dst, progress=False, overwrite=True)
    assert out == dst
    with zipfile.ZipFile(dst) as archive:
        assert archive.testzip() is None  # every CRC-32 recomputed after the fill
    assert sorted(p.name for p in dst.parent.iterdir()) == ["full.ckpt"]
    assert leftovers(dst) == []


def test_consolidate_checksums_each_chunk_as_it_fills_it(
    sharded_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, through_torch: None
) -> None:
    from lightning_sharded.checkpoint.tools import consolidate_mapped as consolidate

    seen: list[dict[int, int]] = []
    real = consolidate._fix_zip_crcs

    def spy(file: Path, known: dict[int, int] | None = None) -> None:
        seen.append(dict(known or {}))
        real(file, known)

    monkeypatch.setattr(consolidate, "_fix_zip_crcs", spy)
    out = consolidate_checkpoint(sharded_ckpt, tmp_path / "full.ckpt", progress=False)
    with zipfile.ZipFile(out) as archive:
        assert archive.testzip() is None
        data = [info for info in archive.infolist() if "/data/" in info.filename and info.file_size]
    # Every storage record's CRC-32 came from its filled chunks: none was read back.
    assert len(seen) == 1 and len(seen[0]) == len(data) > 4


def _adam_checkpoint(path: Path) -> Path:
    """A sharded checkpoint of two ``Linear(1024, 1024)`` and Adam's state: six 4 MiB tensors."""
    from tests.checkpoint.one_process import save_sharded, stepped

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    optimizer = torch.optim.Adam(model.parameters())
    stepped(model, optimizer, 1024)
    return save_sharded(path, model, optimizer)


def test_consolidate_writes_behind_its_fill(
    droppable: Path, monkeypatch: pytest.MonkeyPatch, through_torch: None
) -> None:
    # Once WINDOW bytes more of the output are filled, a filled region's pages leave the page cache:
    # the output does not take its size in memory (it kept every byte cached).
    from lightning_sharded.checkpoint.tools import consolidate_mapped as consolidate
    from tests._pages import resident

    monkeypatch.setattr(consolidate, "WINDOW", 4 << 20)
    out = consolidate_checkpoint(
        _adam_checkpoint(droppable / "ckpt"), droppable / "full.ckpt", progress=False
    )
    assert out.stat().st_size > 24 << 20
    assert resident(out) < 0.5  # at most the last 4 MiB region, the window and the small records
    assert torch.equal(  # and the bytes are those of the source
        load_checkpoint(out)["state_dict"]["0.weight"],
        load_checkpoint(droppable / "ckpt")["state_dict"]["0.weight"],
    )


def test_consolidate_s_writer_fails_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, through_torch: None
) -> None:
    # The tensors are written by a thread (pwrite from the read buffers): a write that fails there is
    # raised in the caller, naming the destination, and nothing is published (the old output stays).
    import errno

    from lightning_sharded.checkpoint.tools import consolidate_mapped as consolidate

    src, dst = _adam_checkpoint(tmp_path / "ckpt"), tmp_path / "full.ckpt"
    dst.write_bytes(b"the previous output")
    writes = 0
    pwrite = consolidate.os.pwrite

    def failing(fd: int, data: Any, offset: int) -> int:
        nonlocal writes
        writes += 1
        if writes < 3:  # mid-write: two of the six 4 MiB tensors are written first
            return pwrite(fd, data, offset)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(consolidate.os, "pwrite", failing)
    monkeypatch.setattr(consolidate, "_BATCH", 4 << 20)  # a batch per tensor: batches follow the failure
    failed = r"^Input/output error \(EIO\): saving the checkpoint '.*full\.ckpt' failed"
    with pytest.raises(OSError, match=failed):
        consolidate_checkpoint(src, dst, overwrite=True, progress=False)
    assert writes == 3, f"{writes} writes: the fill went on after the failed third one"
    assert dst.read_bytes() == b"the previous output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "full.ckpt"]  # no staged leftover


def test_consolidate_without_the_record_layout_fills_through_the_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, through_torch: None
) -> None:
    # Where the mapped output's storages cannot be matched to the file's records (another torch's
    # layout), the writer copies each buffer into its mapped target and the CRCs are read back.
    from lightning_sharded.checkpoint.tools import consolidate_mapped as consolidate

    matched = consolidate._FillChecksums.__init__

    def unmatched(self: Any, file: Path, loaded: Any) -> None:
        matched(self, file, loaded)
        self._base = None  # as when the storages' sizes differ from the records'

    monkeypatch.setattr(consolidate._FillChecksums, "__init__", unmatched)
    monkeypatch.setattr(consolidate.os, "pwrite", None)  # not called on this path
    src = _adam_checkpoint(tmp_path / "ckpt")
    out = consolidate_checkpoint(src, tmp_path / "full.ckpt", progress=False)
    with zipfile.ZipFile(out) as archive:
        assert archive.testzip() is None
    assert_same(load_checkpoint(out)["state_dict"], load_checkpoint(src)["state_dict"])
    assert_same(load_checkpoint(out)["optimizer_states"], load_checkpoint(src)["optimizer_states"])


def test_consolidate_s_skeleton_holds_more_tensors_than_the_kernel_maps(tmp_path: Path) -> None:
    # The output's skeleton is saved from tensors that take no memory, a storage each (a record each in
    # the file, which the fill expects), cut from one mapping: a mapping each stopped at the kernel's
    # vm.max_map_count (65,530), so a checkpoint of more tensor entries could not be consolidated.
    from lightning_sharded.checkpoint.tools.consolidate_mapped import _unbacked

    shapes = {f"w{i}": ((3, 5), torch.float32) for i in range(70_000)}
    shapes.update(
        {"empty": ((0, 4), torch.float16), "scalar": ((), torch.int64), "flags": ((7,), torch.bool)}
    )
    with _unbacked(shapes) as tensors, torch.serialization.skip_data():
        assert {key: (tuple(t.shape), t.dtype) for key, t in tensors.items()} == shapes
        torch.save(tensors, tmp_path / "skeleton.pt")
    records = [name for name in zipfile.ZipFile(tmp_path / "skeleton.pt").namelist() if "/data/" in name]
    assert len(records) == len(shapes), f"{len(records)} storage records for {len(shapes)} tensors"


@pytest.mark.parametrize("verify", [True, False])
def test_consolidate_takes_each_direct_read_s_crc_from_the_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool, through_torch: None
) -> None:
    # The output's records have the bytes the reads read: their CRC-32, computed by the reader's threads
    # as the bytes arrive (with or without verify), is not computed again from the output's memory.
    from lightning_sharded.checkpoint.tools import consolidate_mapped as consolidate

    src = _adam_checkpoint(tmp_path / "ckpt")
    hashed: list[int] = []
    real = consolidate.crc32

    def spy(data: Any, value: int = 0) -> int:
        hashed.append(len(memoryview(data).cast("B")))
        return real(data, value)

    monkeypatch.setattr(consolidate, "crc32", spy)
    out = consolidate_checkpoint(src, tmp_path / "full.ckpt", progress=False, verify=verify)
    with zipfile.ZipFile(out) as archive:
        assert archive.testzip() is None
    assert hashed, "consolidate hashed nothing through its crc32: the spy no longer sees its checksums"
    assert not [n for n in hashed if n >= 1 << 20], hashed  # the 4 MiB weights and their Adam state


def test_consolidate_refuses_a_full_file(sharded_ckpt: Path, tmp_path: Path) -> None:
    out = consolidate_checkpoint(sharded_ckpt, tmp_path / "full.ckpt", progress=False)
    with pytest.raises(
        CheckpointError, match="already a full checkpoint file: there is nothing to consolidate"
    ):
        consolidate_checkpoint(out, tmp_path / "again.ckpt")


def test_consolidate_keeps_real_tensors_of_meta(tmp_path: Path) -> None:
    score = torch.tensor(0.25)
    save_single_process(
        tmp_path / "ckpt",
        {"state_dict": {"w": torch.ones(3)}},
        {"callbacks": {"ModelCheckpoint": {"best_model_score": score, "best_k_models": {"a": score + 1}}}},
    )
    out = consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "full.ckpt", progress=False)
    loaded = torch.load(out, weights_only=True)
    assert_same(
        loaded["callbacks"],
        {"ModelCheckpoint": {"best_model_score": score, "best_k_models": {"a": score + 1}}},
    )


MEMORY_SCRIPT = r"""
import sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from lightning_sharded import consolidate_checkpoint, load_checkpoint
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

class Peak:
    def __init__(self):
        self.peak, self.run = anon_kib(), True
        self.thread = threading.Thread(target=self.sample, daemon=True); self.thread.start()
    def sample(self):
        while self.run:
            self.peak = max(self.peak, anon_kib()); time.sleep(0.002)
    def stop(self):
        self.run = False; self.thread.join(); return self.peak

root = Path(sys.argv[2])
state = {"state_dict": {f"w{i}": torch.full((4 << 20,), float(i)) for i in range(16)}}  # 16 x 16 MiB
_save_state_dict(state, FileSystemWriter(root / "ckpt"), no_dist=True)
torch.save({"epoch": 0}, root / "ckpt" / "meta.pt")
del state
import gc; gc.collect()
# a first, small consolidation imports what it needs (tqdm...): code, not data
tiny = {"state_dict": {"w": torch.ones(4)}}
_save_state_dict(tiny, FileSystemWriter(root / "tiny"), no_dist=True)
torch.save({"epoch": 0}, root / "tiny" / "meta.pt")
consolidate_checkpoint(root / "tiny", root / "tiny.ckpt", progress=False)
gc.collect()
base = anon_kib(); p = Peak()
consolidate_checkpoint(root / "ckpt", root / "full.ckpt", progress=False)
consolidate_peak = p.stop() - base
gc.collect(); base = anon_kib(); p = Peak()
loaded = load_checkpoint(root / "ckpt")
load_peak = p.stop() - base
full = torch.load(root / "full.ckpt", mmap=True)
assert torch.equal(full["state_dict"]["w15"], loaded["state_dict"]["w15"])
print(consolidate_peak // 1024, load_peak // 1024)
"""


def test_consolidate_memory_is_bounded_by_one_tensor(tmp_path: Path) -> None:
    # Two runs, in two processes at once (each measures its own memory).
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MEMORY_SCRIPT, str(REPO), str(tmp_path / str(run))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for run in range(2)
    ]

    def measure(proc: subprocess.Popen[str]) -> tuple[int, int]:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        consolidate_mib, load_mib = map(int, out.split())
        return consolidate_mib, load_mib

    # Resident memory is a noisy measure (allocator caches, the sampling thread's timing): the reader
    # holds 2-3 copies of the tensor it reads (file bytes, decoded tensor, target), and now and then
    # the previous tensor's buffers are not freed yet, so a run shows 32-112 MiB. A consolidation
    # that held the model would show >= 256 MiB every time; the smaller of two runs is checked.
    runs = [measure(proc) for proc in procs]
    consolidate_mib = min(c for c, _ in runs)
    # 256 MiB of tensors, the largest 16 MiB: loading everything must show up (the measure works) ...
    assert all(load >= 192 for _, load in runs), runs
    # ... and consolidation stays within a few copies of the largest tensor.
    assert consolidate_mib <= 7 * 16, runs


# ------------------------------------------------------------------------------------------- CLI


def test_cli_inspect_table_and_json(sharded_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "inspect", str(sharded_ckpt))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["key", "shape", "dtype", "size", "shards", "value"]
    assert any(
        line.split() == ["state_dict.layer.weight", "(8,", "6)", "torch.float32", "192", "B", "2"]
        for line in lines
    )
    assert "world size:  2" in out and "epoch:       1" in out and "global step: 10" in out
    assert "kind:        sharded (manifest)" in out
    code, out, _ = run_cli(capsys, "inspect", str(sharded_ckpt), "--json")
    data = json.loads(out)
    assert data["world_size"] == 2 and data["epoch"] == 1 and data["global_step"] == 10
    entry = next(e for e in data["entries"] if e["key"] == "state_dict.layer.weight")
    assert entry == {
        "key": "state_dict.layer.weight",
        "shape": [8, 6],
        "dtype": "torch.float32",
        "size": 192,
        "shards": 2,
        "value": None,
    }
    lr = next(e for e in data["entries"] if e["key"] == "optimizer_0.param_groups.0.lr")
    assert lr == {"key": lr["key"], "shape": None, "dtype": "float", "size": 0, "shards": 1, "value": "0.1"}
    assert data == inspect_checkpoint(sharded_ckpt).to_dict()


def test_cli_verify_ok_and_damaged(sharded_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "verify", str(sharded_ckpt))
    assert code == 0
    assert out.startswith(f"OK: {sharded_ckpt} (sharded, 5 files,") and "checksums match" in out
    (sharded_ckpt / "__0_0.distcp").unlink()
    data = bytearray((sharded_ckpt / "__1_0.distcp").read_bytes())
    data[100] ^= 1
    (sharded_ckpt / "__1_0.distcp").write_bytes(bytes(data))
    code, out, err = run_cli(capsys, "verify", str(sharded_ckpt))
    assert code == 1 and out == ""
    assert err.startswith("lightning-sharded verify: error: The checkpoint")
    assert "'__0_0.distcp' (written by rank 0) is missing" in err
    assert "'__1_0.distcp' (written by rank 1) is corrupted" in err


def test_cli_consolidate(sharded_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "consolidate", str(sharded_ckpt), str(tmp_path / "full.ckpt"))
    assert code == 0 and out.startswith(f"Wrote {tmp_path / 'full.ckpt'}")
    assert_same(torch.load(tmp_path / "full.ckpt", weights_only=True), lightning_form(1))


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "verify", str(tmp_path / "nope"))
    assert code == 1 and "There is no checkpoint at" in err
    code, _, err = run_cli(capsys, "bogus")
    assert code == 2 and "invalid choice" in err


def test_console_script_runs(sharded_ckpt: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_sharded.cli", "verify", str(sharded_ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("OK:"), proc.stderr


def test_cli_demo_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    seen: list[list[str]] = []
    module = types.ModuleType("lightning_sharded.demo")
    module.main = lambda argv: seen.append(list(argv)) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lightning_sharded.demo", module)
    assert main(["demo", "--processes", "2", "--out", "x"]) == 7
    assert seen == [["--processes", "2", "--out", "x"]]
