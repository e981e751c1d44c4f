"""Checksum throughput against the disk's write speed, to choose the manifest's checksum.

Usage: ``python -m benchmarks.checksum_throughput [DIR] [MB]`` (default: a temp dir, 512 MB).
Prints GB/s for write+fsync of MB megabytes to DIR, a cold-ish read-back checksum of that file with
``file_checksum`` (what a save adds), and in-memory throughput of the candidate algorithms.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from lightning_sharded.checkpoint.checksum import crc32, file_checksum


def rate(nbytes: int, fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    size = (int(sys.argv[2]) if len(sys.argv) > 2 else 512) << 20
    data = os.urandom(64 << 20) * (size // (64 << 20))
    path = folder / "checksum_benchmark.bin"

    def write() -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    print(f"write+fsync            {rate(len(data), write):6.2f} GB/s")
    read_back = rate(len(data), lambda: file_checksum(path))
    print(f"file_checksum (crc32)  {read_back:6.2f} GB/s  (read back + crc32)")
    chunk = data[: 64 << 20]
    for name, fn in {
        "crc32 (checksum.crc32)": lambda: crc32(chunk),
        "crc32 (zlib)": lambda: zlib.crc32(chunk),
        "adler32": lambda: zlib.adler32(chunk),
        "sha1": lambda: hashlib.sha1(chunk).digest(),
        "sha256": lambda: hashlib.sha256(chunk).digest(),
        "blake2b": lambda: hashlib.blake2b(chunk).digest(),
        "md5": lambda: hashlib.md5(chunk).digest(),
    }.items():
        print(f"{name:<24} {rate(len(chunk), fn):6.2f} GB/s  (in memory)")
    path.unlink()


if __name__ == "__main__":
    main()
