"""Give back the pages of a memory-mapped checkpoint tensor once it has been copied where it goes.

A full checkpoint file is loaded memory-mapped (``torch.load(mmap=True)``), and every page a rank
reads from it stays in that rank's resident memory until the mapping goes away at the end of the
load: on a 2-rank resume that is one more shard per rank (measured: peak 2x the shard). After each
tensor is copied into the rank's shard, :meth:`FileMapping.release` tells the kernel this process no longer
needs those pages (``madvise(MADV_DONTNEED)``); they stay in the page cache, and a later read of the
same tensor simply maps them again. Only memory inside this process's mappings of that very file
(found in ``/proc/self/maps``) is touched: on anonymous memory ``MADV_DONTNEED`` would discard data.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from lightning_sharded.checkpoint import libc

__all__ = ["FileMapping"]


class FileMapping:
    """This process's memory mappings of one file, read from ``/proc/self/maps`` (Linux; else none).

    Build it after the file was memory-mapped (``torch.load(path, mmap=True)``).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.ranges: list[tuple[int, int]] = []
        if not sys.platform.startswith("linux"):
            return
        target = os.path.realpath(path)
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].rstrip("\n") == target:
                        start, end = (int(x, 16) for x in fields[0].split("-"))
                        self.ranges.append((start, end))
        except OSError:
            self.ranges = []

    def release(self, tensor: Any) -> None:
        """Drop this process's mapping of the whole pages under ``tensor`` if they are in this file's mapping.

        A no-op for anything else (other memory, sharded tensors, non-tensors).
        """
        if not self.ranges or type(tensor) is not torch.Tensor or tensor.device.type != "cpu":
            return
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(lo <= start and end <= hi for lo, hi in self.ranges):
            return
        libc.madvise(start, end - start, libc.MADV_DONTNEED)
