"""A resume restores every parameter group: FSDP1 and FSDP2, two and three groups of different sizes,
learning rates and weight decays; each group's settings and members, and every parameter's state
(``tests/distributed/param_groups_script.py``, 2 ranks, all cases in one start)."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.launch import run_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "distributed" / "param_groups_script.py"


def test_fsdp1_and_fsdp2_restore_each_group_s_settings_members_and_state(tmp_path: Path) -> None:
    run_ranks(SCRIPT, 2, str(tmp_path), timeout=240)
    assert (tmp_path / "ok").read_text() == "ok"
