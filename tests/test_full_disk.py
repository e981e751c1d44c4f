"""Saves onto a real, small filesystem (a 3 MiB tmpfs) until it is full, then onto it read-only.

``tests/distributed/full_disk_driver.py`` runs 2 ranks in a mount namespace of its own (``unshare
--mount``), where it mounts the tmpfs; the mount goes away with the namespace. That needs root (or
CAP_SYS_ADMIN) and ``unshare``: where the machine does not allow it, the test is skipped with the
reason (the same faults, injected, run everywhere: ``test_storage_faults.py``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharded import load_checkpoint, verify_checkpoint
from lightning_sharded.checkpoint.commit import leftovers
from tests.distributed.full_disk_driver import expected

DRIVER = Path(__file__).parent / "distributed" / "full_disk_driver.py"
MOUNT = 'mount -t tmpfs -o size=3m tmpfs "$1"'


def _namespace(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("full-disk")
    disk, out = root / "disk", root / "out"
    disk.mkdir()
    out.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("no `unshare` here to mount a small filesystem in a namespace of its own")
    probe = _namespace(MOUNT, str(disk), timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {probe.stderr.strip()}")
    proc = _namespace(
        f'{MOUNT} && exec "$2" "$3" "$1" "$4"', str(disk), sys.executable, str(DRIVER), str(out), timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, json.loads((out / "results.json").read_text())["ranks"]


def test_every_rank_raises_the_same_error(run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = run
    assert ranks[0] == ranks[1]


def test_a_save_that_does_not_fit_is_refused_before_writing(run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, ranks = run
    steps = ranks[0]
    assert steps["saved"] == [1, 2], steps  # 3 MiB hold two checkpoints of 1 MiB, and not a third
    for step, path in (("fill", "ckpt-3"), ("overwrite", "ckpt-1")):
        # over ckpt-1, the new version must fit beside the old one, which is kept until the publish
        failed = steps[step]
        assert failed["type"] == "StorageError" and failed["errno"] == 28, failed
        assert failed["message"].startswith(
            f"No space left on device (ENOSPC) for the checkpoint '{out.parent / 'disk' / path}', refused"
            " before writing: this save needs about 1.0 MiB (2 ranks' estimates, 524.0 KiB at most each;"
        ), failed["message"]
        # 3 MiB less two checkpoints of 1,056 KiB in tmpfs pages (shards, meta.pt, manifest, index files)
        assert "has 960.0 KiB free (statvfs). Nothing was written" in failed["message"], failed["message"]


def test_the_real_enospc_names_the_file_and_the_figures(run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = run
    for step in ("unchecked", "full"):
        failed = ranks[0][step]
        message = failed["message"]
        assert failed["errno"] == 28 and message.startswith(
            "No space left on device (ENOSPC): saving the checkpoint"
        )
        # Whichever rank's write met the full disk first is named, with its own file: both ranks write
        # their shards at once, so which one it is differs from run to run; a full file is rank 0's.
        named = re.search(r"failed on rank\(s\) (\d)[ ,].*?\(rank \1: '([^']+)'", message)
        assert named is not None, message
        rank, file = int(named.group(1)), Path(named.group(2)).name
        expected = f"__{rank}_0.distcp" if step == "unchecked" else ".full.ckpt.staging-"
        assert file.startswith(expected) and (step == "unchecked" or rank == 0), message
        assert "B free): No space left on device)" in message, message
        assert "were free when it started (statvfs of" in message and "save_top_k" in message, message
        assert "unexpected pos" not in message, message


def test_a_read_only_filesystem(run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = run
    failed = ranks[0]["read_only"]
    assert failed["errno"] == 30, failed
    assert failed["message"].startswith("Read-only file system (EROFS): saving the checkpoint"), failed
    assert "remount it read-write" in failed["message"]


def test_what_is_left_is_whole_and_nothing_else(run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, _ = run
    disk = out / "disk"
    assert sorted(p.name for p in disk.iterdir()) == ["ckpt-1", "ckpt-2"]  # no staging, no partial file
    for version in (1, 2):
        path = disk / f"ckpt-{version}"
        verify_checkpoint(path)
        assert leftovers(path) == []
        loaded = load_checkpoint(path)
        assert loaded["global_step"] == version
        values = expected(version)
        assert torch.equal(loaded["state_dict"]["weight"], values["weight"])
        state = loaded["optimizer_states"][0]["state"]
        assert torch.equal(next(iter(state.values()))["exp_avg"], values["exp_avg"])
