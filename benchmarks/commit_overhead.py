"""What the atomic commit adds to a sharded save: DCP into a directory, plain vs through commit_directory.

Usage: ``python -m benchmarks.commit_overhead [DIR] [MB] [REPEAT]`` (default: a temp dir, 1024 MB, 3).
Three ways: DCP in place (no atomicity), commit_directory reading the files back to checksum them,
commit_directory with ``ChecksummingWriter`` (CRC-32 computed while writing).
One process (DCP ``no_dist``), tensors of 64 MiB; best of REPEAT, each save over the previous one.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

from lightning_sharded.checkpoint.backends.dcp_writer import ChecksummingWriter
from lightning_sharded.checkpoint.commit import commit_directory


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    mb = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    repeat = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    state = {"state_dict": {f"w{i}": torch.randn(16 << 20) for i in range(mb // 64)}}

    def write(path: Path) -> None:
        _save_state_dict(state, FileSystemWriter(path, sync_files=True), no_dist=True)
        torch.save({"epoch": 0}, path / "meta.pt")

    def write_checksumming(path: Path) -> dict[str, tuple[int, str]]:
        writer = ChecksummingWriter(path, sync_files=True)
        _save_state_dict(state, writer, no_dist=True)
        torch.save({"epoch": 0}, path / "meta.pt")
        return writer.checksums

    plain, committed, streaming = float("inf"), float("inf"), float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        target = folder / "plain"
        target.mkdir(exist_ok=True)
        write(target)
        plain = min(plain, time.perf_counter() - start)
        start = time.perf_counter()
        commit_directory(folder / "committed", write)
        committed = min(committed, time.perf_counter() - start)
        start = time.perf_counter()
        commit_directory(folder / "streaming", write_checksumming)
        streaming = min(streaming, time.perf_counter() - start)
    print(f"{mb} MB: dcp save (in place) {plain:.2f}s ({mb / 1024 / plain:.2f} GB/s)")
    print(
        f"{mb} MB: via commit_directory {committed:.2f}s ({mb / 1024 / committed:.2f} GB/s),"
        f" +{100 * (committed / plain - 1):.0f}%"
    )
    print(
        f"{mb} MB: via commit_directory + ChecksummingWriter {streaming:.2f}s"
        f" ({mb / 1024 / streaming:.2f} GB/s), +{100 * (streaming / plain - 1):.0f}%"
    )
    shutil.rmtree(folder / "streaming")
    shutil.rmtree(folder / "plain")
    shutil.rmtree(folder / "committed")


if __name__ == "__main__":
    main()
