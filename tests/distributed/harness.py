"""Exact comparisons of the values the scenarios gather."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


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
