"""``verify=`` takes a bool or a mode's name, and a resume with ``verify="before"`` checks as ``True`` does.

(A mutant that made ``verify_mode("before")`` mean no checksums passed the suite: every test spells it
``verify=True``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from lightning_sharded import CheckpointError
from lightning_sharded.checkpoint.integrity import VerifyMode, verify_mode
from lightning_sharded.checkpoint.load import restore_checkpoint
from tests.checkpoint.one_process import save_sharded


def test_each_verify_value_names_its_mode() -> None:
    assert verify_mode(True) == verify_mode("before") == "before"
    assert verify_mode("during") == "during"
    assert verify_mode(False) is None
    with pytest.raises(ValueError, match="during"):
        verify_mode("after")


@pytest.mark.parametrize("verify", [True, "before", "during"])
def test_a_resume_that_verifies_refuses_a_damaged_shard(tmp_path: Path, verify: bool | VerifyMode) -> None:
    model = nn.Linear(64, 64)
    path = save_sharded(tmp_path / "sharded.ckpt", model)
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, inside the weight's bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"__0_0\.distcp. \(written by rank 0\) is corrupted: its crc32"
    ):
        restore_checkpoint(path, nn.Linear(64, 64), [], verify=verify)
    restore_checkpoint(path, nn.Linear(64, 64), [])  # without verify the damage is not noticed
