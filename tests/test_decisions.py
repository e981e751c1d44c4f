"""Decisions taken once and shared across ranks (issue 12, items 2, 3 and 7), at 2 processes.

One launch runs every case of ``tests/distributed/decisions_script.py``; each rank reports what it
raised. A hang would fail the launch at its timeout, so "none hangs" is checked too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launch import run_ranks

SCRIPT = Path(__file__).parent / "distributed" / "decisions_script.py"


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("decisions")
    run_ranks(SCRIPT, 2, str(out), timeout=180)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


#: The per-rank index's files (by name: the checksummed files are named without their folder).
INDEX = ("layout.json", "rank-00000.json", "rank-00001.json")


def test_meta_unreadable_on_rank_0_fails_every_rank_alike(reports: list[dict]) -> None:
    first, second = (r["meta"] for r in reports)
    # a StorageError (a CheckpointError) that leads with the cause, as decide() shares it
    assert first["type"] == second["type"] == "StorageError"
    assert first["message"] == second["message"]
    assert first["message"].startswith("Input/output error (EIO): could not read the Lightning metadata")
    assert "Input/output error (injected)" in first["message"]


def test_meta_is_read_once_on_rank_0(reports: list[dict]) -> None:
    assert [{k: v for k, v in r["meta-other"].items() if k != "files"} for r in reports] == [
        {"type": None, "step": 3, "seconds": r["meta-other"]["seconds"]} for r in reports
    ]


def test_a_load_sends_each_rank_its_share_of_the_manifest(reports: list[dict]) -> None:
    every, share = (r["meta-other"]["files"] for r in reports)
    # Rank 0 checks every file; rank 1 its own (and needs to know whether there is a per-rank index).
    assert every == sorted(
        [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", *(f"index/{n}" for n in INDEX)]
    )
    assert share == ["__1_0.distcp", "index/layout.json", "index/rank-00001.json"]


def test_a_shard_missing_on_one_rank_fails_every_rank_alike(reports: list[dict]) -> None:
    first, second = (r["shard"] for r in reports)
    assert first["type"] == second["type"] == "CheckpointError"
    assert first["message"] == second["message"]
    assert "is damaged: '__1_0.distcp' (written by rank 1) is missing" in first["message"]
    assert "(seen by rank(s) 1 of 2; rank 1's report)" in first["message"]


def test_verify_reads_each_file_once_across_ranks(reports: list[dict]) -> None:
    first, second = (r["verify"] for r in reports)
    assert first["message"] == second["message"]
    assert "'__0_0.distcp' (written by rank 0) is corrupted: its crc32 is" in first["message"]
    done = [name for r in reports for name in r["checksummed"]]
    assert sorted(done) == sorted({".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", *INDEX})
    assert all(r["checksummed"] for r in reports)  # both ranks took a share


def test_verify_with_a_file_missing_that_another_rank_checksums_fails_every_rank_alike(
    reports: list[dict],
) -> None:
    # Rank 0 sees the file missing; rank 1, which stats only its own files, finds it so in its share of
    # the checksums. It used to raise FileNotFoundError alone, leaving rank 0 in the gather until timeout.
    first, second = (r["verify-missing"] for r in reports)
    assert first["gone"], "no file of rank 0's in rank 1's share: the case would test nothing"
    assert first["type"] == second["type"] == "CheckpointError", (first, second)
    assert first["message"] == second["message"]
    assert f"'{first['gone'][0]}'" in first["message"] and "is missing" in first["message"]


def test_verify_during_checksums_each_rank_s_reads_and_each_file_once(reports: list[dict]) -> None:
    whole = [r["during"] for r in reports]
    assert [w["type"] for w in whole] == [None, None] and all(w["equal"] for w in whole)
    # Each rank read its own 2 MiB shard directly, checksumming it as it went, and completed that file.
    assert [w["covered"] for w in whole] == [{f"__{r}_0.distcp": 2 << 20} for r in range(2)]
    assert [f"__{r}_0.distcp" in w["completed"] for r, w in enumerate(whole)] == [True, True]
    done = [name for w in whole for name in w["completed"]]
    assert sorted(done) == sorted({".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", *INDEX})


def test_verify_during_fails_every_rank_alike_on_a_damaged_shard(reports: list[dict]) -> None:
    first, second = (r["during-damaged"] for r in reports)
    assert first["type"] == second["type"] == "CheckpointError"
    assert first["message"] == second["message"]
    assert "is damaged: '__1_0.distcp' (written by rank 1) is corrupted: its crc32 is" in first["message"]
    assert "The load had already read the model's tensors from it" in first["message"]
    assert "__1_0.distcp" in second["completed"] and "__1_0.distcp" not in first["completed"]
    assert first["equal"] and not second["equal"]  # the flipped byte reached rank 1's tensor only


def test_verify_true_leaves_every_rank_s_model_as_it_was_on_a_damaged_shard(reports: list[dict]) -> None:
    first, second = (r["before-damaged"] for r in reports)
    assert first["type"] == second["type"] == "CheckpointError"
    assert first["message"] == second["message"]
    assert "is damaged: '__1_0.distcp' (written by rank 1) is corrupted: its crc32 is" in first["message"]
    assert "Nothing was loaded from it: the model and the optimizers are as they were." in first["message"]
    assert first["unchanged"] and second["unchanged"]  # read beside the model, never copied in
    assert "__1_0.distcp" in second["completed"]  # checked from rank 1's own reads, not a pass before


def test_a_full_file_unreadable_on_one_rank_fails_every_rank_alike(reports: list[dict]) -> None:
    first, second = (r["full"] for r in reports)
    assert first["type"] == second["type"] == "StorageError"  # a CheckpointError, the cause first
    assert first["message"] == second["message"]
    assert first["message"].startswith("Input/output error (EIO): could not read the checkpoint file")


def test_a_full_files_rank_state_bad_for_one_rank_fails_every_rank_alike(reports: list[dict]) -> None:
    first, second = (r["rank-state"] for r in reports)
    assert first["type"] == second["type"] == "CheckpointError"
    assert first["message"] == second["message"]
    assert first["message"] == (
        "The per-rank state of rank 1 in 'full.ckpt' ('lightning_sharded_rank_state') is not rank 1's state"
        " written by lightning_sharded. Resume from another checkpoint. (seen by rank(s) 1 of 2; rank 1's"
        " report)"
    )


def test_a_full_files_saved_world_size_is_decided_once_for_every_rank(reports: list[dict]) -> None:
    """Rank 1's copy says 1 rank saved it, rank 0's says 2: both take rank 0's (same world size) branch."""
    assert [r["rank-state-world"] for r in reports] == [{"warning": None, "rng": True}] * 2


def test_full_state_dicts_are_gathered_on_rank_0_only(reports: list[dict]) -> None:
    keys = ["0.bias", "0.weight", "1.bias", "1.weight"]
    for kind in ("fsdp1", "fsdp2"):
        zero, one = (r["full-gather"][kind] for r in reports)
        assert zero[:2] == [keys, 4], kind
        assert one == [[], 0, None], kind
    # Both wrappers gathered the same full values (same seed, same step).
    assert reports[0]["full-gather"]["fsdp1"][2] == reports[0]["full-gather"]["fsdp2"][2]


def test_the_checkpoint_groups_are_made_once_and_replaced_on_every_rank_after_a_failure(
    reports: list[dict],
) -> None:
    # A group per role and timeout, reused by every later strategy and saver of the process; after rank 1
    # alone gave up on a group (a collective failed there), both ranks take a new one (alone, rank 1
    # would wait in new_group for rank 0 until the timeout).
    for report in reports:
        assert report["groups"] == {
            "reused": True,
            "background apart": True,
            "background reused": True,
            "other timeout apart": True,
            "replaced": True,
            "replacement works": True,
            "replacement reused": True,
        }


def test_a_per_rank_decision_that_fails_while_its_values_are_taken_fails_every_rank_alike(
    reports: list[dict],
) -> None:
    # decide_each's check is run, and its values taken, inside the guard: an error raised while rank 0
    # takes them reaches rank 1 too (outside the guard, rank 1 waited in the scatter until the timeout).
    zero, one = (report["decide-each"] for report in reports)
    assert zero == one, (zero, one)  # the same error on both ranks, from rank 0
    assert zero["type"] == "CheckpointError", zero
    assert zero["message"] == "ValueError: the share of rank 1 could not be computed", zero
