"""Checkpoints on object storage, against a real S3 API (the moto server on loopback).

One server for the module; every test writes under its own prefix. The ranks reach the server
through the ``AWS_*`` environment of :class:`tests.s3_server.S3Server`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.distributed.harness import Batch, Results, assert_same
from tests.s3_server import S3Server


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


def test_save_and_resume_sharded_and_full_at_two_ranks(s3: S3Server, tmp_path: Path) -> None:
    batch = Batch(tmp_path, env=s3.env)
    for strategy in ("fsdp", "mp"):
        for kind in ("sharded", "full"):
            url = s3.url(f"resume/{strategy}-{kind}")
            batch.add(
                f"{strategy}/{kind}/fit",
                2,
                "fit",
                "--strategy",
                strategy,
                "--ckpt",
                url,
                "--state-dict-type",
                kind,
            )
            batch.add(f"{strategy}/{kind}/resume", 2, "resume", "--strategy", strategy, "--ckpt", url)
    batch.run()
    results = Results(batch.outs)
    for strategy in ("fsdp", "mp"):
        for kind in ("sharded", "full"):
            assert_same(results[f"{strategy}/{kind}/fit"], results[f"{strategy}/{kind}/resume"])
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    for strategy in ("fsdp", "mp"):
        names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(s3.url(f"resume/{strategy}-sharded")))
        assert len(names) == 2 and names[1] == "lightning_sharded.json" and names[0].startswith("data-")
        assert fs.isfile(s3.url(f"resume/{strategy}-full"))
