"""``backends.observed.Observed``: how a save and a load follow DCP's steps without replacing the
methods of the storage writer or reader a backend made (issue "One concept once")."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from lightning_sharded.checkpoint import collective, presence
from lightning_sharded.checkpoint.backends.observed import Observed


class Writer:
    """Stands for a DCP storage writer: a method DCP inspects for ``**kwargs``, and state."""

    def __init__(self) -> None:
        self.checksums = {"a": 1}
        self.calls: list[str] = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.calls.append(f"set_up {is_coordinator} {kwargs}")

    def write_data(self, plan: str, planner: str) -> str:
        self.calls.append(f"write {plan}")
        if plan == "bad":
            raise OSError("disk")
        return f"future of {plan}"


def test_hooks_run_around_the_inner_method_and_nest_in_order() -> None:
    writer = Writer()
    seen: list[str] = []

    def inner_hook(call: Any, plan: str, planner: str) -> str:
        seen.append("inner before")
        result = call(plan, planner)
        seen.append(f"inner after {result}")
        return result

    def outer_hook(call: Any, *args: Any, **kwargs: Any) -> str:
        result = call(*args, **kwargs)
        seen.append("outer after")
        return str(result) + "!"

    observed = Observed(Observed(writer, {"write_data": inner_hook}), {"write_data": outer_hook})
    assert observed.write_data("p", planner="q") == "future of p!"
    assert seen == ["inner before", "inner after future of p", "outer after"]
    assert writer.calls == ["write p"]
    # The writer itself is left as it was: its method is its own, not a wrapper.
    assert writer.write_data.__func__ is Writer.write_data  # type: ignore[attr-defined]


def test_everything_not_hooked_is_the_inner_objects() -> None:
    writer = Writer()
    observed = Observed(writer, {"write_data": lambda call, *a, **k: call(*a, **k)})
    assert observed.checksums is writer.checksums
    observed.set_up_storage_writer(True, rank=3)
    assert writer.calls == ["set_up True {'rank': 3}"]
    with pytest.raises(AttributeError):
        observed.missing  # noqa: B018


def test_a_hooked_method_keeps_the_signature_dcp_inspects() -> None:
    # DCP passes `rank=` only to a method whose signature has **kwargs (state_dict_saver/_loader).
    observed = Observed(Writer(), {"set_up_storage_writer": lambda call, *a, **k: call(*a, **k)})
    params = inspect.signature(observed.set_up_storage_writer).parameters
    assert list(params) == ["is_coordinator", "args", "kwargs"]


@pytest.mark.parametrize("world_size, marks", [(1, []), (2, ["shards written", "shards written"])])
def test_marking_marks_the_step_whether_the_method_returns_or_raises(
    monkeypatch: pytest.MonkeyPatch, world_size: int, marks: list[str]
) -> None:
    reached: list[str] = []
    monkeypatch.setattr(presence, "reach", lambda group, step: reached.append(step))
    where = collective.Ranks(rank=0, world_size=world_size, src=0, group=None)
    observed = Observed(Writer(), {"write_data": collective.marking(where, "shards written")})
    assert observed.write_data("p", "q") == "future of p"
    with pytest.raises(OSError, match="disk"):
        observed.write_data("bad", "q")
    assert reached == marks
