"""The package's imports flow one way: each module sits in a layer and imports only from its own group
or from lower layers; no cycle; no module takes another's private name; path-versus-URL is decided in
the backends alone. docs/architecture.md draws the same table."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.imports import Graph, find_cycle, read_graph

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_sharded"

#: ``(layer, group, modules)``, lowest first; a module is named without the package, and a name ending
#: in ``.*`` takes in the package of that name and everything under it.
Layers = list[tuple[int, str, tuple[str, ...]]]

LAYERS: Layers = [
    (
        0,
        "base",
        (
            "checkpoint.errors",
            "checkpoint.failures",
            "checkpoint.manifest",
            "checkpoint.names",
            "checkpoint.problems",
            "checkpoint.progress",
            "checkpoint.libc",
            "checkpoint.faults",
            "checkpoint.checksum",
            "checkpoint.flat_ranges",
            "checkpoint.writeback",
            "checkpoint.unpickling.*",
            "tensors.*",
            "_fqn",
            "_lazy",
            "_registry",
            "_exit",
            "_launch",
            "_compat",
        ),
    ),
    (1, "backends", ("checkpoint.backends.*",)),
    (1, "coordination", ("checkpoint.presence", "checkpoint.collective")),
    (
        2,
        "format",
        (
            "checkpoint.detect",
            "checkpoint.hf_layout",
            "checkpoint.dcp_index",
            "checkpoint.rank_index",
            "checkpoint.lightning_meta",
        ),
    ),
    (2, "staging", ("checkpoint.staging",)),
    (
        2,
        "model",
        (
            "_sites",
            "foreign",
            "checkpoint.fsdp1.*",
            "checkpoint.shard_pieces",
            "checkpoint.state_dicts",
            "checkpoint.train_loaders",
            "user_state",
        ),
    ),
    (3, "integrity", ("checkpoint.integrity", "checkpoint.pickles")),
    (4, "load", ("checkpoint.load.*", "checkpoint.rank_state")),
    (
        4,
        "save",
        (
            "checkpoint.commit",
            "checkpoint.space",
            "checkpoint.save",
            "checkpoint.async_save",
            "checkpoint.destination",
        ),
    ),
    (4, "hooks", ("hooks",)),
    (5, "tools", ("checkpoint.tools.*", "checkpoint.verify")),
    (6, "api", ("mixin", "strategies.*")),
    (7, "entry", ("", "checkpoint", "cli", "demo")),  # the package facades and the commands
]

#: The one group whose modules may tell a path from a URL (``is_url``) or use fsspec.
STORAGE = "backends"


def place(module: str, package: str = PACKAGE, layers: Layers = LAYERS) -> tuple[int, str]:
    """``(layer, group)`` of ``module``; ``KeyError`` for a module no layer names."""
    short = module.removeprefix(package).removeprefix(".")
    best: tuple[int, tuple[int, str]] | None = None
    for layer, group, members in layers:
        for member in members:
            if member.endswith(".*"):
                root = member[:-2]
                matches = short == root or short.startswith(root + ".")
                length = len(root)
            else:
                matches, length = short == member, len(member)
            if matches and (best is None or length > best[0]):
                best = (length, (layer, group))
    if best is None:
        raise KeyError(
            f"{module} is in no layer of tests/test_layers.py: place it there and in docs/architecture.md"
        )
    return best[1]


def violations(graph: Graph, package: str = PACKAGE, layers: Layers = LAYERS) -> list[str]:
    """Every way ``graph`` breaks the rules, in words; empty when it keeps them."""
    found: list[str] = []
    for module, imported in sorted(graph.edges.items()):
        layer, group = place(module, package, layers)
        for other in sorted(imported):
            other_layer, other_group = place(other, package, layers)
            if other_group != group and other_layer >= layer:
                found.append(
                    f"{module} ({group}, layer {layer}) imports {other} ({other_group}, layer {other_layer})"
                )
    cycle = find_cycle(graph.edges)
    if cycle is not None:
        found.append("import cycle: " + " -> ".join(cycle))
    found.extend(f"{m} takes the private name {n} of {o}" for m, o, n in graph.private)
    for module in sorted(graph.edges):
        if place(module, package, layers)[1] == STORAGE:
            continue
        if "is_url" in graph.names[module]:
            found.append(f"{module} asks is_url: only the backends tell a path from a URL")
        if "fsspec" in graph.external[module]:
            found.append(f"{module} imports fsspec: only the backends reach object storage")
    return found


def test_the_package_keeps_its_layers() -> None:
    graph = read_graph(REPO, PACKAGE)
    assert f"{PACKAGE}.checkpoint.load" in graph.edges[f"{PACKAGE}.strategies._checkpointing"]  # it is read
    assert violations(graph) == []


def test_every_module_has_a_layer() -> None:
    for module in read_graph(REPO, PACKAGE).edges:
        place(module)  # raises for a module no layer names


def test_the_layers_of_the_docs_are_the_tests() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    for layer, group, _ in LAYERS:
        assert f"| {layer} | {group} |" in text, f"docs/architecture.md has no row for layer {layer}, {group}"


# -- the checks catch what they are for: a small package with one violation at a time ---------------------

TOY_LAYERS: Layers = [
    (0, "base", ("names",)),
    (1, "backends", ("backends.*",)),
    (2, "load", ("load",)),
    (2, "save", ("save",)),
    (3, "api", ("", "strategies")),
]
CLEAN = {
    "__init__.py": "",
    "names.py": "MODEL = 'model'\n_SECRET = 1\n",
    "backends/__init__.py": "from toy.backends.local import is_url\n",
    "backends/local.py": "import fsspec\n\ndef is_url(x):\n    return '://' in x\n",
    "load.py": "from toy.backends import local\nfrom toy.names import MODEL\n",
    "save.py": "from toy import names\n",
    "strategies.py": "from toy import load, save\n\ndef f():\n    from toy.backends import local\n",
}


def _toy(tmp_path: Path, **changed: str) -> Graph:
    files = {**CLEAN, **{k.replace("__", "/") + ".py": v for k, v in changed.items()}}
    for name, text in files.items():
        path = tmp_path / "toy" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return read_graph(tmp_path, "toy")


@pytest.mark.parametrize(
    ("changed", "expected"),
    [
        ({"names": "from toy import load\n"}, "toy.names (base, layer 0) imports toy.load (load, layer 2)"),
        (
            {"load": "def f():\n    from toy.save import x\n"},
            "toy.load (load, layer 2) imports toy.save (save, layer 2)",
        ),
        ({"backends__local": "from toy.load import MODEL\n"}, "import cycle: toy.backends.local -> toy.load"),
        ({"save": "from toy.names import _SECRET\n"}, "toy.save takes the private name _SECRET of toy.names"),
        ({"save": "from toy.backends import is_url\nis_url('x')\n"}, "toy.save asks is_url"),
        ({"save": "def f():\n    import fsspec.core\n"}, "toy.save imports fsspec"),
    ],
    ids=["upward", "sideways-in-a-function", "cycle", "private-name", "is-url", "fsspec"],
)
def test_each_rule_catches_its_violation(tmp_path: Path, changed: dict[str, str], expected: str) -> None:
    assert violations(_toy(tmp_path), "toy", TOY_LAYERS) == []
    found = violations(_toy(tmp_path, **changed), "toy", TOY_LAYERS)
    assert any(f.startswith(expected) for f in found), found


def test_a_module_in_no_layer_is_named(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match=r"toy\.extra is in no layer"):
        violations(_toy(tmp_path, extra="x = 1\n"), "toy", TOY_LAYERS)
