"""Runs the scenario script once per distinct configuration and compares gathered full values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.distributed.launch import run_ranks

SCENARIO = Path(__file__).with_name("scenario_resume.py")


class Runs:
    """Launches of ``scenario_resume.py``, cached by their arguments for the whole test session.

    ``fit(name, world, *flags)`` trains and saves ``<root>/<name>`` once; ``resume`` and the other
    phases always run. Results come back as the dicts the scenario wrote.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fits: dict[str, dict[str, Any]] = {}

    def ckpt(self, name: str) -> Path:
        return self.root / name

    def fit(self, name: str, world: int, *flags: str, timeout: float = 120) -> dict[str, Any]:
        if name not in self._fits:
            out = self.root / f"{name}.saved.pt"
            run_ranks(
                SCENARIO,
                world,
                "fit",
                "--ckpt",
                str(self.ckpt(name)),
                "--out",
                str(out),
                *flags,
                timeout=timeout,
            )
            self._fits[name] = torch.load(out, weights_only=False)
        return self._fits[name]

    def run(self, phase: str, world: int, name: str, *flags: str, timeout: float = 120) -> Any:
        out = self.root / f"{name}.{phase}.{world}.{abs(hash(flags))}.pt"
        args = ["--out", str(out), *flags]
        if phase != "errors":
            args = ["--ckpt", str(self.ckpt(name)), *args]
        run_ranks(SCENARIO, world, phase, *args, timeout=timeout)
        return torch.load(out, weights_only=False)


def assert_same(saved: dict[str, Any], restored: dict[str, Any], keys: list[str] | None = None) -> None:
    """Every tensor of ``saved`` (or the given keys) equals the restored one exactly; the step too."""
    keys = sorted(k for k in saved if k != "global_step") if keys is None else keys
    assert keys, "nothing to compare"
    missing = [k for k in keys if k not in restored]
    assert not missing, f"not restored: {missing}"
    differ = [k for k in keys if not torch.equal(torch.as_tensor(saved[k]), torch.as_tensor(restored[k]))]
    assert not differ, f"restored values differ from the saved ones for {differ}"
    assert restored["global_step"] == saved["global_step"]


def model_keys(values: dict[str, Any]) -> list[str]:
    return sorted(k for k in values if k.startswith("model."))


def optimizer_keys(values: dict[str, Any]) -> list[str]:
    return sorted(k for k in values if k.startswith("opt"))
