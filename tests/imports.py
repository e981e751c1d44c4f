"""The import graph of a package read from its source, for the tests that hold its layers.

Imports inside functions count (they run too, only later); so do imports under ``TYPE_CHECKING``
(a type is a dependency of the reader). Read with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Graph:
    """What the modules of a package import of it.

    Attributes:
        edges: ``{module: the modules of the package it imports}`` (``from pkg.mod import name`` counts
            as ``pkg.mod``; ``from pkg import mod`` as ``pkg.mod`` where ``mod`` is a module).
        private: ``(module, imported module, name)`` for every ``_name`` one module takes from another.
        names: ``{module: every name it uses}`` (attribute names included), for checks of who calls what.
        external: ``{module: the top-level packages outside ``package`` it imports}``.
    """

    edges: dict[str, set[str]] = field(default_factory=dict)
    private: list[tuple[str, str, str]] = field(default_factory=list)
    names: dict[str, set[str]] = field(default_factory=dict)
    external: dict[str, set[str]] = field(default_factory=dict)


def read_graph(root: Path, package: str) -> Graph:
    """The import graph of ``package``, whose directory is ``root / package``."""
    paths = {_module(path, root): path for path in (root / package).rglob("*.py")}
    graph = Graph()
    for name, path in sorted(paths.items()):
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        imported: set[str] = set()
        used: set[str] = set()
        external: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name in paths)
                external.update(a.name.split(".")[0] for a in node.names if a.name.split(".")[0] != package)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, here)
                if base.split(".")[0] != package:
                    external.add(base.split(".")[0])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in paths:
                        imported.add(sub)
                    elif base in paths:
                        imported.add(base)
                        private = alias.name.startswith("_") and not alias.name.startswith("__")
                        if private and base != name:
                            graph.private.append((name, base, alias.name))
            elif isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
        imported.discard(name)
        graph.edges[name] = imported
        graph.names[name] = used
        graph.external[name] = external
    return graph


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``) of ``edges``, or ``None`` where there is none."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(edges.get(module, ())):
            found = visit(imported, [*path, module])
            if found is not None:
                return found
        done.add(module)
        return None

    for module in sorted(edges):
        found = visit(module, [])
        if found is not None:
            return found
    return None


def _module(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _absolute(node: ast.ImportFrom, here: str) -> str:
    if not node.level:
        return node.module or ""
    parts = here.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)
