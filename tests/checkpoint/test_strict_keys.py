"""A load into a model with keys the checkpoint lacks fails under strict loading, naming them, and fills
what both have without it; for a sharded directory and a full file, in one process.

(The 2-process resumes check it through the strategies; in the load's own tests nothing did, and a
mutant dropping the strict check survived them.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_sharded import CheckpointError
from lightning_sharded.checkpoint import save, state_dicts
from lightning_sharded.checkpoint.load import restore_checkpoint


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full file"])
def test_a_key_the_checkpoint_lacks_fails_strict_loading_naming_it(tmp_path: Path, sharded: bool) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    checkpoint = {"state_dict": state_dicts.model_state_dict(model, full=not sharded), "global_step": 1}
    path = tmp_path / ("sharded.ckpt" if sharded else "full.ckpt")
    save.save_checkpoint(path, checkpoint, sharded=sharded, model_key="state_dict", rank=0)
    bigger = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(CheckpointError, match=r"\(strict loading\)\. .*1\.weight"):
        restore_checkpoint(path, bigger, [])
    restore_checkpoint(path, bigger, [], strict=False)
    loaded, saved = bigger.state_dict(), model.state_dict()
    assert all(torch.equal(loaded[key], saved[key]) for key in ("0.weight", "0.bias"))
