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


class Reduce:
    """Pickles as ``fn(*args)``: a hostile pickle's building block (``fn`` may itself be a ``Reduce``,
    whose result is then called: a nested reduce)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn = fn
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)

    def __call__(self, *args: Any) -> Any:  # pickle saves only callables as a reduce's function
        raise AssertionError("a Reduce is pickled, never called")


#: Set to a path, the import of :mod:`tests.hostile_import` creates that file.
IMPORT_MARKER_ENV = "LIGHTNING_SHARDED_TEST_IMPORT_MARKER"


def payloads(marker: str | Path) -> dict[str, tuple[Reduce, tuple[str, ...]]]:
    """Hostile objects, each creating the file ``marker`` when unpickled, by what they call; with the
    global a safe reader must refuse first (the first one not allowed in the pickle's order), as a
    plain pickle names it and as torch's safe unpickler does (``eval`` for ``builtins.eval``; in
    ``torch.save``'s protocol 2, ``subprocess`` is written under its Python 2 name, ``commands``)."""
    import builtins
    import collections
    import functools
    import os
    import subprocess

    path = str(marker)
    code = f"open({path!r}, 'w').close()"
    touch = f"touch '{path}'"
    system = f"{os.system.__module__}.system"  # posix.system
    return {
        "eval": (Reduce(builtins.eval, code), ("builtins.eval", "eval")),
        "exec": (Reduce(builtins.exec, code), ("builtins.exec", "exec")),
        # an allowed class (a path) made dangerous by getattr: PosixPath(marker).touch()
        "getattr": (Reduce(Reduce(builtins.getattr, Path(path), "touch")), ("builtins.getattr", "getattr")),
        "__import__": (
            Reduce(builtins.__import__, "tests.hostile_import"),
            ("builtins.__import__", "__import__"),
        ),
        "functools.partial": (Reduce(Reduce(functools.partial, os.system, touch)), ("functools.partial",)),
        "os.system": (Reduce(os.system, touch), (system,)),
        "subprocess.Popen": (
            Reduce(subprocess.Popen, ["touch", path]),
            ("subprocess.Popen", "commands.Popen"),
        ),
        # a refused call inside an allowed one: OrderedDict([("k", os.system(...))])
        "nested reduce": (Reduce(collections.OrderedDict, [("k", Reduce(os.system, touch))]), (system,)),
    }
