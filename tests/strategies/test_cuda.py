"""Both strategies on CUDA (NCCL): fit, save and resume, synchronous and async, sharded and full.

The same jobs as the CPU matrix of ``test_fsdp.py`` and ``test_model_parallel.py`` (their CPU twins,
which always run; the async ones are ``tests/test_async_save.py``), with ``--accelerator cuda``: 2
processes, or 1 with one GPU (then NCCL at world size 1), each checkpoint also resumed at 1. The
async save starts after the first training step and is replaced by the final one, so a background
write of CUDA values runs while training goes on. Skipped, with a reason, without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._compare import assert_restored
from tests.distributed.launch import Batch, Results

KINDS = {
    "sharded": (),
    "sharded-async": ("--async-save", "--overwrite"),
    "full": ("--state-dict-type", "full"),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", ["fsdp", "mp"])
def test_resume_on_cuda(tmp_path: Path, strategy: str) -> None:
    world = min(2, torch.cuda.device_count())
    flags = ("--strategy", strategy, "--accelerator", "cuda")
    batch = Batch(tmp_path)
    for kind, extra in KINDS.items():
        batch.add(kind, world, "fit", "--ckpt", str(tmp_path / kind), *flags, *extra)
    batch.run()
    for resumed_on in sorted({1, world}):
        for kind in KINDS:
            batch.add(f"{kind}@{resumed_on}", resumed_on, "resume", "--ckpt", str(tmp_path / kind), *flags)
    batch.run()
    results = Results(batch.outs)
    for resumed_on in sorted({1, world}):
        for kind in KINDS:
            assert_restored(results[kind], results[f"{kind}@{resumed_on}"])
