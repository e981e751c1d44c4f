"""Hostile pickles for the safe-unpickling tests: objects whose unpickling creates a marker file.

``Marker(path)`` pickles as a call of :func:`touch_marker`; a loader that runs a checkpoint's code
creates ``path``, a safe loader refuses ``tests.hostile.touch_marker`` and creates nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HOSTILE_NAME = "tests.hostile.touch_marker"


def touch_marker(path: str) -> str:
    """What a hostile checkpoint runs when it is unpickled: create the file ``path``."""
    Path(path).write_text("code from a checkpoint ran\n")
    return path


class Marker:
    """An object whose unpickling calls :func:`touch_marker` (as ``os.system`` would be called)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (touch_marker, (self.path,))
