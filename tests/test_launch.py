"""The demo's rank launcher (``lightning_sharded._launch.run_ranks``): outputs, fail-fast, deadline,
and no rank left behind when the launcher itself is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from lightning_sharded._launch import run_ranks

# A rank: prints its name, then exits with $CODE after $SLEEP seconds (its pid into $PIDFILE if set).
RANK = textwrap.dedent(
    """
    import os, sys, time
    if os.environ.get("PIDFILE"):
        open(os.environ["PIDFILE"], "w").write(str(os.getpid()))
    print("rank", os.environ["NAME"], flush=True)
    time.sleep(float(os.environ["SLEEP"]))
    sys.exit(int(os.environ["CODE"]))
    """
)


def env(name: str, sleep: float, code: int = 0, **extra: str) -> dict[str, str]:
    return {**os.environ, "NAME": name, "SLEEP": str(sleep), "CODE": str(code), **extra}


def test_every_rank_succeeds_and_each_output_is_its_own() -> None:
    outcome = run_ranks([sys.executable, "-c", RANK], [env("a", 0.1), env("b", 0.3)], timeout=60)
    assert outcome.ok and outcome.returncodes == [0, 0]
    assert [o.strip() for o in outcome.outputs] == ["rank a", "rank b"]


def test_a_failed_rank_stops_the_others_at_once() -> None:
    # Rank 1 fails at once; rank 0 would wait 60 s (as a rank waits for a dead peer at rendezvous).
    start = time.monotonic()
    outcome = run_ranks([sys.executable, "-c", RANK], [env("a", 60), env("b", 0, code=3)], timeout=120)
    assert time.monotonic() - start < 20
    assert not outcome.ok and not outcome.timed_out
    assert outcome.first_failed == 1
    assert outcome.returncodes[1] == 3 and outcome.returncodes[0] == -signal.SIGKILL
    assert outcome.outputs[1].strip() == "rank b"


def test_the_deadline_kills_every_rank() -> None:
    start = time.monotonic()
    outcome = run_ranks([sys.executable, "-c", RANK], [env("a", 60), env("b", 60)], timeout=1)
    assert time.monotonic() - start < 20
    assert outcome.timed_out and outcome.first_failed is None and not outcome.ok
    assert outcome.returncodes == [-signal.SIGKILL, -signal.SIGKILL]


def test_no_rank_outlives_a_killed_launcher(tmp_path: Path) -> None:
    pidfile = tmp_path / "rank.pid"
    launcher = textwrap.dedent(
        f"""
        import os, sys
        from lightning_sharded._launch import run_ranks
        env = {{**os.environ, "NAME": "a", "SLEEP": "120", "CODE": "0", "PIDFILE": {str(pidfile)!r}}}
        run_ranks([sys.executable, "-c", {RANK!r}], [env], timeout=300)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher])
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        rank = int(pidfile.read_text())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(rank, 0)
            except ProcessLookupError:
                break
            # A killed rank is a zombie until init reaps it: count that as gone.
            if Path(f"/proc/{rank}/stat").read_text().split()[2] == "Z":
                break
            time.sleep(0.05)
        else:
            os.kill(rank, signal.SIGKILL)
            raise AssertionError("the rank outlived its killed launcher")
    finally:
        if proc.poll() is None:
            proc.kill()
