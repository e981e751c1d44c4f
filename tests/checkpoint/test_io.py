"""The checkpoint core on a plain module in one process (no process group): save, restore, no fake step."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sharded import CheckpointError
from lightning_sharded.checkpoint import load, save, state_dicts


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(5, 3)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)

    def no_step(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("restoring ran an optimizer step")

    optimizer.step = no_step  # type: ignore[method-assign]
    return model, optimizer


def _save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, sharded: bool) -> None:
    checkpoint = {
        "state_dict": state_dicts.model_state_dict(model, full=not sharded),
        "optimizer_states": [state_dicts.optimizer_state_dict(model, optimizer, full=not sharded)],
        "global_step": 2,
    }
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", UserWarning
        )  # DCP: "assuming the intent is to save in a single process"
        save.save_checkpoint(path, checkpoint, sharded=sharded, model_key="model", rank=0)


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full"])
def test_round_trip_restores_weights_and_adam_state_without_a_step(tmp_path: Path, sharded: bool) -> None:
    model, optimizer = _trained()
    path = tmp_path / "ckpt"
    _save(path, model, optimizer, sharded)
    assert path.is_dir() is sharded
    fresh, fresh_optimizer = _fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        restored = load.restore_checkpoint(path, fresh, [fresh_optimizer])
    assert restored.metadata["global_step"] == 2 and not restored.keys
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    expected, actual = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert expected["param_groups"] == actual["param_groups"]  # lr 0.1 back from the checkpoint
    for index, entries in expected["state"].items():
        for entry, value in entries.items():
            assert torch.equal(value, actual["state"][index][entry]), (index, entry)


def test_strict_restore_refuses_other_keys_before_touching_the_model(tmp_path: Path) -> None:
    model, optimizer = _trained()
    _save(tmp_path / "ckpt", model, optimizer, sharded=True)
    other = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.Linear(2, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=r'Missing key\(s\) in the checkpoint: "3.bias", "3.weight"'):
        load.restore_checkpoint(tmp_path / "ckpt", other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    report = load.restore_checkpoint(tmp_path / "ckpt", other, strict=False).keys
    assert report.missing == ["3.bias", "3.weight"] and not report.unexpected
    assert torch.equal(other[0].weight, model[0].weight)


def test_sizes_always_and_checksums_on_request_are_checked_before_reading(tmp_path: Path) -> None:
    model, optimizer = _trained()
    path = tmp_path / "ckpt"
    _save(path, model, optimizer, sharded=True)
    shard = next(path.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: same size, another checksum
    shard.write_bytes(bytes(data))
    fresh, fresh_optimizer = _fresh()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*is corrupted"):
        load.restore_checkpoint(path, fresh, [fresh_optimizer], verify=True)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # nothing was read
    shard.write_bytes(bytes(data[:-10]))  # cut short: caught without verify
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*truncated"):
        load.restore_checkpoint(path, fresh, [fresh_optimizer])


def _wide() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model whose weight (2 MiB) and Adam states are read directly, with small entries beside them."""
    model = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 1024)).sum().backward()
    optimizer.step()
    return model, optimizer


def _load_wide(path: Path, verify: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    fresh, optimizer = _wide()
    optimizer.state.clear()
    optimizer.param_groups[0]["lr"] = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load.restore_checkpoint(path, fresh, [optimizer], verify=verify)  # type: ignore[arg-type]
    return fresh, optimizer


@pytest.mark.parametrize("mode", ["during", True])
def test_verify_checks_the_checksums_from_the_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: object
) -> None:
    """Both modes read each byte once on local files: no checksum pass before the load."""
    from lightning_sharded.checkpoint import integrity
    from lightning_sharded.checkpoint.backends import local

    torch.manual_seed(0)
    model, optimizer = _wide()
    path = tmp_path / "ckpt"
    _save(path, model, optimizer, sharded=True)
    seen: dict[str, tuple[int, int]] = {}
    real = local.ranges_checksum

    def recording(file: Path, size: int, known: list[tuple[int, int, int]]) -> tuple[int, str]:
        seen[Path(file).name] = (size, sum(length for _, length, _ in known))
        return real(file, size, known)

    monkeypatch.setattr(local, "ranges_checksum", recording)
    monkeypatch.setattr(integrity, "check_found", _no_checksums(integrity.check_found))
    monkeypatch.setattr(load, "check_found", _no_checksums(load.check_found))
    fresh, fresh_optimizer = _load_wide(path, mode)
    expected, actual = model.state_dict(), fresh.state_dict()
    assert list(expected) == list(actual) and all(torch.equal(expected[k], actual[k]) for k in expected)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.1
    assert torch.equal(
        fresh_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )
    shard = next(path.glob("__0_*.distcp")).name
    # every file, each once (the per-rank index's layout and rank 0's file included)
    assert set(seen) == {shard, ".metadata", "meta.pt", "layout.json", "rank-00000.json"}
    size, covered = seen[shard]
    # The weight and its two Adam states were read (and checksummed) as they were loaded: only the
    # small entries and the archives' headers were read again.
    assert covered == 3 * (2 << 20) and size - covered < 64 << 10
    assert seen[".metadata"][1] == seen["meta.pt"][1] == 0


def _no_checksums(check_found: Any) -> Any:
    """``check_found`` that fails a test if asked for checksums (``"during"`` must not ask)."""

    def checking(found: Any, *, verify: bool = False, **kwargs: Any) -> None:
        assert not verify, "verify='during' checksummed the files before the read"
        check_found(found, verify=verify, **kwargs)

    return checking


@pytest.mark.parametrize("where", ["tensor", "header", "meta.pt", ".metadata"])
def test_verify_during_names_the_damaged_file_and_leaves_the_optimizer_alone(
    tmp_path: Path, where: str
) -> None:
    torch.manual_seed(0)
    model, optimizer = _wide()
    path = tmp_path / "ckpt"
    _save(path, model, optimizer, sharded=True)
    file = next(path.glob("__0_*.distcp")) if where in ("tensor", "header") else path / where
    data = bytearray(file.read_bytes())
    data[len(data) // 2 if where != "header" else 40] ^= 0x01  # a tensor's bytes, or the first pickle's
    file.write_bytes(bytes(data))
    torch.manual_seed(1)
    fresh, fresh_optimizer = _wide()
    fresh_optimizer.state.clear()
    with pytest.raises(CheckpointError, match=rf"'{re.escape(file.name)}'.*is corrupted") as raised:
        load.restore_checkpoint(path, fresh, [fresh_optimizer], verify="during")
    assert not fresh_optimizer.state and fresh_optimizer.param_groups[0]["lr"] == 0.1  # not set from it
    if where == "tensor":  # found after the read: the message says what the model holds
        assert "had already read the model's tensors" in str(raised.value)
    # The same damage with verify=True leaves the model as it was: its values are read beside it.
    torch.manual_seed(1)
    fresh, fresh_optimizer = _wide()
    fresh_optimizer.state.clear()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"'{re.escape(file.name)}'.*is corrupted") as raised:
        load.restore_checkpoint(path, fresh, [fresh_optimizer], verify=True)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert not fresh_optimizer.state
    if where == "tensor":
        assert "Nothing was loaded from it: the model and the optimizers are as they were." in str(
            raised.value
        )


def test_verify_takes_only_its_modes(tmp_path: Path) -> None:
    model, optimizer = _trained()
    _save(tmp_path / "ckpt", model, optimizer, sharded=True)
    with pytest.raises(
        ValueError, match=r"verify='after' is not a way to check a checkpoint: pass False, True"
    ):
        load.restore_checkpoint(tmp_path / "ckpt", model, verify="after")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"verify='yes'"):
        from lightning_sharded import ShardedFSDPStrategy

        ShardedFSDPStrategy(verify="yes")  # type: ignore[arg-type]
    assert load.restore_checkpoint(tmp_path / "ckpt", model, verify="before").metadata["global_step"] == 2


def test_strategies_take_verify() -> None:
    from lightning_sharded import ShardedFSDPStrategy, ShardedModelParallelStrategy

    assert ShardedFSDPStrategy(verify=True).verify and not ShardedFSDPStrategy().verify
    assert ShardedModelParallelStrategy(verify=True).verify
    assert ShardedModelParallelStrategy(verify="during").verify == "during"
