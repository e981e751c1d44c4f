"""Every name docs/api.md and docs/architecture.md show exists; the API page shows exactly the public API.

docs/api.md is ``lightning_sharded.__all__``: each table row's first name is a public name (or one of its
attributes), each public name has a row, and each parameter a signature there shows is one the callable
takes. docs/architecture.md's "Internal modules" tables show modules, names and protocol methods that
all resolve. A name removed or renamed in the code fails here until the page follows.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import re
from types import ModuleType
from typing import Any

import pytest

import lightning_sharded
from tests.distributed.launch import REPO

API = REPO / "docs" / "api.md"
ARCHITECTURE = REPO / "docs" / "architecture.md"
#: Where a module path of the architecture page may be relative to, tried in order.
PREFIXES = ("lightning_sharded.", "lightning_sharded.checkpoint.", "")
_MISSING = object()


def rows(markdown: str) -> list[tuple[str, str]]:
    """``(first cell, the rest)`` of every table row of ``markdown`` but headers and rules."""
    found = []
    for line in markdown.splitlines():
        cells = re.split(r"(?<!\\)\|", line.strip())
        header = len(cells) < 3 or set(cells[1].strip()) <= set("-: ") or cells[1].strip() == "name"
        if line.startswith("|") and not header:
            found.append((cells[1], "|".join(cells[2:])))
    return found


def spans(cell: str) -> list[str]:
    """The code spans of a cell."""
    return re.findall(r"`([^`]+)`", cell)


def dotted(span: str) -> str:
    """The name a span shows: what comes before a call's parentheses or a ``->``."""
    return re.split(r"[(\s]", span.strip(), maxsplit=1)[0]


def attribute(obj: Any, path: str) -> Any:
    """``obj.path`` (a dataclass's fields count), or ``_MISSING``."""
    for part in path.split("."):
        fields = (
            {f.name for f in dataclasses.fields(obj)}
            if inspect.isclass(obj) and dataclasses.is_dataclass(obj)
            else ()
        )
        obj = getattr(obj, part, _MISSING) if part not in fields else None
        if obj is _MISSING:
            return _MISSING
    return obj


def resolve(path: str) -> Any:
    """The object a dotted path names, relative to :data:`PREFIXES`; ``_MISSING`` where none is."""
    for prefix in PREFIXES:
        parts = (prefix + path).split(".")
        for cut in range(len(parts), 0, -1):
            try:
                module = importlib.import_module(".".join(parts[:cut]))
            except (ImportError, ValueError):
                continue
            found = attribute(module, ".".join(parts[cut:])) if parts[cut:] else module
            if found is not _MISSING:
                return found
            break
    return _MISSING


def test_the_api_page_lists_exactly_the_public_api() -> None:
    page = API.read_text()
    documented: set[str] = set()
    for first, _ in rows(page):
        for span in spans(first):
            name = dotted(span)
            head = name.split(".")[0]
            assert head in lightning_sharded.__all__, (
                f"docs/api.md has a row for `{span}`, which is not in lightning_sharded.__all__: an internal"
                " name goes to docs/architecture.md's 'Internal modules'"
            )
            assert attribute(lightning_sharded, name) is not _MISSING, (
                f"docs/api.md: `{name}` does not resolve"
            )
            documented.add(head)
    undocumented = sorted(set(lightning_sharded.__all__) - documented)
    assert not undocumented, f"lightning_sharded exports {undocumented}, which docs/api.md has no row for"


def test_every_parameter_the_api_page_shows_is_one_the_callable_takes() -> None:
    checked = 0
    for first, _ in rows(API.read_text()):
        for span in spans(first):
            match = re.match(r"([\w.]+)\((.*)\)", span)
            if not match:
                continue
            target = attribute(lightning_sharded, match.group(1))
            signature = inspect.signature(target.__init__ if inspect.isclass(target) else target)
            shown = {p.split("=")[0].strip().lstrip("*") for p in match.group(2).split(",")}
            shown -= {"", "...", "args", "kwargs"}
            unknown = sorted(shown - set(signature.parameters))
            assert not unknown, f"docs/api.md shows `{match.group(1)}` with {unknown}, which it does not take"
            checked += 1
    assert checked >= 10


def test_every_name_of_the_internal_modules_tables_resolves() -> None:
    section = ARCHITECTURE.read_text().split("## Internal modules", 1)[1].split("\n## ", 1)[0]
    heading_modules = {m.start(): m.group(1) for m in re.finditer(r"^### `([\w.]+)`", section, re.M)}
    checked, problems = 0, []
    for block_start, block in _blocks(section, heading_modules):
        module = heading_modules.get(block_start)
        for first, rest in rows(block):
            context: list[Any] = [resolve(module)] if module else []
            for span in spans(first):
                name = dotted(span)
                found = resolve(name)
                if found is _MISSING:  # a name of the module or class named before it in the cell
                    found = next(
                        (a for c in reversed(context) if (a := attribute(c, name)) is not _MISSING), _MISSING
                    )
                if found is _MISSING:
                    problems.append(f"`{span}`")
                    continue
                checked += 1
                if (home := inspect.getmodule(found)) not in (None, found):  # the names beside it
                    context.append(home)
                if isinstance(found, ModuleType) or inspect.isclass(found):
                    context.append(found)
            if "(protocol)" in first:  # its methods, in the description
                protocol = resolve(dotted(spans(first)[0]))
                for span in spans(rest):
                    if re.fullmatch(r"[a-z_]\w*(\(.*)?", dotted(span)) and "." not in dotted(span):
                        checked += 1
                        if not hasattr(protocol, dotted(span)):
                            problems.append(f"`{dotted(span)}` of {protocol.__name__}")
    assert not problems, f"docs/architecture.md's internal modules name what does not exist: {problems}"
    assert checked >= 100


def _blocks(section: str, headings: dict[int, str]) -> list[tuple[int, str]]:
    starts = [0, *sorted(headings), len(section)]
    return [(start, section[start:end]) for start, end in itertools.pairwise(starts)]


@pytest.mark.parametrize("name", ["Backend.mtime", "Backend.unpublished", "Backend.manifest_fields"])
def test_the_names_once_documented_and_defined_nowhere_stay_out(name: str) -> None:
    assert resolve(f"checkpoint.backends.{name}") is _MISSING
    assert name.split(".")[1] not in ARCHITECTURE.read_text() + API.read_text()
