"""Module attributes imported on first access (PEP 562), for packages whose parts are heavy to import."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, sources: Mapping[str, str], namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``name`` from the module ``sources[name]`` on first access.

    Args:
        package: the package's ``__name__`` (for the error message).
        sources: public name to the dotted module it comes from.
        namespace: the package's ``globals()``; a loaded value is cached there.
    """

    def __getattr__(name: str) -> Any:
        if name not in sources:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(sources[name]), name)
        namespace[name] = value
        return value

    return __getattr__
