"""Single-process sharded saves to S3 killed at the commit's fault points, with real SIGKILLs.

    s3_fault_driver.py crash|save URL_PREFIX OUT_JSON CASE...

``crash``: for each case, saves version 1 at ``URL_PREFIX/<case>``, then version 2 with
``LIGHTNING_SHARDED_FAULT=<case>`` (the process kills itself there). ``save``: saves version 3 at
each case's URL, normally. The cases run at once, each in a process forked from this one after the
imports (fast, and never a fork of a process with threads such as pytest's), and every save in a process
forked from its case's. ``OUT_JSON`` gets each case's
exit codes (negative: killed by that signal). The version ``v`` is ``{"model": {"w": full(4, v)}}``
with global step ``v``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_sharded.checkpoint import save as io
from tests.distributed.launch import fork
from tests.fault_injection import FAULT_ENV, install

install()


def save(url: str, version: int, fault: str = "") -> int:
    """Fork a process that saves ``version`` at ``url`` with ``fault``; returns its exit code."""

    def saving() -> None:
        os.environ[FAULT_ENV] = fault
        state = {"model": {"w": torch.full((4,), float(version))}}
        io.write_sharded_checkpoint(url, state, {"global_step": version}, rank=0)

    _, status = os.waitpid(fork(saving), 0)
    return os.waitstatus_to_exitcode(status)


def run_case(phase: str, url: str, case: str) -> list[int]:
    """One case's saves, in order: its exit codes."""
    if phase == "crash":
        return [save(url, 1), save(url, 2, case)]
    return [save(url, 3)]


def main(argv: list[str]) -> None:
    phase, prefix, out, cases = argv[0], argv[1], Path(argv[2]), argv[3:]

    # The cases are independent (each its own URL): each runs in a process of its own, all at once.
    def running(case: str) -> None:
        codes = run_case(phase, f"{prefix}/{case}", case)
        out.with_name(f"{out.name}.{case}").write_text(json.dumps(codes))

    children = {case: fork(functools.partial(running, case)) for case in cases}
    failed = [case for case, pid in children.items() if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])]
    if failed:
        raise SystemExit(f"the driver of case(s) {failed} failed")
    results = {case: json.loads(out.with_name(f"{out.name}.{case}").read_text()) for case in cases}
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
