"""A load of the model only (a warm start, ``exclude_from_loading=['optimizer_states']``) plans and reads
the model's bytes and nothing of the optimizers' (counted by ``/proc/self/io``'s ``rchar``: the bytes
this process read through system calls, which is how the sharded reader reads)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_sharded.checkpoint.load import restore_checkpoint
from tests.checkpoint.one_process import save_sharded, stepped

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc/self/io")


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("rchar:"))


def layers() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))


def test_a_model_only_load_reads_the_models_bytes_only(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = layers()
    optimizer = torch.optim.Adam(model.parameters())
    stepped(model, optimizer, 512)
    path = save_sharded(tmp_path / "sharded.ckpt", model, optimizer)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert total > 2.9 * model_bytes  # model + Adam's two moments

    restore_checkpoint(path, layers(), [])  # once uncounted: the first load imports modules (reads them)
    counts = {}
    for what, with_optimizer in (("model", False), ("model and Adam", True)):
        fresh = layers()
        optimizers = [torch.optim.Adam(fresh.parameters())] if with_optimizer else []
        before = rchar()
        restore_checkpoint(path, fresh, optimizers, read_metadata=with_optimizer)
        counts[what] = rchar() - before
        assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True))
    # What the model's entries take in the shard files (tensors and DCP's framing of each), by the index.
    import torch.distributed.checkpoint as dcp

    index = dcp.FileSystemReader(str(path)).read_metadata()
    stored = {fqn: info.length for fqn, info in ((i.fqn, info) for i, info in index.storage_data.items())}
    model_items = [n for fqn, n in stored.items() if fqn.startswith("state_dict.")]
    stored_model = sum(model_items)
    assert stored_model < 0.4 * sum(stored.values())
    # Those bytes, plus the index and the manifest (a few KiB) and what the reader reads around each
    # item to find its bytes (its zip headers: up to 64 KiB + 4 KiB an item): nothing of the optimizer's.
    bound = stored_model + (32 << 10) + len(model_items) * (68 << 10)
    assert model_bytes <= counts["model"] <= bound, (counts, stored_model)
    assert counts["model and Adam"] > 0.95 * total, counts
