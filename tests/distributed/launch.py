"""The tests' one launcher: the ranks of a multi-process scenario, torchrun agents, forked children.

Each rank is ``python SCRIPT ARGS...`` with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
(loopback) and ``MASTER_PORT`` (a free port, new for every launch) set, so ``init_process_group("gloo")``
works and Lightning uses this environment instead of relaunching ``sys.argv``. Scenario scripts report
results through files in a folder the test gives them; a rank that fails, hangs past the timeout or
exits non-zero fails the test with every rank's output.

Ranks are forked from a zygote, a process that imported torch and Lightning once (this module run as
``python -m tests.distributed.launch``): still one real process per rank, without the 6-10 s of CPU a
cold start spends importing them, which was most of the suite's time on 2 cores.
``LIGHTNING_SHARDED_TEST_COLD=1`` starts every rank cold instead. The rest of this file:
:func:`run_torchrun` (``torchrun`` agents, as a multi-node job starts), :func:`fork` (a child running one
function, for the fault drivers) and :class:`Batch` (many jobs of ``scenario_resume.py`` per launch).

The zygote imports only third-party packages before forking: this project's code (``lightning_sharded``,
so :mod:`lightning_sharded._launch` too) is imported inside the functions that need it, so each rank
imports it fresh, after its environment is set.

What a forked rank would differ in from a cold start, and how the child makes up for it:

- environment read at import time: Lightning's ``rank_zero_only.rank`` is recomputed from the child's
  environment; the variables Lightning's import sets (``PYTORCH_NVML_BASED_CUDA_CHECK``) are set again;
- exit: non-daemon threads are joined and ``atexit`` handlers run, as at interpreter exit, and the
  exit status is the script's (``sys.exit`` code, 1 for an uncaught exception, ``-N`` for signal N);
- ``random`` is reseeded by Python at fork; numpy's global generator is not (no test relies on it).

Zygote protocol (one JSON object per line): the test process writes ``{"id", "argv", "env", "cwd",
"out"}`` to the zygote's stdin; the zygote answers ``{"id", "pid"}`` at once, and ``{"pid", "exit"}``
when that child has exited. The zygote does no tensor work itself, and ``OMP_NUM_THREADS=1`` keeps
OpenMP from starting threads in it, so forking is safe.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

# What the zygote imports once (third-party only; Lightning's rank_zero_only is set again in _become):
# the same as the benchmarks' rank runner.
from benchmarks.ranks import PRELOAD, exit_after, launcher_env, redirect_output

REPO = Path(__file__).resolve().parents[2]
COLD_ENV = "LIGHTNING_SHARDED_TEST_COLD"
SCENARIO = Path(__file__).with_name("scenario_resume.py")

_zygote: Zygote | None = None
_outputs: Path | None = None


def rank_env(rank: int, world_size: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The package's rank environment with this repository first on ``PYTHONPATH``, plus ``extra``."""
    from lightning_sharded._launch import rank_env as package_rank_env

    env = package_rank_env(rank, world_size, port, REPO)
    env.pop("PL_TRAINER_GPUS", None)
    if extra:
        env.update(extra)
    return env


def run_ranks(
    script: str | Path,
    world_size: int,
    *args: str,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run ``script`` once per rank and wait for all of them; returns each rank's combined output.

    Raises:
        AssertionError: a rank exited non-zero or the ranks did not finish within ``timeout`` seconds
            (all ranks are then killed); the message holds every rank's output.
    """
    from lightning_sharded._launch import free_port

    port = free_port()
    procs = [start_rank([str(script), *args], rank_env(r, world_size, port, env)) for r in range(world_size)]
    return wait_all(procs, timeout, f"{Path(script).name} x{world_size}", "rank")


def start_rank(argv: list[str], env: dict[str, str]) -> Rank:
    """``python ARGV`` with ``env`` in a session of its own, output captured: forked from the session's
    zygote, or a cold process when ``LIGHTNING_SHARDED_TEST_COLD=1``."""
    global _zygote, _outputs
    if os.environ.get(COLD_ENV) == "1":
        return subprocess.Popen(
            [sys.executable, *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    if _zygote is None:
        _outputs = Path(tempfile.mkdtemp(prefix="ls-ranks-"))
        _zygote = Zygote(launcher_env(), REPO)
        atexit.register(_zygote.close)
    assert _outputs is not None
    out = Path(tempfile.mkstemp(dir=_outputs, suffix=".out")[1])
    return _zygote.start(argv, env, out)


def wait_all(procs: list[Rank], timeout: float, label: str, what: str) -> list[str]:
    """Wait for every process; kill all of them (their process groups) at ``timeout`` seconds.

    Returns each process's combined output. Raises ``AssertionError`` with every output when one
    exited non-zero or the timeout struck.
    """
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    timed_out = False
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        outputs.append(out)
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0]
    if timed_out or failed:
        report = "\n".join(
            f"----- {what} {i} (exit {procs[i].returncode}) -----\n{out[-6000:]}"
            for i, out in enumerate(outputs)
        )
        reason = f"timed out after {timeout:.0f}s" if timed_out else f"{what}s {failed} failed"
        raise AssertionError(f"{label} {reason}:\n{report}")
    return outputs


def shell_env() -> dict[str, str]:
    """A user's shell for a command the docs show: this interpreter's scripts (lightning-sharded,
    torchrun) first on ``PATH``, no rank variables, terminal width 80."""
    env = launcher_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["COLUMNS"] = "80"
    return env


def run_torchrun(
    script: str | Path, nnodes: int, nproc_per_node: int, *args: str, timeout: float = 240.0
) -> list[str]:
    """Start ``nnodes`` torchrun agents for ``script`` and wait for all; returns each agent's output."""
    from lightning_sharded._launch import free_port

    port = free_port()
    env = launcher_env()
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes),
        "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", uuid.uuid4().hex[:8],
        "--local-addr", "127.0.0.1",
        "--max-restarts", "0",
        str(script), *args,
    ]  # fmt: skip
    agents = [
        subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for _ in range(nnodes)
    ]
    return wait_all(agents, timeout, f"torchrun {Path(script).name} {nnodes}x{nproc_per_node}", "agent")


def fork(body: Callable[[], int | None]) -> int:
    """Fork a child that runs ``body`` and exits with its result (``None``: 0; on any exception, 1 after
    printing its traceback); returns the child's pid.

    The child leaves with ``os._exit``, after flushing stdout and stderr: no interpreter teardown in a
    fork of a process that imported torch (see ``stock_lightning.py``).
    """
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            result = body()
            code = 0 if result is None else result
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def store_socket() -> socket.socket:
    """A socket listening on a free loopback port, for the store of a job whose ranks are forked from
    this process (:func:`join_forked_group`). Bound before the ranks start: a port chosen free and then
    released can be taken meanwhile, by another job started at the same moment too, whose ranks then
    join this job's store and mix with its ranks (two fault cases' ranks did once, and the case passed
    for the wrong ranks)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def join_forked_group(rank: int, world_size: int, listener: socket.socket) -> None:
    """``init_process_group("gloo")`` in a rank forked after :func:`store_socket`: rank 0 serves the job's
    store on the inherited ``listener`` (as ``init_method="tcp://..."`` makes rank 0 serve it), the
    others close their copy and connect to it."""
    import torch.distributed as dist

    port = listener.getsockname()[1]
    if rank == 0:
        # The store owns the descriptor now: the socket object must not close it when it goes away.
        store = dist.TCPStore("127.0.0.1", port, world_size, True, master_listen_fd=listener.detach())
    else:
        listener.close()
        store = dist.TCPStore("127.0.0.1", port, world_size, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


# ---------------------------------------------------------------------- batches of scenario_resume.py jobs


class Batch:
    """Jobs to run, grouped by world size; :meth:`run` launches each group once.

    Starting a rank costs seconds (importing Lightning), a job in a running rank well under one: each
    world size's jobs (fits, resumes, evaluations, error cases) run in one launch, in order; every job
    writes its own result file, a failing job writes its traceback and the next one runs.
    """

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.env = env
        self.jobs: dict[int, list[list[str]]] = {}
        self.outs: dict[str, Path] = {}

    def add(self, name: str, world: int, phase: str, *flags: str) -> None:
        out = self.root / f"{name.replace('/', '_')}.result.pt"
        self.outs[name] = out
        self.jobs.setdefault(world, []).append([phase, "--out", str(out), *flags])

    def run(self, timeout: float = 300) -> None:
        for world, jobs in sorted(self.jobs.items(), reverse=True):
            jobs_file = self.root / f"jobs-{world}-{len(self.outs)}.pt"
            import torch

            torch.save(jobs, jobs_file)
            run_batch(SCENARIO, world, jobs_file, timeout=timeout, env=self.env)
        self.jobs = {}


def run_batch(
    script: Path, world: int, jobs_file: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> None:
    """``script batch JOBS_FILE`` on ``world`` ranks; once more if the free port was taken meanwhile."""
    try:
        run_ranks(script, world, "batch", str(jobs_file), timeout=timeout, env=env)
    except AssertionError as ex:
        # The free port can be taken by another process between choosing and binding it.
        if not _port_taken(str(ex)):
            raise
        run_ranks(script, world, "batch", str(jobs_file), timeout=timeout, env=env)


def _port_taken(output: str) -> bool:
    text = output.lower()
    return "address already in use" in text or "eaddrinuse" in text


class Results:
    """The result of every job by name; a job that failed or never ran fails the test that reads it."""

    def __init__(self, outs: dict[str, Path]) -> None:
        self.outs = outs

    def __getitem__(self, name: str) -> Any:
        out = self.outs[name]
        assert out.is_file(), f"job {name!r} wrote no result (it did not run, or rank 0 died)"
        import torch

        result = torch.load(out, weights_only=False)
        if isinstance(result, dict) and "failed" in result:
            raise AssertionError(f"job {name!r} failed:\n{result['failed']}")
        return result


# ---------------------------------------------------------------------------- the zygote's side


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


#: A rank's process: started cold, or forked by the zygote.
Rank = subprocess.Popen[str] | ForkedRank


class Zygote:
    """The test session's zygote process and the bookkeeping of the ranks it forked."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.launch"],
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
