"""The walks of docs/architecture.md ("The walks"): a save and a resume by our strategies reach the
backend through the modules the docs name there, in that order, at most 4 of ours before DCP or the
backend, and DCP calls back only the hooks named (issue "One concept once")."""

from __future__ import annotations

import re
from pathlib import Path

from tests.strategies.plan import Session
from tests.walks import read

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def documented() -> dict[str, tuple[list[str], set[str]]]:
    """The walks table: backend call -> (our modules in call order, the hooks DCP calls back)."""
    text = DOC.read_text()
    section = text[text.index("### The walks") :].splitlines()
    start = next(i for i, line in enumerate(section) if line.startswith("|"))
    end = next(i for i in range(start, len(section)) if not section[i].startswith("|"))
    walks: dict[str, tuple[list[str], set[str]]] = {}
    for row in section[start + 2 : end]:
        _, modules, hooks, backend = (cell.strip() for cell in row.strip("|").split("|"))
        walks[re.findall(r"`([^`]+)`", backend)[0]] = (
            re.findall(r"`([^`]+)`", modules),
            set(re.findall(r"`([^`]+)`", hooks)),
        )
    return walks


def is_subsequence(seen: list[str], allowed: list[str]) -> bool:
    rest = iter(allowed)
    return all(module in rest for module in seen)


def test_saves_and_resumes_reach_the_backend_through_the_documented_modules(runs: Session) -> None:
    walks = documented()
    records = read(runs.walks)
    ran = {record["at"] for record in records}
    assert ran == set(walks), f"a documented walk never ran, or one ran undocumented: {sorted(ran)}"
    for record in records:
        assert record["before"], f"no module of ours recorded before the backend: {record}"
        modules, hooks = walks[record["at"]]
        assert is_subsequence(record["before"], modules), (record, modules)
        assert len(record["before"]) <= 4, record
        assert set(record["callbacks"]) <= hooks, (record, hooks)


def test_the_check_notices_a_hop_or_an_order_the_docs_do_not_name() -> None:
    modules = ["strategies._checkpointing", "checkpoint.save", "checkpoint.commit"]
    assert is_subsequence(["strategies._checkpointing", "checkpoint.commit"], modules)
    assert not is_subsequence(["checkpoint.commit", "checkpoint.save"], modules)
    assert not is_subsequence(["strategies._checkpointing", "checkpoint.failures"], modules)
