"""Property tests of the state-dict hooks on random module trees, at world size 1 and 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import sharded_trees as trees
from tests.distributed.launch import REPO, run_ranks

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

pytestmark = pytest.mark.usefixtures("process_group")


@SETTINGS
@given(trees.node_specs())
def test_round_trip_restores_every_value(spec: trees.NodeSpec) -> None:
    trees.prop_round_trip(spec)


@SETTINGS
@given(trees.node_specs())
def test_full_tensor_load_equals_distributing(spec: trees.NodeSpec) -> None:
    trees.prop_full_tensor_load(spec)


@SETTINGS
@given(trees.node_specs(), st.lists(st.integers(0, 11), min_size=1, max_size=8))
def test_layout_a_into_layout_b(spec: trees.NodeSpec, choices: list[int]) -> None:
    trees.prop_relayout(spec, trees.relayout(spec, choices))


@SETTINGS
@given(trees.node_specs(), st.data())
def test_strict_iff_key_sets_match(spec: trees.NodeSpec, data: st.DataObject) -> None:
    keys = sorted(trees.build(spec).state_dict())
    drop = data.draw(st.lists(st.sampled_from(keys), unique=True, max_size=3)) if keys else []
    trees.prop_strict(spec, drop, data.draw(st.booleans()))


@SETTINGS
@given(trees.node_specs(sharded=False))
def test_no_sharded_attribute_no_change(spec: trees.NodeSpec) -> None:
    trees.prop_no_sharded_no_change(spec)


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "examples"), [(2, 30), (3, 12)])
def test_properties_at_world_sizes_two_and_three(tmp_path: Path, world_size: int, examples: int) -> None:
    """The same properties in 2 and 3 processes (where a rank's part can be cut from the wrong place);
    every rank must see the same global results. A failure fails every rank at the same example and
    is reported here with the ranks and the key, not as a hang."""
    script = REPO / "tests/distributed/properties_script.py"
    run_ranks(script, world_size, str(tmp_path), str(examples), timeout=400)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    assert results[0]["failure"] is None, results[0]["failure"]
    assert results[0]["examples"] == 5 * examples
    assert all(result == results[0] for result in results)
