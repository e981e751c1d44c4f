"""The demo, run as a user runs it (its own rank processes), and its comparison on crafted values."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_sharded import inspect_checkpoint, verify_checkpoint
from lightning_sharded.checkpoint.progress import format_size
from lightning_sharded.demo import compare


def test_demo_resumes_in_one_and_two_processes(demo_run: tuple[Path, str]) -> None:
    # The defaults (ShardedFSDPStrategy, sharded, 2 processes): what the README's first command runs,
    # run as it does (see the demo_run fixture). The model-parallel and "full" paths it also offers are
    # covered by tests/strategies.
    cwd, stdout = demo_run
    lines = stdout.splitlines()
    for world in (1, 2):
        line = next(line for line in lines if f"resumed in {world} process(es)" in line)
        assert "weights 4/4 equal, table equal, optimizer state 12/12 equal, global step 4" in line
    assert lines[-1].startswith("OK:")
    # one count of the checkpoint's files and bytes: the demo's, inspect's and verify's
    report = verify_checkpoint(cwd / "lightning-sharded-demo" / "checkpoint")
    info = inspect_checkpoint(cwd / "lightning-sharded-demo" / "checkpoint")
    on_disk = [p for p in (cwd / "lightning-sharded-demo" / "checkpoint").rglob("*") if p.is_file()]
    assert (
        (report.files, report.bytes)
        == (info.files, info.disk_size)
        == (
            len(on_disk),
            sum(p.stat().st_size for p in on_disk),
        )
    )
    assert f"saved checkpoint/ ({report.files} files, {format_size(report.bytes)}) (" in stdout
    saved = torch.load(cwd / "lightning-sharded-demo" / "saved.pt", weights_only=False)
    assert saved["global_step"] == 4 and len([k for k in saved if k.startswith("optimizer.")]) == 12


def test_compare_reports_every_difference() -> None:
    saved = {
        "global_step": 4,
        "table": torch.ones(2),
        "weight.w": torch.zeros(2),
        "optimizer.w.exp_avg": torch.zeros(2),
    }
    assert compare(saved, dict(saved)).ok
    restored = {**saved, "table": torch.zeros(2), "optimizer.w.exp_avg": torch.ones(2)}
    report = compare(saved, restored)
    assert not report.ok
    assert report.differ == ["table", "optimizer.w.exp_avg"]
    assert "table DIFFERS" in str(report) and "optimizer state 0/1 equal" in str(report)
    missing = {k: v for k, v in saved.items() if k != "weight.w"}
    assert compare(saved, missing).differ == ["weight.w"]
    assert not compare(saved, {**saved, "global_step": 3}).ok
