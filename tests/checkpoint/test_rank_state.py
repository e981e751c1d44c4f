"""Per-rank state in one process: RNG states, the safe file format, what a resume restores and warns."""

from __future__ import annotations

import copy
import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_sharded import CheckpointError, ShardedFSDPStrategy, ShardedModelParallelStrategy
from lightning_sharded.checkpoint import names, rank_state
from lightning_sharded.checkpoint.backends import LocalBackend
from lightning_sharded.checkpoint.detect import CheckpointKind, Found


def found_at(path: Path) -> Found:
    """What a load found at ``path`` (a local directory or file), as ``Restored.found`` gives it."""
    return Found(path, path, CheckpointKind.SHARDED, LocalBackend(), None)


def draws() -> tuple[list[float], float, list[float]]:
    return torch.rand(3).tolist(), random.random(), np.random.rand(3).tolist()


def test_rng_states_round_trip_through_a_weights_only_file() -> None:
    states = rank_state.rng_states()
    assert set(states) == {"torch", "python", "numpy"}  # CUDA only when initialized
    expected = draws()
    data = rank_state.to_bytes({"rng": states})
    loaded = torch.load(io.BytesIO(data), weights_only=True)["rng"]
    draws()  # the generators move on
    assert rank_state.set_rng_states(loaded) == []
    assert draws() == expected


def test_saved_cuda_states_that_cannot_be_set_are_reported() -> None:
    states = rank_state.rng_states()
    states["torch.cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    assert rank_state.set_rng_states(states) == [
        f"CUDA (saved for 1 device(s), {torch.cuda.device_count()} available now)"
    ]


def loop_checkpoint(loader: Any) -> dict[str, Any]:
    return {"loops": {"fit_loop": {"state_dict": {"combined_loader": loader}}}, "epoch": 0}


def full_entry(loaders: list[Any]) -> dict[str, Any]:
    """What a full file holds under the rank-state key, for ``len(loaders)`` ranks."""
    states = [
        rank_state.collect(loop_checkpoint(loader), rank=r, world_size=len(loaders))
        for r, loader in enumerate(loaders)
    ]
    return {"format": rank_state.FORMAT, "world_size": len(loaders), "ranks": states}


def test_collect_takes_this_ranks_loader_state() -> None:
    state = rank_state.collect(loop_checkpoint([{"pos": 3}]), rank=1, world_size=2)
    assert state["rank"] == 1 and state["world_size"] == 2 and state["train_dataloader"] == [{"pos": 3}]
    assert rank_state.collect({"epoch": 0}, rank=0, world_size=1)["train_dataloader"] is None


def test_restore_at_the_same_world_size_gives_back_the_state() -> None:
    metadata = loop_checkpoint([{"pos": 0}])  # as Lightning wrote it: rank 0's
    metadata[names.RANK_STATE_KEY] = full_entry([[{"pos": 5}]])
    outcome = rank_state.restore(
        metadata, found_at(Path("x.ckpt")), rank=0, world_size=1, weights_only=True, path="x"
    )
    assert names.RANK_STATE_KEY not in metadata
    assert rank_state.loader_state(metadata) == [{"pos": 5}]
    assert outcome.warning is None and outcome.saved_world_size == 1
    assert outcome.rng is not None and torch.equal(outcome.rng["torch"], torch.get_rng_state())


def test_restore_at_another_world_size_warns_and_keeps_a_loader_state_all_ranks_share() -> None:
    metadata = loop_checkpoint([{"pos": 4}])
    metadata[names.RANK_STATE_KEY] = full_entry([[{"pos": 4}], [{"pos": 4}]])
    outcome = rank_state.restore(
        metadata, found_at(Path("x.ckpt")), rank=0, world_size=1, weights_only=True, path="x"
    )
    assert outcome.rng is None
    assert rank_state.loader_state(metadata) == [{"pos": 4}]
    assert outcome.warning == (
        "The per-rank state of 'x' was saved by 2 rank(s), this run has 1. The random number generator"
        " states (torch, CUDA, random, numpy) were not restored: they belong to ranks that do not exist now,"
        " so every rank keeps its generators as they are (call `lightning.seed_everything` for a"
        " reproducible continuation). The train dataloader state, the same on every saved rank, was restored"
        " on every rank. The model and optimizer states were restored (resharded)."
    )


def test_restore_at_another_world_size_drops_loader_states_that_differ() -> None:
    metadata = loop_checkpoint([{"pos": 4, "perm": torch.tensor([1, 0])}])
    metadata[names.RANK_STATE_KEY] = full_entry(
        [[{"pos": 4, "perm": torch.tensor([1, 0])}], [{"pos": 4, "perm": torch.tensor([0, 1])}]]
    )
    outcome = rank_state.restore(
        metadata, found_at(Path("x.ckpt")), rank=0, world_size=1, weights_only=True, path="x"
    )
    assert rank_state.loader_state(metadata) is None
    assert outcome.rng is None and outcome.warning is not None
    assert outcome.warning.endswith(
        " The train dataloader state was not restored either: it differs between the saved ranks (each had"
        " its own position or shuffle), so every train dataloader starts from its beginning. The model and"
        " optimizer states were restored (resharded)."
    )


def test_a_checkpoint_without_rank_state_is_left_as_it_is() -> None:
    metadata = loop_checkpoint([{"pos": 2}])
    before = copy.deepcopy(metadata)
    outcome = rank_state.restore(
        metadata, found_at(Path("x.ckpt")), rank=0, world_size=2, weights_only=True, path="x"
    )
    assert outcome == rank_state.RankRestore() and metadata == before


def test_a_missing_rank_file_names_it(tmp_path: Path) -> None:
    metadata = loop_checkpoint(None)
    metadata[names.RANK_STATE_KEY] = rank_state.marker(1)
    with pytest.raises(CheckpointError) as err:
        rank_state.restore(metadata, found_at(tmp_path), rank=0, world_size=1, weights_only=True, path="ckpt")
    where = str(tmp_path / "rank_state" / "rank-00000.pt")
    assert str(err.value).startswith(
        f"Could not read the per-rank state {where!r} of rank 0: FileNotFoundError"
    )


def test_a_file_of_another_rank_is_refused(tmp_path: Path) -> None:
    (tmp_path / "rank_state").mkdir()
    state = rank_state.collect({}, rank=1, world_size=1)
    (tmp_path / names.rank_state_file(0)).write_bytes(rank_state.to_bytes(state))
    metadata: dict[str, Any] = {names.RANK_STATE_KEY: rank_state.marker(1)}
    with pytest.raises(CheckpointError, match=r"is not rank 0's state written by lightning_sharded"):
        rank_state.restore(metadata, found_at(tmp_path), rank=0, world_size=1, weights_only=True, path="ckpt")


@pytest.mark.parametrize("cls", [ShardedFSDPStrategy, ShardedModelParallelStrategy])
def test_save_rank_state_is_on_by_default_and_can_be_turned_off(cls: Any) -> None:
    checkpoint = loop_checkpoint([{"pos": 1}])
    strategy = cls()
    assert strategy.save_rank_state is True
    files = strategy._add_rank_state(checkpoint)
    assert files is not None and list(files) == ["rank_state/rank-00000.pt"]
    assert checkpoint[names.RANK_STATE_KEY] == {"format": 1, "world_size": 1, "dir": "rank_state"}
    saved = torch.load(io.BytesIO(files["rank_state/rank-00000.pt"]), weights_only=True)
    assert saved["train_dataloader"] == [{"pos": 1}] and saved["rank"] == 0

    full = cls(state_dict_type="full")
    assert full._add_rank_state(checkpoint) is None
    assert [s["train_dataloader"] for s in checkpoint[names.RANK_STATE_KEY]["ranks"]] == [[{"pos": 1}]]

    off = loop_checkpoint([{"pos": 1}])
    assert cls(save_rank_state=False)._add_rank_state(off) is None and names.RANK_STATE_KEY not in off


def entries_with(
    loaders: list[Any], generators: list[Any], registered: list[dict[str, Any]]
) -> dict[str, Any]:
    """A full file's rank-state entry whose ranks have these loader, generator and registered states."""
    states = [
        rank_state.collect(
            loop_checkpoint(loader), rank=r, world_size=len(loaders), generators=gen, registered=reg
        )
        for r, (loader, gen, reg) in enumerate(zip(loaders, generators, registered, strict=True))
    ]
    return {"format": rank_state.FORMAT, "world_size": len(loaders), "ranks": states}


def test_restore_at_the_same_world_size_gives_back_generators_and_registered_states() -> None:
    gen = [{"generator": torch.Generator().manual_seed(4).get_state()}]
    metadata = loop_checkpoint(None)
    metadata[names.RANK_STATE_KEY] = entries_with([None], [gen], [{"curriculum": {"level": 3}}])
    outcome = rank_state.restore(
        metadata, found_at(Path("x.ckpt")), rank=0, world_size=1, weights_only=True, path="x"
    )
    assert outcome.registered == {"curriculum": {"level": 3}} and outcome.registered_saved == ("curriculum",)
    assert outcome.generators is not None and torch.equal(
        outcome.generators[0]["generator"], gen[0]["generator"]
    )
    assert outcome.warning is None


def test_another_world_size_restores_what_every_saved_rank_had_alike_and_names_the_rest() -> None:
    same_gen = [{"generator": torch.Generator().manual_seed(4).get_state()}]
    metadata = loop_checkpoint([{"pos": 4}])
    metadata[names.RANK_STATE_KEY] = entries_with(
        [[{"pos": 4}], [{"pos": 4}]],
        [same_gen, same_gen],
        [{"mix": {"w": 0.5}, "rng": {"s": 1}}, {"mix": {"w": 0.5}, "rng": {"s": 2}}],
    )
    outcome = rank_state.restore(
        metadata, found_at(Path("x.ckpt")), rank=0, world_size=1, weights_only=True, path="x"
    )
    assert outcome.rng is None and outcome.registered == {"mix": {"w": 0.5}}
    assert outcome.generators is not None and torch.equal(
        outcome.generators[0]["generator"], same_gen[0]["generator"]
    )
    assert sorted(outcome.registered_saved) == ["mix", "rng"]
    assert outcome.warning is not None and outcome.warning.endswith(
        " The train dataloader state, the same on every saved rank, was restored on every rank. The"
        " registered per-rank state 'mix', the same on every saved rank, was restored on every rank. The"
        " registered per-rank state 'rng' was not restored: it differs between the saved ranks, so those"
        " objects keep their current state. The model and optimizer states were restored (resharded)."
    )


def test_generators_that_differ_between_saved_ranks_drop_the_loader_state_at_another_world_size() -> None:
    gens = [[{"generator": torch.Generator().manual_seed(1000 + r).get_state()}] for r in range(2)]
    metadata = loop_checkpoint(None)  # a plain DataLoader: no loader state, only its generator
    metadata[names.RANK_STATE_KEY] = entries_with([None, None], gens, [{}, {}])
    outcome = rank_state.restore(
        metadata, found_at(Path("x.ckpt")), rank=0, world_size=1, weights_only=True, path="x"
    )
    assert outcome.generators is None and outcome.registered == {}
    assert (
        outcome.warning is not None
        and " The train dataloader state was not restored either" in outcome.warning
    )
    assert "registered" not in outcome.warning


def test_one_saved_rank_resumed_on_two_gives_its_loader_state_and_generators_to_every_rank() -> None:
    gen = [{"generator": torch.Generator().manual_seed(7).get_state()}]
    metadata = loop_checkpoint([{"pos": 6}])
    metadata[names.RANK_STATE_KEY] = entries_with([[{"pos": 6}]], [gen], [{"mix": {"w": 0.25}}])
    outcome = rank_state.restore(
        metadata, found_at(Path("x.ckpt")), rank=1, world_size=2, weights_only=True, path="x"
    )
    assert outcome.rng is None and outcome.registered == {"mix": {"w": 0.25}}
    assert outcome.generators is not None and torch.equal(
        outcome.generators[0]["generator"], gen[0]["generator"]
    )
    assert outcome.warning is not None and "was restored on every rank" in outcome.warning
