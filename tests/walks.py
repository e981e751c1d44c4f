"""The tests' record of the walks: which of our modules are on the stack when a save or a resume reaches
the backend (docs/architecture.md, "The walks"). Installed in a scenario's ranks when
:data:`WALKS_ENV` names a folder; each rank appends one JSON line per backend call to its own file.

A line: ``{"at": "<Class.method>", "before": [modules], "callbacks": [modules]}``: ``before`` are our
modules from the top of the stack down to the first DCP frame (or to the backend, where no DCP call is
between; the backend's own modules left out), ``callbacks`` ours that DCP called back on the way.
Modules are named as in the docs (``checkpoint.save``, ``strategies._checkpointing``), each once, in
call order.
"""

from __future__ import annotations

import functools
import json
import os
import traceback
from pathlib import Path
from typing import Any

__all__ = ["SPIED", "WALKS_ENV", "install", "read"]

#: Environment variable naming the folder the ranks write their records into.
WALKS_ENV = "LIGHTNING_SHARDED_TEST_WALKS"
#: The backend calls recorded: (module, class, method).
SPIED = (
    ("lightning_sharded.checkpoint.backends.dcp_writer", "ChecksummingWriter", "write_data"),
    ("lightning_sharded.checkpoint.backends.dcp_reader", "DirectReader", "read_data"),
    ("lightning_sharded.checkpoint.backends.local", "LocalBackend", "publish"),
    ("lightning_sharded.checkpoint.backends.local", "LocalBackend", "publish_file"),
)


def _walk() -> dict[str, list[str]]:
    before: list[str] = []
    callbacks: list[str] = []
    into = before
    for frame in traceback.extract_stack()[:-2]:  # less this function and the spy
        name = frame.filename.replace(os.sep, "/")
        if "/torch/distributed/checkpoint/" in name:
            into = callbacks
            continue
        if "/lightning_sharded/" not in name or "/tests/" in name:
            continue
        module = name.rsplit("/lightning_sharded/", 1)[1][: -len(".py")].replace("/", ".")
        module = module.removesuffix(".__init__")
        if into is before and module.startswith("checkpoint.backends."):
            continue  # the backend itself (a publish of a file publishing through the directory's)
        if module not in into:
            into.append(module)
    return {"before": before, "callbacks": callbacks}


def install() -> None:
    """Spy on :data:`SPIED` if :data:`WALKS_ENV` is set (a no-op otherwise)."""
    folder = os.environ.get(WALKS_ENV)
    if not folder:
        return
    import importlib

    out = Path(folder) / f"walks-{os.getpid()}.jsonl"
    for module_name, class_name, method in SPIED:
        cls = getattr(importlib.import_module(module_name), class_name)
        real = getattr(cls, method)
        if getattr(real, "_walk_spy", False):
            continue

        @functools.wraps(real)
        def spy(
            self: Any, *args: Any, _real: Any = real, _at: str = f"{class_name}.{method}", **kwargs: Any
        ) -> Any:
            with out.open("a") as f:
                f.write(json.dumps({"at": _at, **_walk()}) + "\n")
            return _real(self, *args, **kwargs)

        spy._walk_spy = True  # type: ignore[attr-defined]
        setattr(cls, method, spy)


def read(folder: Path) -> list[dict[str, Any]]:
    """Every record the ranks wrote into ``folder``."""
    return [
        json.loads(line)
        for path in sorted(folder.glob("walks-*.jsonl"))
        for line in path.read_text().splitlines()
    ]
