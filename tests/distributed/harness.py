"""Batched launches of ``scenario_resume.py`` and exact comparisons of the values they gather.

Starting a rank costs seconds (importing Lightning), a job in a running rank well under one. So a
:class:`Batch` collects jobs (fits, resumes, evaluations, error cases) per world size and runs each
world size's jobs in one launch, in order; every job writes its own result file, a failing job
writes its traceback and the next one runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tests.distributed.launch import run_ranks

SCENARIO = Path(__file__).with_name("scenario_resume.py")


class Batch:
    """Jobs to run, grouped by world size; :meth:`run` launches each group once."""

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
        result = torch.load(out, weights_only=False)
        if isinstance(result, dict) and "failed" in result:
            raise AssertionError(f"job {name!r} failed:\n{result['failed']}")
        return result


def assert_same(
    saved: dict[str, Any], restored: dict[str, Any], keys: Sequence[str] | None = None, step: bool = True
) -> None:
    """Every model and optimizer value of ``saved`` (or the given keys) equals the restored one exactly.

    With ``step``, the restored global step too (the loops are restored only when fitting).
    """
    keys = model_keys(saved) + optimizer_keys(saved) if keys is None else list(keys)
    assert keys, "nothing to compare"
    missing = [k for k in keys if k not in restored]
    assert not missing, f"not restored: {missing}"
    differ = [k for k in keys if not torch.equal(torch.as_tensor(saved[k]), torch.as_tensor(restored[k]))]
    assert not differ, f"restored values differ from the saved ones for {differ}"
    if step:
        assert restored["global_step"] == saved["global_step"]


def model_keys(values: dict[str, Any]) -> list[str]:
    return sorted(k for k in values if k.startswith("model."))


def optimizer_keys(values: dict[str, Any]) -> list[str]:
    return sorted(k for k in values if k.startswith("opt"))
