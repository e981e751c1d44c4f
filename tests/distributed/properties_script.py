"""Rank script: the hook properties of tests/sharded_trees.py at the world size it is launched with.

Both ranks run derandomized hypothesis, so they draw the same examples in the same order and issue the
same collectives. Each rank writes the digest of every example's global result to OUT/rank{R}.json;
the test compares the files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import sharded_trees as trees

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    digests: list[str] = []

    @SETTINGS
    @given(trees.node_specs())
    def round_trip(spec: trees.NodeSpec) -> None:
        digests.append(trees.prop_round_trip(spec))

    @SETTINGS
    @given(trees.node_specs())
    def full_load(spec: trees.NodeSpec) -> None:
        digests.append(trees.prop_full_tensor_load(spec))

    @SETTINGS
    @given(trees.node_specs(), st.lists(st.integers(0, 11), min_size=1, max_size=8))
    def relayout(spec: trees.NodeSpec, choices: list[int]) -> None:
        digests.append(trees.prop_relayout(spec, trees.relayout(spec, choices)))

    @SETTINGS
    @given(trees.node_specs(), st.data())
    def strict(spec: trees.NodeSpec, data: st.DataObject) -> None:
        keys = sorted(trees.build(spec).state_dict())
        drop = data.draw(st.lists(st.sampled_from(keys), unique=True, max_size=3)) if keys else []
        digests.append(trees.prop_strict(spec, drop, data.draw(st.booleans())))

    @SETTINGS
    @given(trees.node_specs(sharded=False))
    def unchanged(spec: trees.NodeSpec) -> None:
        digests.append(trees.prop_no_sharded_no_change(spec))

    for prop in (round_trip, full_load, relayout, strict, unchanged):
        prop()
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps({"examples": len(digests), "digests": digests}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
