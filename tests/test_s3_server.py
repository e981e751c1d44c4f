"""The S3 test server itself: s3fs and DCP's fsspec writer/reader reach it on loopback."""

from __future__ import annotations

import s3fs
import torch

from tests.s3_server import S3Server


def test_dcp_round_trip_through_the_moto_server() -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    with S3Server() as server:
        dcp.save({"w": torch.arange(5.0)}, storage_writer=FsspecWriter(server.url("c1")), no_dist=True)
        fs = s3fs.S3FileSystem()
        assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(server.url("c1"))) == [".metadata", "__0_0.distcp"]
        out = {"w": torch.zeros(5)}
        dcp.load(out, storage_reader=FsspecReader(server.url("c1")), no_dist=True)
        assert torch.equal(out["w"], torch.arange(5.0))
