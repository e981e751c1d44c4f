"""Where stock ``FSDPStrategy`` / ``ModelParallelStrategy`` raise for a case ours refuses too, ours raises an
instance of stock's type whose message holds stock's words (then adds ours): an ``except`` or a
``pytest.raises(..., match=...)`` written against stock keeps working after swapping the strategy.

Each case runs stock's strategy and ours in the same test where that is cheap (one process, no process
group); where stock needs a trained model to get there, stock's words are read from its installed source.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn

import lightning_sharded
from lightning_sharded import CheckpointError, ShardedFSDPStrategy, ShardedModelParallelStrategy
from lightning_sharded.checkpoint.errors import MissingCheckpointError, OptimizerCountError
from lightning_sharded.checkpoint.load.checks import check_optimizer_count

STOCK_AND_OURS = pytest.mark.parametrize("flavour", ["stock", "ours"])


class _Module(pl.LightningModule):
    def configure_model(self) -> None:
        pass


def _ready(strategy: Any) -> Any:
    """A strategy with a model and a LightningModule, as after setup (no process group)."""
    module = _Module()
    strategy.model = nn.Linear(2, 2)
    strategy._lightning_module = module
    return strategy


@STOCK_AND_OURS
def test_unknown_state_dict_type(flavour: str, tmp_path: Path) -> None:
    """Stock raises at save time; ours already at construction (before a run's hours of training)."""
    with pytest.raises(ValueError, match="Unknown state_dict_type: partial"):
        if flavour == "stock":
            FSDPStrategy(state_dict_type="partial").save_checkpoint({}, tmp_path / "c")  # type: ignore[arg-type]
        else:
            ShardedFSDPStrategy(state_dict_type="partial")  # type: ignore[arg-type]


@pytest.mark.parametrize("flavour", ["stock", "ours"])
@pytest.mark.parametrize(
    ("stock_cls", "ours_cls"),
    [(FSDPStrategy, ShardedFSDPStrategy), (ModelParallelStrategy, ShardedModelParallelStrategy)],
)
def test_storage_options(flavour: str, stock_cls: type, ours_cls: type, tmp_path: Path) -> None:
    name = stock_cls.__name__
    words = rf"`{name}.save_checkpoint\(\.\.\., storage_options=\.\.\.\)` is not supported because `{name}`"
    strategy = stock_cls() if flavour == "stock" else ours_cls()
    with pytest.raises(TypeError, match=words):
        strategy.save_checkpoint({"state_dict": {}}, tmp_path / "c", storage_options={"acl": "private"})


@STOCK_AND_OURS
def test_a_full_save_onto_a_directory(flavour: str, tmp_path: Path) -> None:
    target = tmp_path / "full.ckpt"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(IsADirectoryError, match="The checkpoint path exists and is a directory"):
        if flavour == "stock":
            FSDPStrategy(state_dict_type="full").save_checkpoint({"state_dict": {}}, target)
        else:
            from lightning_sharded.checkpoint.save import write_full_checkpoint

            write_full_checkpoint(target, {"state_dict": {}}, rank=0)
    assert (target / "notes.txt").read_text() == "mine"


@STOCK_AND_OURS
def test_a_path_with_nothing_there(flavour: str, tmp_path: Path) -> None:
    """Ours: the detection every load runs first (the strategies' ``load_checkpoint``, the tools), here
    through ``lightning_sharded.load_checkpoint`` (the strategy's needs a fitted Trainer)."""
    missing = tmp_path / "nowhere.ckpt"
    with pytest.raises(ValueError, match="does not point to a valid checkpoint") as raised:
        if flavour == "stock":
            _ready(FSDPStrategy()).load_checkpoint(missing)
        else:
            lightning_sharded.load_checkpoint(missing)
    if flavour == "ours":
        assert isinstance(raised.value, MissingCheckpointError) and isinstance(raised.value, CheckpointError)
        assert isinstance(raised.value, FileNotFoundError)  # what it was before, kept


@STOCK_AND_OURS
@pytest.mark.parametrize("holds", ["nothing", "other files"])
def test_a_directory_that_is_not_a_checkpoint(flavour: str, holds: str, tmp_path: Path) -> None:
    """Stock refuses a directory without DCP's ``.metadata`` with its ValueError; ours, whatever it says
    of the directory, holds its words (also for shards without ``.metadata``, which stock tries to read)."""
    directory = tmp_path / "run"
    directory.mkdir()
    if holds == "other files":
        (directory / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="does not point to a valid checkpoint"):
        if flavour == "stock":
            _ready(FSDPStrategy()).load_checkpoint(directory)
        else:
            lightning_sharded.load_checkpoint(directory)
    if flavour == "ours":
        (directory / "__0_0.distcp").write_bytes(b"x")
        (directory / "meta.pt").write_bytes(b"x")
        with pytest.raises(
            CheckpointError, match=r"no `\.metadata` file.*does not point to a valid checkpoint"
        ):
            lightning_sharded.load_checkpoint(directory)


def test_the_optimizer_count() -> None:
    """Stock raises it inside a full load of a fitted model (not cheap): its words are read from the
    installed Lightning's source, and ours must hold them."""
    source = inspect.getsource(FSDPStrategy.load_checkpoint)
    assert "raise RuntimeError(" in source
    assert (
        'optimizers but the checkpoint contains"' in source and "optimizers to load. Please resume" in source
    )
    with pytest.raises(
        RuntimeError, match="1 optimizers but the checkpoint contains 2 optimizers to load"
    ) as raised:
        check_optimizer_count("ckpt", 1, 2)
    assert isinstance(raised.value, OptimizerCountError) and isinstance(raised.value, CheckpointError)
    assert "Please resume training with the same number of optimizers" in str(raised.value)
    assert "'ckpt'" in str(raised.value)  # ours: which checkpoint


@pytest.mark.parametrize("flavour", ["stock", "ours", "ours-with-policy"])
def test_fsdp1_modules_under_model_parallel(flavour: str) -> None:
    from lightning.pytorch.accelerators import CPUAccelerator
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = nn.Module.__new__(FullyShardedDataParallel)  # an FSDP1 module, without a process group
    nn.Module.__init__(wrapped)
    if flavour == "stock":
        strategy = ModelParallelStrategy()
    elif flavour == "ours":
        strategy = ShardedModelParallelStrategy()
    else:
        strategy = ShardedModelParallelStrategy(fully_shard_policy={nn.Linear})
    strategy.accelerator = CPUAccelerator()
    strategy._lightning_module = _Module()
    strategy.model = nn.Sequential(wrapped)
    trainer = type("Trainer", (), {})()
    with pytest.raises(
        TypeError, match=re.escape("only supports the new FSDP2 APIs in PyTorch >= 2.4")
    ) as raised:
        strategy.setup(trainer)  # type: ignore[arg-type]
    if flavour != "stock":
        assert "use `ShardedFSDPStrategy`" in str(raised.value)
