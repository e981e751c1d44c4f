"""Rank processes forked from one that imported torch and Lightning once, instead of started cold.

Every rank of a test launch is a real process of its own (its own pid, session, process group and
gloo connections), but a cold ``python script.py`` spends most of a short scenario importing torch,
Lightning and what they pull in (torchmetrics, scipy, transformers): about 6-10 s of CPU per rank on
this project's 2-core machines, which was most of the test suite's time. The zygote, started once per
test session, imports those third-party packages and then forks each rank on request; the child
becomes what ``python SCRIPT ARGS`` would be (environment, ``sys.argv``, ``sys.path[0]``, working
folder, stdout/stderr to a file, its own session) and runs the script as ``__main__``. This project's
own code is not preloaded: each rank imports it fresh, after its environment is set.

What a cold start would differ in, and how the child makes up for it:

- environment read at import time: Lightning's ``rank_zero_only.rank`` is recomputed from the child's
  environment; the variables Lightning's import sets (``PYTORCH_NVML_BASED_CUDA_CHECK``) are set again;
- exit: non-daemon threads are joined and ``atexit`` handlers run, as at interpreter exit, and the
  exit status is the script's (``sys.exit`` code, 1 for an uncaught exception, ``-N`` for signal N);
- ``random`` is reseeded by Python at fork; numpy's global generator is not (no test relies on it).

Protocol (one JSON object per line): the test process writes ``{"id", "argv", "env", "cwd", "out"}``
to the zygote's stdin; the zygote answers ``{"id", "pid"}`` at once, and ``{"pid", "exit"}`` when that
child has exited. The zygote does no tensor work itself, and ``OMP_NUM_THREADS=1`` keeps OpenMP from
starting threads in it, so forking is safe.

``LIGHTNING_SHARDED_TEST_COLD=1`` turns the zygote off: every rank is then a cold ``python`` process.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

# What the zygote imports once (third-party only; Lightning's rank_zero_only is set again in _become):
# the same as the benchmarks' rank runner.
from benchmarks.ranks import PRELOAD, exit_after, redirect_output

COLD_ENV = "LIGHTNING_SHARDED_TEST_COLD"


# --------------------------------------------------------------------------------- the zygote side


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _become(request: dict[str, Any], import_env: dict[str, str]) -> None:
    """In the forked child: turn into ``python ARGV`` with the request's environment; never returns."""

    def run() -> int:
        os.setsid()
        redirect_output(request["out"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        env = {**import_env, **request["env"]}
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        script = os.path.abspath(request["argv"][0])
        sys.argv = [script, *request["argv"][1:]]
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:1] = [os.path.dirname(script), *extra]
        from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

        rank_zero_only.rank = _get_rank() or 0
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # what interpreter exit does first
        atexit._run_exitfuncs()
        return code

    exit_after(run)


def serve() -> None:
    """The zygote's loop: preload, then fork on each request and report each child's exit."""
    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    import_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    reply = sys.stdout.fileno()
    requests = sys.stdin.fileno()
    pending = b""
    children: set[int] = set()
    open_input = True
    while open_input or children:
        ready, _, _ = select.select([requests] if open_input else [], [], [], 0.05)
        if ready:
            chunk = os.read(requests, 1 << 16)
            if not chunk:  # the test session ended: a rank still running now was abandoned
                open_input = False
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, 9)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become(request, import_env)
                children.add(pid)
                os.write(reply, json.dumps({"id": request["id"], "pid": pid}).encode() + b"\n")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            exit_code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(BrokenPipeError):
                os.write(reply, json.dumps({"pid": pid, "exit": exit_code}).encode() + b"\n")


# ---------------------------------------------------------------------------- the test-process side


class ForkedRank:
    """A rank the zygote forked: the part of ``subprocess.Popen`` the launchers use."""

    def __init__(self, zygote: Zygote, pid: int, out: Path) -> None:
        self._zygote = zygote
        self.pid = pid
        self._out = out
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._zygote.exit_code(self.pid, timeout=timeout)
            if code is None:
                raise subprocess.TimeoutExpired(str(self._out), timeout or 0)
            self.returncode = code
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        text = self._out.read_text(errors="replace")
        self._out.unlink(missing_ok=True)
        return text, None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)


class Zygote:
    """The test session's zygote process and the bookkeeping of the ranks it forked."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.zygote"],
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # pid -> exit code
        self._dead = False
        self._next = 0
        threading.Thread(target=self._read, name="zygote-replies", daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._cond:
                if "exit" in message:
                    self._exits[message["pid"]] = message["exit"]
                else:
                    self._pids[message["id"]] = message["pid"]
                self._cond.notify_all()
        with self._cond:
            self._dead = True
            self._cond.notify_all()

    def _check_alive(self) -> None:
        if self._dead:
            raise RuntimeError(f"the test zygote exited ({self._proc.poll()}); rerun with {COLD_ENV}=1")

    def start(self, argv: list[str], env: dict[str, str], out: Path, cwd: Path | None = None) -> ForkedRank:
        """Fork ``python ARGV`` with ``env``; its stdout and stderr go to ``out``."""
        assert self._proc.stdin is not None
        with self._cond:
            self._check_alive()
            request_id = self._next
            self._next += 1
            where = str(cwd or os.getcwd())
            request = {"id": request_id, "argv": argv, "env": env, "cwd": where, "out": str(out)}
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            while request_id not in self._pids:
                self._check_alive()
                self._cond.wait()
            return ForkedRank(self, self._pids.pop(request_id), out)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once it exited; ``None`` if it still runs after ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._dead, timeout)
            if pid in self._exits:
                return self._exits[pid]
            self._check_alive()
            return None

    def close(self) -> None:
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=30)


if __name__ == "__main__":
    serve()
