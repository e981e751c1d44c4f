"""The tests' shared checks: exact comparisons of checkpoint dicts by structure (tensors by dtype, shape
and every value) and of the values a scenario gathered after a restore against those it saved; a sharded
model's full values to compare; which version a checkpoint holds; the command line run in this process;
a quiet Trainer."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightning_sharded import load_checkpoint, verify_checkpoint

if TYPE_CHECKING:
    import lightning as L
    import pytest


def assert_identical(actual: Any, expected: Any, where: str = "checkpoint") -> None:
    """Equal, and of the same types (an AttributeDict, a tuple...), tensors by dtype, shape, strides and
    ``requires_grad`` too, NaN equal to NaN."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_identical(a, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        same = (actual.dtype, actual.shape, actual.stride(), actual.requires_grad)
        assert same == (expected.dtype, expected.shape, expected.stride(), expected.requires_grad), where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual), where
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


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


def full_values(
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    skip: Callable[[str], bool] = lambda key: False,
    optimizer_key: str = "opt{index}",
    lr: bool = False,
) -> dict[str, Any]:
    """A sharded model's full model and optimizer state as plain CPU tensors, gathered with torch's
    helpers (collective over the model's ranks), for exact comparisons.

    Keys: ``model.KEY`` for each model key but those ``skip(KEY)`` holds for (the caller records them
    itself), ``<optimizer_key>.PARAM.ENTRY`` for each optimizer's state (``optimizer_key`` formatted with
    the optimizer's ``index``), and with ``lr``, ``<optimizer_key>.lr``: each parameter group's rate.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    values: dict[str, Any] = {
        f"model.{key}": value.detach().cpu().clone()  # in one process it can be the live tensor
        for key, value in get_model_state_dict(model, options=options).items()
        if not skip(key)
    }
    for index, optimizer in enumerate(optimizers):
        name = optimizer_key.format(index=index)
        state = get_optimizer_state_dict(model, optimizer, options=options)
        for param, entries in state.get("state", {}).items():
            for entry, value in entries.items():
                values[f"{name}.{param}.{entry}"] = torch.as_tensor(value).cpu().clone()
        if lr and state:
            values[f"{name}.lr"] = torch.tensor([group["lr"] for group in state["param_groups"]])
    return values


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
    from lightning_sharded.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def quiet_trainer(callbacks: Sequence[Any] = (), **settings: Any) -> L.Trainer:
    """A CPU ``Trainer`` with ``settings`` that logs and shows nothing (no logger, progress bar or model
    summary) and checkpoints only with a ``ModelCheckpoint`` among ``callbacks``."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    return L.Trainer(
        accelerator="cpu",
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        **settings,
    )
