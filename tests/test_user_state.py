"""register_rank_state: what it accepts, refuses and keeps; the generators it takes as they are."""

from __future__ import annotations

import io
import random
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

from lightning_sharded import ShardedStateMixin, register_rank_state
from lightning_sharded.user_state import registered_rank_state


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def through_a_safe_file(state: Any) -> Any:
    """``state`` after ``torch.save`` and ``torch.load(weights_only=True)``, as a resume reads it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_objects_are_kept_by_name_sorted_and_restored_from_their_state() -> None:
    module = nn.Linear(2, 2)
    counter = Counter()
    register_rank_state(module, "zeta", counter)
    register_rank_state(module, "alpha", Counter())
    objects = registered_rank_state(module)
    assert list(objects) == ["alpha", "zeta"] and objects["zeta"] is counter
    counter.n = 5
    saved = through_a_safe_file(objects["zeta"].state_dict())
    counter.n = 0
    objects["zeta"].load_state_dict(saved)
    assert counter.n == 5
    assert "zeta" not in module.state_dict() and registered_rank_state(nn.Linear(1, 1)) == {}


def draws(rng: Any) -> list[float]:
    if isinstance(rng, torch.Generator):
        return torch.rand(3, generator=rng).tolist()
    if isinstance(rng, random.Random):
        return [rng.random() for _ in range(3)]
    if isinstance(rng, np.random.Generator):
        return rng.normal(size=3).tolist()
    return rng.rand(3).tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "rng",
    [
        torch.Generator().manual_seed(3),
        random.Random(3),
        np.random.default_rng(3),  # PCG64: Python ints
        np.random.Generator(np.random.MT19937(3)),  # arrays in its state
        np.random.Generator(np.random.Philox(3)),
        np.random.RandomState(3),
    ],
    ids=["torch", "random", "pcg64", "mt19937", "philox", "randomstate"],
)
def test_generators_are_taken_as_they_are_and_round_trip_a_weights_only_file(rng: Any) -> None:
    module = nn.Linear(2, 2)
    register_rank_state(module, "rng", rng)
    entry = registered_rank_state(module)["rng"]
    draws(rng)
    saved = through_a_safe_file(entry.state_dict())
    expected = draws(rng)
    entry.load_state_dict(saved)
    assert draws(rng) == expected


def test_the_same_object_twice_is_nothing_another_needs_replace() -> None:
    module = nn.Linear(2, 2)
    first, second = Counter(), Counter()
    register_rank_state(module, "c", first)
    register_rank_state(module, "c", first)  # idempotent
    with pytest.raises(
        ValueError,
        match=r"The per-rank state 'c' is already registered on Linear, for a Counter.*"
        r"`replace=True`",
    ):
        register_rank_state(module, "c", second)
    register_rank_state(module, "c", second, replace=True)
    assert registered_rank_state(module)["c"] is second
    rng = np.random.default_rng(0)
    register_rank_state(module, "rng", rng)
    register_rank_state(module, "rng", rng)  # the same generator: also nothing
    with pytest.raises(ValueError, match="already registered on Linear, for a Generator"):
        register_rank_state(module, "rng", np.random.default_rng(0))


def test_what_it_refuses_says_why() -> None:
    module = nn.Linear(2, 2)
    with pytest.raises(
        TypeError, match=r"Cannot register list as the per-rank state 'x': it has no `state_dict\(\)`"
    ):
        register_rank_state(module, "x", [1, 2])
    with pytest.raises(TypeError, match="must be a string, got int"):
        register_rank_state(module, 3, Counter())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not be empty"):
        register_rank_state(module, "", Counter())
    assert registered_rank_state(module) == {}


def test_the_mixin_registers_on_itself() -> None:
    class Model(ShardedStateMixin, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.counter = Counter()
            self.register_rank_state("counter", self.counter)

    model = Model()
    assert registered_rank_state(model) == {"counter": model.counter}
    assert "counter" not in model.state_dict()


def test_a_generator_subclass_is_saved_and_restored_through_its_own_methods() -> None:
    """The adapter calls the object's own ``getstate``/``setstate`` (a subclass's override), so what is
    saved is what it restores; ``random.SystemRandom``, which has no state, is refused at the save."""
    import random

    from lightning_sharded.user_state import stateful

    class Counted(random.Random):
        saves = 0

        def getstate(self) -> object:
            Counted.saves += 1
            return super().getstate()

    rng = Counted(3)
    adapter = stateful(rng)
    assert adapter is not None
    state = adapter.state_dict()
    assert Counted.saves == 1, "the subclass's getstate was not called"
    expected = [rng.random() for _ in range(3)]
    adapter.load_state_dict(state)
    assert [rng.random() for _ in range(3)] == expected
    system = stateful(random.SystemRandom())
    assert system is not None
    with pytest.raises(NotImplementedError):
        system.state_dict()
