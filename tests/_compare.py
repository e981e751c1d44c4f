"""Exact, structural comparison of checkpoint dicts (tensors by dtype, shape and every value)."""

from __future__ import annotations

from typing import Any

import torch


def assert_same(actual: Any, expected: Any, where: str = "checkpoint") -> None:
    """Assert two nested structures of dicts, lists, tensors and plain values are exactly equal."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {type(actual).__name__}, expected a dict"
        assert sorted(map(str, actual)) == sorted(map(str, expected)), (
            f"{where}: keys {list(actual)} != {list(expected)}"
        )
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), f"{where}: {type(actual).__name__}, expected a sequence"
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}, expected a tensor"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, (
            f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        assert torch.equal(actual.cpu(), expected.cpu()), f"{where}: values differ"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"
