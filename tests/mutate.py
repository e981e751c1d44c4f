"""Mutation testing of the core modules: small plausible bugs, one at a time, and whether a test notices.

    python -m tests.mutate                  # the sampled run of docs/mutation.md (seed 44, 8 per module)
    python -m tests.mutate --modules commit --per-module 0   # every mutant of one module (0 = all)
    python -m tests.mutate --list           # the chosen mutants, without running anything

Each mutant is one edit of one core module's source (:data:`MODULES`): a comparison flipped, a
condition negated, ``and``/``or`` swapped, a constant off by one (slices included) or a boolean
flipped, a statement dropped (a call such as ``os.fsync`` or a restore, a ``raise``), two adjacent
independent statements swapped, a loop's order reversed, a returned value replaced by ``None``, or a
name added to an allow-list of qualified names (``builtins.eval``). The edit is made in a copy of the
working tree (never in the tree itself), and the tests that cover that module run against the copy
with ``pytest -x``, in two tiers: the module's own tests, then, for a mutant they miss, the wider tests
that also exercise it. A failing run kills the mutant; a run past the timeout (a hang) kills it too,
with a note. A module's own tests first run once unmutated (a failure there skips the module), and the
wider ones the first time they kill a mutant (a failure there makes its kills ``unknown``).

The choice is reproducible: the mutants of a module are grouped by operator, each group shuffled
with ``--seed``, and ``--per-module`` taken round-robin across the groups, so the same source and
seed give the same mutants. A line holding ``# no mutate`` is never mutated. It does not run in CI
(a sampled run takes most of an hour on 2 shared cores); run it after large changes, and before
resolving an issue about the suite. The results go to ``--out`` (JSON lines, rewritten as it goes;
``--resume`` keeps the killed ones of an interrupted run) and a summary to stdout: killed / total, and
each survivor with file:line and the mutation.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PKG = "lightning_sharded"

#: Module group -> (its source files, the tests that cover it most directly and fast, the wider tests a
#: mutant that survives the first runs next). In the order a run takes them: the quickest first.
MODULES: dict[str, tuple[list[str], list[str], list[str]]] = {
    "unpickling": (
        [f"checkpoint/unpickling/{name}.py" for name in ("__init__", "allowed", "inert", "loaders")],
        ["tests/checkpoint/test_unpickling.py", "tests/checkpoint/test_allow_lists.py"],
        ["tests/test_tools_safety.py", "tests/test_reader.py", "tests/checkpoint/test_hostile_payloads.py"],
    ),
    "rank_state": (
        ["checkpoint/rank_state.py"],
        ["tests/checkpoint/test_rank_state.py", "tests/test_user_state.py"],
        ["tests/strategies/test_exact_resume.py"],
    ),
    "integrity": (
        ["checkpoint/integrity.py"],
        ["tests/checkpoint/test_io.py", "tests/test_verify_errors.py", "tests/checkpoint/test_bit_flips.py"],
        [
            "tests/test_reader.py",
            "tests/test_tools_safety.py",
            "tests/test_decisions.py",
            "tests/checkpoint/test_verify_modes.py",
        ],
    ),
    "hooks": (
        ["hooks.py"],
        ["tests/test_hooks.py", "tests/test_sites.py"],
        ["tests/test_mixin.py", "tests/test_properties.py", "tests/test_wrapping.py"],
    ),
    "tensors": (
        [f"tensors/{name}.py" for name in ("__init__", "base", "dtensor", "sharded_tensor")],
        ["tests/test_hooks.py"],
        ["tests/test_properties.py", "tests/test_sites.py"],
    ),
    "backends/local": (
        ["checkpoint/backends/local.py"],
        ["tests/checkpoint/test_io.py", "tests/test_atomic.py", "tests/test_core_contracts.py"],
        ["tests/test_atomic_faults.py", "tests/test_storage_faults.py", "tests/test_full_disk.py"],
    ),
    "load": (
        [f"checkpoint/load/{name}.py" for name in ("__init__", "checks", "full", "parts", "sharded")],
        [
            "tests/test_core_contracts.py",
            "tests/checkpoint/test_partial_reads.py",
            "tests/test_verify_errors.py",
            "tests/checkpoint/test_optimizer_states.py",
            "tests/checkpoint/test_strict_keys.py",
        ],
        [
            "tests/checkpoint/test_rank_index.py",
            "tests/test_reader.py",
            "tests/checkpoint/test_param_groups.py",
            "tests/checkpoint/test_fsdp1_views.py",
        ],
    ),
    "fsdp1": (
        [f"checkpoint/fsdp1/{name}.py" for name in ("__init__", "layout", "optimizer", "views")],
        [
            "tests/checkpoint/test_fsdp1_views.py",
            "tests/test_decisions.py",
            "tests/checkpoint/test_param_groups.py",
        ],
        ["tests/test_uneven_pieces.py", "tests/strategies/test_fsdp.py"],
    ),
    "async_save": (
        ["checkpoint/async_save.py"],
        ["tests/test_async_save.py"],
        ["tests/test_core_contracts.py"],
    ),
    "commit": (
        ["checkpoint/commit.py"],
        ["tests/test_atomic.py", "tests/test_rank_faults.py"],
        ["tests/test_atomic_faults.py", "tests/test_storage_faults.py", "tests/test_full_disk.py"],
    ),
    # The byte paths made fast in issue 48: a save's writer and write-behind, a load's reader, CRC-32.
    "io": (
        [
            "checkpoint/backends/dcp_reader.py",
            "checkpoint/backends/dcp_writer.py",
            "checkpoint/writeback.py",
            "checkpoint/checksum.py",
        ],
        [
            "tests/test_writeback.py",
            "tests/test_writer.py",
            "tests/test_reader.py",
            "tests/checkpoint/test_io.py",
            "tests/checkpoint/test_bit_flips.py",
        ],
        [
            "tests/checkpoint/test_verify_modes.py",
            "tests/test_faithful_limit.py",
            "tests/test_atomic.py",
            "tests/checkpoint/test_durability.py",
            "tests/test_core_contracts.py",
        ],
    ),
    # The offline tools' own copies of the bytes (consolidate and export without torch).
    "tools_direct": (
        [
            f"checkpoint/tools/{name}.py"
            for name in ("direct_copy", "consolidate_direct", "export_direct", "consolidate_mapped")
        ],
        ["tests/checkpoint/test_consolidate_direct.py", "tests/checkpoint/test_export_direct.py"],
        ["tests/test_tools_cli.py", "tests/test_tools_safety.py", "tests/checkpoint/test_unpickling.py"],
    ),
}

#: Comparison flips.
_FLIP: dict[type, type] = {
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE,
    ast.LtE: ast.Gt, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}  # fmt: skip
#: What the allow-list operator adds to a tuple/list/set of qualified names.
_DANGEROUS = ("builtins.eval", "builtins.getattr")
NO_MUTATE = "# no mutate"


@dataclass(frozen=True)
class Mutant:
    """One edit: replace ``lines[start-1:end]`` of ``path`` by ``text``; ``what`` says what it does."""

    group: str
    path: str
    line: int
    kind: str
    what: str
    start: int
    end: int
    text: str

    def apply(self, source: str) -> str:
        """``source`` with this edit made."""
        lines = source.splitlines(keepends=True)
        return "".join([*lines[: self.start - 1], self.text, *lines[self.end :]])


def _segment(lines: list[str], node: ast.expr | ast.stmt, new: str) -> tuple[int, int, str]:
    """The whole lines of ``node`` with its own text replaced by ``new``."""
    start, end = node.lineno, node.end_lineno or node.lineno
    head = lines[start - 1][: node.col_offset]
    tail = lines[end - 1][node.end_col_offset or node.col_offset :]
    return start, end, head + new + tail


def _src(node: ast.AST) -> str:
    return "(" + ast.unparse(node) + ")"


def _not_mutated(tree: ast.AST) -> set[int]:
    """Ids of the nodes no operator touches: annotations, f-strings, ``__all__``, ``TYPE_CHECKING`` blocks."""
    roots: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            roots.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            roots.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        elif (
            isinstance(node, ast.JoinedStr)
            or (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets))
            or (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
        ):
            roots.append(node)
    return {id(n) for root in roots for n in ast.walk(root)}


def _qualified_names(node: ast.AST) -> bool:
    """Whether ``node`` is a literal tuple/list/set of dotted names (``"builtins.set"``): an allow-list."""
    elts = getattr(node, "elts", None)
    if not elts:
        return False
    names = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return (
        bool(names)
        and all("." in n for n in names)
        and len(names) + sum(isinstance(e, ast.Starred) for e in elts) == len(elts)
    )


def mutants_of(group: str, rel: str, source: str) -> Iterator[Mutant]:
    """Every mutant the operators make of one file (``rel``, relative to the package)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    skip = _not_mutated(tree)
    path = f"{PKG}/{rel}"

    def make(node: ast.expr | ast.stmt, kind: str, what: str, new: str) -> Mutant | None:
        start, end, text = _segment(lines, node, new)
        if any(NO_MUTATE in lines[i] for i in range(start - 1, end)):
            return None
        return Mutant(group, path, node.lineno, kind, what, start, end, text)

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        out: list[Mutant | None] = []
        if isinstance(node, ast.Compare) and type(node.ops[0]) in _FLIP:
            new = ast.Compare(node.left, [_FLIP[type(node.ops[0])](), *node.ops[1:]], node.comparators)
            out.append(make(node, "compare", f"{ast.unparse(node)} -> {ast.unparse(new)}", _src(new)))
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            out.append(
                make(
                    node.test, "negate", f"{ast.unparse(node.test)} -> not (...)", f"(not {_src(node.test)})"
                )
            )
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append(make(node, "negate", f"{ast.unparse(node)} -> without not", _src(node.operand)))
        if isinstance(node, ast.BoolOp):
            other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            new_b = ast.BoolOp(other, node.values)
            out.append(make(node, "boolop", f"{ast.unparse(node)} -> {ast.unparse(new_b)}", _src(new_b)))
        if isinstance(node, ast.Constant) and type(node.value) is bool:
            out.append(make(node, "constant", f"{node.value} -> {not node.value}", repr(not node.value)))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            out.append(make(node, "constant", f"{node.value} -> {node.value + 1}", repr(node.value + 1)))
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)) or isinstance(
            node, (ast.Raise, ast.AugAssign)
        ):
            out.append(make(node, "drop", f"drop `{ast.unparse(node)[:70]}`", "pass"))
        if isinstance(node, ast.Return) and node.value is not None and ast.unparse(node.value) != "None":
            out.append(
                make(node, "return", f"return {ast.unparse(node.value)[:50]} -> return None", "return None")
            )
        if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            new_i = f"reversed(list({ast.unparse(node.iter)}))"
            out.append(make(node.iter, "reverse", f"iterate {ast.unparse(node.iter)[:50]} reversed", new_i))
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and _qualified_names(node):
            for name in _DANGEROUS:
                new_a = copy.copy(node)
                new_a.elts = [*node.elts, ast.Constant(name)]
                out.append(make(node, "allowlist", f"add {name!r} to the names", _src(new_a)))
        for body in ("body", "orelse", "finalbody"):
            stmts = getattr(node, body, None)
            if isinstance(stmts, list):
                out.extend(_swaps(group, path, lines, stmts))
        yield from (m for m in out if m is not None)


def _swaps(group: str, path: str, lines: list[str], stmts: list[ast.stmt]) -> Iterator[Mutant]:
    simple = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign)
    for a, b in itertools.pairwise(stmts):
        if not (isinstance(a, simple) and isinstance(b, simple)) or (
            isinstance(a, ast.Expr) and isinstance(a.value, ast.Constant)
        ):
            continue
        a_end, b_end = a.end_lineno or a.lineno, b.end_lineno or b.lineno
        if b.lineno != a_end + 1 or any(NO_MUTATE in lines[i] for i in range(a.lineno - 1, b_end)):
            continue
        if not any(isinstance(n, ast.Call) for n in (*ast.walk(a), *ast.walk(b))) or _depends(a, b):
            continue  # two plain values swap to the same program; a use before its assignment is no real bug
        text = "".join(lines[b.lineno - 1 : b_end] + lines[a.lineno - 1 : a_end])
        what = f"swap `{ast.unparse(a)[:40]}` and `{ast.unparse(b)[:40]}`"
        yield Mutant(group, path, a.lineno, "swap", what, a.lineno, b_end, text)


def _depends(a: ast.stmt, b: ast.stmt) -> bool:
    def names(stmt: ast.stmt, ctx: type) -> set[str]:
        return {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}

    stored_a, stored_b = names(a, ast.Store), names(b, ast.Store)
    if isinstance(a, ast.AugAssign) and isinstance(a.target, ast.Name):
        stored_a.add(a.target.id)
    return bool(stored_a & names(b, ast.Load) or stored_b & names(a, ast.Load) or stored_a & stored_b)


def choose(group: str, seed: int, per_module: int) -> list[Mutant]:
    """The mutants of ``group`` that a run with ``seed`` tests: ``per_module`` of them (0: all)."""
    by_kind: dict[str, list[Mutant]] = {}
    for rel in MODULES[group][0]:
        source = (REPO / PKG / rel).read_text()
        for m in mutants_of(group, rel, source):
            try:
                compile(m.apply(source), m.path, "exec")
            except SyntaxError:
                continue
            by_kind.setdefault(m.kind, []).append(m)
    rng = random.Random(f"{seed}:{group}")
    for kind in sorted(by_kind):
        rng.shuffle(by_kind[kind])
    queues = [by_kind[k] for k in sorted(by_kind)]
    rng.shuffle(queues)
    chosen: list[Mutant] = []
    while any(queues) and (per_module == 0 or len(chosen) < per_module):
        for queue in queues:
            if queue and (per_module == 0 or len(chosen) < per_module):
                chosen.append(queue.pop(0))
    return chosen


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_tests(work: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    """Run ``tests`` in ``work``: ``("passed" | "failed" | "timeout", seconds, last output line)``."""
    env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *tests]
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:  # ranks run in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()
        return "timeout", time.monotonic() - began, f"no result after {timeout:.0f} s"
    lines = [line for line in out.splitlines() if line.strip()]
    first_failure = next(
        (line for line in lines if line.startswith(("FAILED", "ERROR"))), lines[-1] if lines else ""
    )
    return ("passed" if proc.returncode == 0 else "failed"), time.monotonic() - began, first_failure


def report(rows: list[dict[str, Any]]) -> str:
    """Results as docs/mutation.md shows them: the score per module and in all, then every survivor."""
    lines = [
        "| module | mutants | killed | of them by the wider tests | timeouts | survived |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = list({_key(r): r for r in rows}.values())  # a mutant in several files: its last result
    groups = list(dict.fromkeys(r["group"] for r in rows))
    for group in [*groups, None]:
        mine = [r for r in rows if group is None or r["group"] == group]
        killed = [r for r in mine if r["status"] in ("failed", "timeout")]
        lines.append(
            f"| {group or '**all**'} | {len(mine)} | {len(killed)}"
            f" | {sum(r.get('tier') == 'wider' for r in killed)}"
            f" | {sum(r['status'] == 'timeout' for r in mine)}"
            f" | {sum(r['status'] == 'passed' for r in mine)} |"
        )
    lines += ["", "| survivor | operator | mutation |", "|---|---|---|"]
    for r in rows:
        if r["status"] == "passed":
            what = str(r["what"]).replace("|", "\\|")
            lines.append(f"| `{r['path']}:{r['line']}` | {r['kind']} | {what} |")
    return "\n".join(lines)


def _key(row: dict[str, object]) -> tuple[object, ...]:
    return tuple(row[k] for k in ("path", "start", "end", "text"))


def main(argv: list[str] | None = None) -> int:
    """Run the sampled mutants; print the score and the survivors; exit 0."""
    parser = argparse.ArgumentParser(prog="python -m tests.mutate", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--modules", nargs="*", default=list(MODULES), choices=list(MODULES), metavar="MODULE"
    )
    parser.add_argument("--seed", type=int, default=44)
    parser.add_argument("--per-module", type=int, default=8, help="mutants per module (0: all)")
    parser.add_argument(
        "--timeout", type=float, default=0, help="seconds per run (default: 3x the clean run + 60)"
    )
    parser.add_argument("--out", type=Path, default=Path("mutation-results.jsonl"))
    parser.add_argument("--resume", action="store_true", help="keep the killed mutants --out already holds")
    parser.add_argument("--list", action="store_true", help="print the chosen mutants and stop")
    parser.add_argument(
        "--report", nargs="+", type=Path, metavar="JSONL", help="print runs' results as Markdown"
    )
    args = parser.parse_args(argv)
    if args.report:
        print(
            report(
                [json.loads(line) for path in args.report for line in path.read_text().splitlines() if line]
            )
        )
        return 0

    plan = {group: choose(group, args.seed, args.per_module) for group in args.modules}
    if args.list:
        for group, chosen in plan.items():
            for m in chosen:
                print(f"{group:14} {m.path}:{m.line} [{m.kind}] {m.what}")
        return 0
    done: dict[tuple[object, ...], dict[str, object]] = {}
    if args.resume and args.out.exists():
        rows = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
        done = {_key(r): r for r in rows if r["status"] != "passed"}
    rows_out: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        work = Path(tmp) / "tree"
        shutil.copytree(
            REPO, work, ignore=shutil.ignore_patterns(".git", "__pycache__", "*_cache", "*.egg-info")
        )
        for group, chosen in plan.items():
            _, first, wider = MODULES[group]
            todo = [m for m in chosen if _key(asdict(m)) not in done]
            rows_out += [done[_key(asdict(m))] for m in chosen if _key(asdict(m)) in done]
            print(
                f"== {group}: {len(chosen)} mutants, {len(chosen) - len(todo)} killed in the run resumed",
                flush=True,
            )
            if not todo:
                continue
            status, seconds, note = run_tests(work, first, timeout=3600)
            print(f"   clean run of {' '.join(first)}: {status} in {seconds:.0f} s", flush=True)
            if status != "passed":
                print(f"   the tests fail without a mutant ({note}); module skipped", flush=True)
                continue
            timeout = args.timeout or 3 * seconds + 60
            wider_clean: str | None = None
            for m in todo:
                target = work / m.path
                original = target.read_text()
                target.write_text(m.apply(original))
                try:
                    status, seconds, note = run_tests(work, first, timeout)
                    tier = "first"
                    if status == "passed" and wider:
                        status, more, note = run_tests(work, wider, max(timeout, 600))
                        seconds, tier = seconds + more, "wider"
                finally:
                    target.write_text(original)
                if tier == "wider" and status != "passed" and wider_clean is None:
                    wider_clean, _, clean_note = run_tests(
                        work, wider, 3600
                    )  # a kill means nothing if they fail anyway
                    print(f"   clean run of {' '.join(wider)}: {wider_clean}", flush=True)
                if tier == "wider" and wider_clean not in (None, "passed"):
                    status, note = "unknown", f"the wider tests fail without a mutant: {clean_note}"
                row = {
                    **asdict(m),
                    "status": status,
                    "tier": tier,
                    "seconds": round(seconds, 1),
                    "note": note,
                }
                rows_out.append(row)
                print(f"   {status:7} {seconds:5.0f} s  {m.path}:{m.line} [{m.kind}] {m.what}", flush=True)
                pending = [r for k, r in done.items() if all(_key(o) != k for o in rows_out)]
                args.out.write_text("".join(json.dumps(r) + "\n" for r in [*rows_out, *pending]))
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows_out))
    scored = [r for r in rows_out if r["status"] in ("passed", "failed", "timeout")]
    killed = sum(r["status"] != "passed" for r in scored)
    print(f"\nkilled {killed} / {len(scored)}" + (f" ({100 * killed / len(scored):.0f}%)" if scored else ""))
    for r in rows_out:
        if r["status"] != "failed":
            print(f"{r['status']}: {r['path']}:{r['line']} [{r['kind']}] {r['what']}  {r['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
