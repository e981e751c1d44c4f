"""Two ranks load a DCP checkpoint with ``DirectReader``: what each rank alone reads leaves the page
cache behind the read, what both read (a replicated tensor) stays for the other.

    read_behind_script.py CHECKPOINT_DIR OUT_JSON

Each rank saves its part (a replicated 4 MiB tensor, saved once, and a 16 MiB tensor sharded in two),
rank 0 reads every file into the page cache, both load into zeroed tensors of the same placements,
and rank 0 writes, per stored chunk, the fraction of its bytes still cached (all of them, and those
2 MiB or more inside it) and whether each rank's values are those saved.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lightning_sharded.checkpoint.backends.dcp_reader import DirectReader, _storage_location
from tests._pages import resident


def main(root: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    # The replicated tensor comes last in its file (DCP writes in the state's order): the read-ahead of
    # the rank that reads it after its writer cannot reach into bytes their own reader already dropped.
    full = {"sharded": torch.randn(4096, 1024), "replicated": torch.randn(1024, 1024)}
    placements = {"replicated": [Replicate()], "sharded": [Shard(0)]}
    state = {key: distribute_tensor(value, mesh, placements[key]) for key, value in full.items()}
    dcp.save(state, storage_writer=FileSystemWriter(root))
    dist.barrier()
    if rank == 0:
        for file in root.glob("*.distcp"):
            file.read_bytes()  # every page cached, as right after a save
    dist.barrier()
    target = {
        key: distribute_tensor(torch.zeros_like(value), mesh, placements[key]) for key, value in full.items()
    }
    dcp.load(target, storage_reader=DirectReader(root))
    equal = all(torch.equal(target[key].to_local(), state[key].to_local()) for key in full)
    equals: list[bool] = [False, False]
    dist.all_gather_object(equals, equal)
    dist.barrier()
    if rank == 0:
        metadata = FileSystemReader(root).read_metadata()
        chunks = []
        for index, info in metadata.storage_data.items():
            path = root / info.relative_path
            nbytes = (4 if index.fqn == "replicated" else 8) << 20
            with open(path, "rb", buffering=0) as file:
                start = _storage_location(file, info.offset, info.length, nbytes)
            assert start is not None, index
            edge = 2 << 20  # the largest page-cache folio, which a chunk may share with its neighbours
            cached = [
                resident(path, start, start + nbytes),
                resident(path, start + edge, start + nbytes - edge),
            ]
            chunks.append({"key": index.fqn, "cached": cached})
        out.write_text(json.dumps({"equal": equals, "chunks": chunks}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
