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


def test_a_full_file_at_a_url_that_does_not_fit_is_named_by_its_url(tmp_path: Path) -> None:
    # A URL's full file is read from a local download: the error names the URL the user gave, not it.
    import fsspec

    model = nn.Linear(4, 3)
    local = tmp_path / "full.ckpt"
    torch.save({"state_dict": model.state_dict(), "global_step": 1}, local)
    url = "memory://strict-keys/full.ckpt"
    with fsspec.open(url, "wb") as f:
        f.write(local.read_bytes())
    other = nn.Linear(4, 5)
    with pytest.raises(CheckpointError) as raised:
        restore_checkpoint(url, other, [])
    message = str(raised.value)
    assert url in message and "shape" in message, message
    assert str(tmp_path) not in message
