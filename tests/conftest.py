"""Shared fixtures: a one-rank gloo process group for in-process tests of distributed values."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launch import free_port


@pytest.fixture(scope="session")
def process_group() -> Iterator[None]:
    """A world of one gloo rank on loopback (a free port), for DTensor/ShardedTensor in-process."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests skip, with a reason, where there is no CUDA device; their CPU twins always run."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (its CPU twin runs)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
