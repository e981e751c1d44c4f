"""The strategies' names in Lightning's ``StrategyRegistry``: ``Trainer(strategy="sharded_fsdp")``.

Registered on ``import lightning_sharded`` without importing Lightning: at once when
``lightning.pytorch.strategies`` is imported already, else right after it is (a post-import hook).
The LightningCLI run that picks them from YAML is ``examples/lightning_cli.py`` (``tests/test_docs.py``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry

from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy, _registry
from lightning_sharded._registry import STRATEGIES
from tests.distributed.launch import launcher_env

NAMES = ["sharded_fsdp", "sharded_fsdp_cpu_offload", "sharded_model_parallel"]


@pytest.mark.parametrize("name", NAMES)
def test_a_trainer_makes_the_strategy_from_its_name_on_cpu(name: str) -> None:
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    strategy = trainer.strategy
    expected = ShardedModelParallelStrategy if name == "sharded_model_parallel" else ShardedFSDPStrategy
    assert type(strategy) is expected
    assert strategy.num_processes == 2 and strategy.root_device.type == "cpu"
    if expected is ShardedFSDPStrategy:
        assert strategy.cpu_offload.offload_params is (name == "sharded_fsdp_cpu_offload")
        assert strategy._sharded_state_dict_type == "sharded"
    assert "lightning_sharded" in StrategyRegistry[name]["description"]
    # Not among the names the Trainer refuses on CPU ("The strategy `fsdp` requires a GPU accelerator").
    assert name not in FSDPStrategy.get_registered_strategies()


def test_cpu_offloading_on_cpu_is_refused_with_the_name_to_use_instead() -> None:
    trainer = L.Trainer(strategy="sharded_fsdp_cpu_offload", accelerator="cpu", devices=1, logger=False)
    with pytest.raises(
        ValueError, match=r"with `accelerator='cpu'` they are on the CPU already.*'sharded_fsdp'"
    ):
        trainer.strategy.setup_environment()


def test_register_strategies_registers_the_classes_themselves_as_lightning_does() -> None:
    registry = _StrategyRegistry()
    ShardedFSDPStrategy.register_strategies(registry)
    ShardedModelParallelStrategy.register_strategies(registry)
    assert sorted(registry) == sorted(STRATEGIES) == NAMES
    assert registry["sharded_fsdp"]["strategy"] is ShardedFSDPStrategy
    assert isinstance(registry.get("sharded_fsdp_cpu_offload"), ShardedFSDPStrategy)
    assert type(registry.get("sharded_model_parallel")) is ShardedModelParallelStrategy


OURS_FIRST = """
import sys
import lightning_sharded
assert "lightning.pytorch" not in sys.modules, "importing lightning_sharded imported Lightning"
from lightning.pytorch.strategies import StrategyRegistry
missing = [n for n in NAMES if n not in StrategyRegistry]
assert not missing, missing
assert "lightning_sharded.strategies" not in sys.modules, "registering imported the strategies"
import lightning as L
strategy = L.Trainer(strategy="sharded_fsdp", accelerator="cpu", devices=1).strategy
assert type(strategy).__name__ == "ShardedFSDPStrategy", strategy
print("registered")
"""


def test_the_names_are_there_when_lightning_is_imported_after_lightning_sharded() -> None:
    """A fresh interpreter: ``import lightning_sharded`` does not import ``lightning.pytorch``, and the
    names are in the registry once Lightning is imported (the other order: this process, the zygote's
    ranks and the examples, which import Lightning first)."""
    code = f"NAMES = {NAMES!r}\n{OURS_FIRST}"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=launcher_env(), capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("registered"), proc.stdout + proc.stderr


def test_the_post_import_hook_registers_right_after_the_module_executes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook, on a stand-in for ``lightning.pytorch.strategies`` (a module that makes a registry)."""
    (tmp_path / "fake_strategies.py").write_text(
        "from lightning.fabric.strategies.registry import _StrategyRegistry\n"
        "StrategyRegistry = _StrategyRegistry()\n"
        "PATCHED = 'exec_module' in vars(__loader__)  # the hook replaced a method of the loader\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_registry, "REGISTRY_MODULE", "fake_strategies")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, "fake_strategies", raising=False)
    _registry.install()
    assert sum(isinstance(f, _registry._RegisterAfterImport) for f in sys.meta_path) == 1
    import fake_strategies  # type: ignore[import-not-found]

    assert sorted(fake_strategies.StrategyRegistry) == NAMES
    assert not any(isinstance(f, _registry._RegisterAfterImport) for f in sys.meta_path)  # removed itself
    assert fake_strategies.__loader__.exec_module.__func__ is type(fake_strategies.__loader__).exec_module
    assert fake_strategies.__spec__.loader is fake_strategies.__loader__  # the loader that found it
    assert not fake_strategies.PATCHED  # the loader ran with its own methods
    made = fake_strategies.StrategyRegistry.get("sharded_fsdp_cpu_offload")
    assert type(made) is ShardedFSDPStrategy and made.cpu_offload.offload_params
    # Already imported: registered at once, no hook.
    del fake_strategies.StrategyRegistry["sharded_fsdp"]
    _registry.install()
    assert "sharded_fsdp" in fake_strategies.StrategyRegistry
    assert not any(isinstance(f, _registry._RegisterAfterImport) for f in sys.meta_path)
