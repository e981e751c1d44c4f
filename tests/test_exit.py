"""The exit handler that lets collective worker threads finish before the interpreter shuts down."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy, _exit
from lightning_sharded.strategies import _checkpointing
from tests.distributed.launch import launcher_env

EXIT_SCENARIO = Path(__file__).parent / "distributed" / "scenario_exit.py"

pytestmark = pytest.mark.skipif(_exit.running_threads() is None, reason="needs /proc (Linux)")


class Spinner:
    """A thread that computes (state R) for ``seconds``, or until stopped, then waits (state S)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spun = threading.Event()
        self.halt = threading.Event()  # stop computing
        self.stop = threading.Event()  # end the thread
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.started.set()
        end = time.monotonic() + self.seconds
        while time.monotonic() < end and not self.halt.is_set():
            sum(range(1000))
        self.spun.set()
        self.stop.wait()

    def __enter__(self) -> Spinner:
        self.thread.start()
        self.started.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.stop.set()
        self.thread.join()


@pytest.fixture
def quiet() -> Iterator[None]:
    """Wait for this process's other threads (pytest's, torch's) to be idle before a test counts."""
    _exit._drain(limit=5.0)
    yield


def test_a_computing_thread_counts_as_running_and_a_waiting_one_does_not(quiet: None) -> None:
    with Spinner(seconds=60) as spinner:
        assert _exit.running_threads() >= 1  # type: ignore[operator]
        spinner.halt.set()
        spinner.spun.wait()
        _exit._drain(limit=5.0)
        assert spinner.thread.is_alive()  # waiting on its event, not running
        assert _exit.running_threads() == 0


def test_the_drain_returns_once_the_other_threads_stop_running(quiet: None) -> None:
    with Spinner(seconds=0.3) as spinner:
        _exit._drain(limit=30.0)
        assert spinner.spun.is_set()


def test_the_drain_gives_up_at_its_limit(quiet: None) -> None:
    with Spinner(seconds=60) as spinner:
        _exit._drain(limit=0.2)
        assert not spinner.spun.is_set()  # still computing: the drain did not wait for it


def test_registered_once_at_exit_in_a_fresh_process() -> None:
    code = (
        "import atexit\n"
        "from lightning_sharded import _exit\n"
        "calls = []\n"
        "atexit.register(lambda: print('handlers after ours ran first', calls))\n"
        "_exit._drain = lambda limit=_exit.LIMIT: calls.append('drain') or print('drained')\n"
        "_exit.drain_at_exit()\n"
        "_exit.drain_at_exit()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # atexit runs the latest registration first: ours (registered after the printer) runs once, before it.
    assert out.splitlines() == ["drained", "handlers after ours ran first ['drain']"]


@pytest.mark.parametrize(
    ("strategy_class", "parent"),
    [(ShardedFSDPStrategy, FSDPStrategy), (ShardedModelParallelStrategy, ModelParallelStrategy)],
)
def test_the_strategies_register_it_when_they_set_up_the_process_group(
    monkeypatch: pytest.MonkeyPatch, strategy_class: type, parent: type
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(parent, "setup_environment", lambda self: calls.append("process group"))
    monkeypatch.setattr(_checkpointing, "drain_at_exit", lambda: calls.append("drain at exit"))
    strategy_class().setup_environment()
    assert calls == ["process group", "drain at exit"]


def test_registering_the_hooks_registers_it_for_any_strategy() -> None:
    """The mixin (and register_sharded_state_hooks) register the handler themselves: a model under stock
    DDP, a single device or stock FSDP, which never calls this library's strategies, drains at exit too."""
    code = (
        "import torch\n"
        "from lightning_sharded import _exit, register_sharded_state_hooks\n"
        "_exit._drain = lambda limit=_exit.LIMIT: print('drained')\n"
        "register_sharded_state_hooks(torch.nn.Linear(2, 2))\n"
        "register_sharded_state_hooks(torch.nn.Linear(2, 2))\n"
        "print('end of script')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["end of script", "drained"]


@pytest.mark.slow
def test_the_mixin_under_stock_ddp_exits_cleanly_right_after_a_collective(tmp_path: Path) -> None:
    """3 stock DDP runs of 2 real processes, each ending with a collective and the interpreter's own
    shutdown (no os._exit): every rank exits 0, with no "terminate called" abort."""
    runs = 3
    proc = subprocess.run(
        [sys.executable, str(EXIT_SCENARIO), str(tmp_path), str(runs)],
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results) == 2 * runs
    bad = [r for r in results if r["exit"] != 0 or r["terminate"]]
    assert not bad, "\n".join(f"run {r['run']} rank {r['rank']} exit {r['exit']}:\n{r['tail']}" for r in bad)
    # Each rank got to the last line: the table (6 x 4, +1 per step on each shard, 2 steps) gathered.
    assert all("table sum 48.0" in r["tail"] for r in results)
    saved = torch.load(tmp_path / "table.ckpt", weights_only=True)["state_dict"]["table"]
    assert type(saved) is torch.Tensor  # the mixin gathered it
    assert torch.equal(saved, torch.full((6, 4), 2.0))
