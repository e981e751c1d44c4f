"""The tests' shared checks: exact comparisons of checkpoint dicts by structure (tensors by dtype, shape
and every value) and of the values a scenario gathered after a restore against those it saved; which
version a checkpoint holds; the command line run in this process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from lightning_sharded import load_checkpoint, verify_checkpoint
from lightning_sharded.cli import main


def assert_same(actual: Any, expected: Any, where: str = "checkpoint", ordered: bool = False) -> None:
    """Assert two nested structures of dicts, lists, tensors and plain values are exactly equal.

    With ``ordered``, each dict's keys in the same order too.
    """
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {type(actual).__name__}, expected a dict"
        order = list if ordered else sorted
        assert order(map(str, actual)) == order(map(str, expected)), (
            f"{where}: keys {list(actual)} != {list(expected)}"
        )
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]", ordered)
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), f"{where}: {type(actual).__name__}, expected a sequence"
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]", ordered)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}, expected a tensor"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, (
            f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        assert torch.equal(actual.cpu(), expected.cpu()), f"{where}: values differ"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def assert_restored(
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


def assert_version(
    path: Any, version: int, weights: dict[str, torch.Tensor], verify_while_loading: bool = False
) -> None:
    """The checkpoint at ``path`` is whole and is version ``version``: its ``global_step`` is ``version``
    and each of ``weights`` equals its ``state_dict`` entry exactly.

    Whole: ``verify_checkpoint`` passes first, or (``verify_while_loading``) the load checks every
    checksum as it reads.
    """
    if not verify_while_loading:
        verify_checkpoint(path)
    loaded = load_checkpoint(path, verify=verify_while_loading)
    assert loaded["global_step"] == version
    for name, value in weights.items():
        assert torch.equal(loaded["state_dict"][name], value), name


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``lightning-sharded ARGV`` in this process: its exit code, stdout and stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
