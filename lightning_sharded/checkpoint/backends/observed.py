"""A DCP storage writer or reader seen through hooks: how a save and a load follow DCP's steps (the
per-rank index, the presence marks) without replacing the methods of the object a backend made."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Around", "Observed"]

#: ``around(call, *args, **kwargs)``: runs the method itself (``call(*args, **kwargs)``) and what it
#: adds before, after or around it; returns what the method returns.
Around = Callable[..., Any]


class Observed:
    """``inner`` (a DCP ``StorageWriter`` or ``StorageReader``), given to DCP in its place: each method
    named in ``around`` runs through its hook, every other attribute is ``inner``'s own. A hooked method
    keeps ``inner``'s signature (``functools.wraps``), which DCP inspects for the keywords it passes.
    """

    def __init__(self, inner: Any, around: Mapping[str, Around]) -> None:
        self.inner = inner
        self._around = dict(around)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        around = self._around.get(name)
        if around is None:
            return value

        @functools.wraps(value)
        def hooked(*args: Any, **kwargs: Any) -> Any:
            return around(value, *args, **kwargs)

        return hooked
