"""Shared fixtures: a one-rank gloo process group for in-process tests of distributed values, a folder
whose file pages can be dropped from the page cache, and one run of the fault driver that gives the
crash cases and a clean 2-rank sharded checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_sharded._launch import free_port
from tests._pages import drops_pages
from tests.doc_sessions import run_demo
from tests.fault_injection import install as install_fault_injection

DRIVER = Path(__file__).parent / "distributed" / "fault_driver.py"


def init_one_rank_group() -> None:
    """A world of one gloo rank on loopback (a free port), unless a default group exists."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


@pytest.fixture(scope="session")
def process_group() -> Iterator[None]:
    """A world of one gloo rank, for DTensor/ShardedTensor in-process."""
    init_one_rank_group()
    yield


@pytest.fixture(scope="module")
def no_default_group() -> Iterator[None]:
    """No default process group while the module runs (it makes its own, ``benchmarks.scale``'s fake
    worlds); the one-rank group of :func:`process_group`, made by a module before, is made again after."""
    had = dist.is_initialized()
    if had:
        dist.destroy_process_group()
    yield
    if had:
        init_one_rank_group()


def pytest_configure(config: pytest.Config) -> None:
    """With ``LIGHTNING_SHARDED_REQUIRE_TORCHREC=1`` (``.ci/run``'s TorchRec run) TorchRec must import: its
    tests may not skip there for want of it. The tests' fault injection is installed (by environment)."""
    install_fault_injection()
    if os.environ.get("LIGHTNING_SHARDED_REQUIRE_TORCHREC") == "1":
        try:
            import torchrec  # noqa: F401
        except Exception as ex:
            pytest.exit(f"LIGHTNING_SHARDED_REQUIRE_TORCHREC=1 but TorchRec does not import: {ex!r}", 1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests skip, with a reason, where there is no CUDA device; their CPU twins always run."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (its CPU twin runs)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def through_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``consolidate_checkpoint`` through torch (``consolidate_mapped``), as for a checkpoint that the
    torch-free path (``consolidate_direct``) leaves to it."""
    from lightning_sharded.checkpoint.tools import consolidate_direct

    monkeypatch.setattr(consolidate_direct, "plan", lambda found, out: "through torch, as the test asks")


@pytest.fixture
def droppable(tmp_path: Path) -> Path:
    """``tmp_path``, on a filesystem whose clean pages ``POSIX_FADV_DONTNEED`` drops (not tmpfs)."""
    if not drops_pages(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem keeps the pages of written files (tmpfs?): nothing to drop")
    return tmp_path


@pytest.fixture(scope="session")
def fault_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``fault_driver.py OUT all``: ``OUT/template/ckpt`` (version 1, 2 ranks) and every crash case."""
    out = tmp_path_factory.mktemp("faults")
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(out), "all"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture
def sharded_ckpt(fault_run: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    """A private copy of a complete 2-rank sharded checkpoint (version 1 of ``fault_driver.expected``)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(fault_run[0] / "template" / "ckpt", dst)
    return dst


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The README's main job, ``lightning-sharded demo``, run once in an empty folder as a user runs it
    (the console script, its defaults); the folder and what it printed."""
    cwd = tmp_path_factory.mktemp("demo")
    return cwd, run_demo(cwd)
