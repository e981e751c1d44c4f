"""Rank script: the hook properties of tests/sharded_trees.py at the world size it is launched with.

    properties_script.py OUT [EXAMPLES]

Every rank runs derandomized hypothesis, so they draw the same examples in the same order and issue the
same collectives. An example fails on every rank or on none: each rank's outcome is gathered after
the example (:func:`agreed`), so a check that fails on one rank only (its part cut from the wrong
place) fails all of them at that example, naming the rank and the key, instead of leaving the others
in the next example's collectives. No shrinking: the first failing example is reported. Each rank
writes the digest of every example's global result, and the first failure if any, to
OUT/rank{R}.json; the test compares the files.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests import sharded_trees as trees


def agreed(check: Callable[[], str]) -> str:
    """``check()``'s digest on every rank, or the same ``AssertionError`` on every rank naming each rank
    where it failed and why (the failed assertion names the key)."""
    try:
        outcome: str | None = None
        result = check()
    except Exception as err:  # an assertion, or an error of the code under test
        last = traceback.extract_tb(err.__traceback__)[-1]
        outcome = f"{type(err).__name__}: {err} (at {Path(last.filename).name}:{last.lineno})"
        result = ""
    outcomes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    failed = [f"rank {r}: {o}" for r, o in enumerate(outcomes) if o is not None]
    if failed:
        raise AssertionError("; ".join(failed))
    return result


def main(out: Path, examples: int) -> None:
    dist.init_process_group("gloo")
    config = settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: the first failure, on every rank
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    digests: list[str] = []

    @config
    @given(trees.node_specs())
    def round_trip(spec: trees.NodeSpec) -> None:
        digests.append(agreed(lambda: trees.prop_round_trip(spec)))

    @config
    @given(trees.node_specs())
    def full_load(spec: trees.NodeSpec) -> None:
        digests.append(agreed(lambda: trees.prop_full_tensor_load(spec)))

    @config
    @given(trees.node_specs(), st.lists(st.integers(0, 11), min_size=1, max_size=8))
    def relayout(spec: trees.NodeSpec, choices: list[int]) -> None:
        digests.append(agreed(lambda: trees.prop_relayout(spec, trees.relayout(spec, choices))))

    @config
    @given(trees.node_specs(), st.data())
    def strict(spec: trees.NodeSpec, data: st.DataObject) -> None:
        keys = sorted(trees.build(spec).state_dict())
        drop = data.draw(st.lists(st.sampled_from(keys), unique=True, max_size=3)) if keys else []
        extra = data.draw(st.booleans())
        digests.append(agreed(lambda: trees.prop_strict(spec, drop, extra)))

    @config
    @given(trees.node_specs(sharded=False))
    def unchanged(spec: trees.NodeSpec) -> None:
        digests.append(agreed(lambda: trees.prop_no_sharded_no_change(spec)))

    failure: str | None = None
    for prop in (round_trip, full_load, relayout, strict, unchanged):
        try:
            prop()
        except AssertionError as err:  # the same on every rank (agreed): stop here, all of them
            failure = f"{prop.__name__}: {str(err).splitlines()[0]}"
            break
    rank = dist.get_rank()
    result = {"examples": len(digests), "digests": digests, "failure": failure}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 30)
