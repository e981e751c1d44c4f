"""How the offline tools report sizes and progress: binary units (KiB, MiB) everywhere, one bar style.

``verify`` and ``consolidate`` read every byte of a checkpoint; from :data:`PROGRESS_MIN_BYTES` on
they show a progress bar on stderr (tqdm, a dependency of Lightning) unless told not to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

__all__ = ["MIB", "PROGRESS_MIN_BYTES", "format_files", "format_size", "progress_bar"]

MIB = 1 << 20
#: Reads of at least this many bytes show a progress bar when ``progress`` is ``None`` (64 MiB).
PROGRESS_MIN_BYTES = 64 * MIB


def format_size(n: int) -> str:
    """``n`` bytes in binary units: ``512 B``, ``3.5 KiB``, ``128.0 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_files(files: Mapping[str, int]) -> str:
    """A checkpoint's files (name to size, as :func:`~lightning_sharded.checkpoint.detect.checkpoint_files`
    gives them) in words: ``7 files, 108.1 KiB``, ``1 file, 14.2 KiB``."""
    return f"{len(files)} file{'s' if len(files) != 1 else ''}, {format_size(sum(files.values()))}"


@contextlib.contextmanager
def progress_bar(total: int, progress: bool | None, desc: str) -> Iterator[Callable[[int], None]]:
    """A callable that advances a bar of ``total`` bytes by a number of bytes; a no-op when no bar is
    shown (``progress`` ``False``, or ``None`` and ``total`` under :data:`PROGRESS_MIN_BYTES`)."""
    show = progress if progress is not None else total >= PROGRESS_MIN_BYTES
    if not show:
        yield lambda n: None
        return
    from tqdm.auto import tqdm

    with tqdm(
        total=total / MIB,
        desc=desc,
        unit="MiB",
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} MiB"
        " [{elapsed}<{remaining}, {rate_fmt}]",
    ) as bar:
        yield lambda n: bar.update(n / MIB)
