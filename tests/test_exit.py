"""The exit handler that lets collective worker threads finish before the interpreter shuts down."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy, _exit
from lightning_sharded.strategies import _checkpointing

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
