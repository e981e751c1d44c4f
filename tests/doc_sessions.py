"""The sample sessions of docs/cli.md: run, compared exactly, rewritten when an output changes on purpose.

    python -m tests.doc_sessions            # run them and show how the docs differ (exit 1 if they do)
    python -m tests.doc_sessions --update   # the same, then write what the commands print into the docs

Each ``console`` block of docs/cli.md is a session: ``$ COMMAND`` lines, each followed by the lines it
prints (stdout and stderr). The sessions run one after the other in a folder where ``lightning-sharded
demo`` ran first (a ``$ lightning-sharded demo`` line shows that run's output), and what each command
prints is compared with the docs exactly, numbers included. The demo's checkpoint is the same from
run to run (seeded, fixed sizes, no path or time in a file whose size or checksum is shown), so the
only placeholders are what truly varies, each in :data:`PLACEHOLDERS`, and the size of a set of
files may differ by one unit of its last digit (:data:`FILES_SIZE`: torch.save's archive layout varies
by a few bytes between torch releases). A command keeps the output the
docs show while it prints the same up to those placeholders, so ``--update`` changes only what did.

``lightning-sharded`` commands run in this process (``main``, the console script's entry point), with
``; echo "exit $?"`` and ``| head -n N`` / ``| tail -n N`` applied to their output; any other command
runs in bash. A warning a command emits (other than the deprecation warnings Python hides outside
``__main__``) is part of what it prints. It takes about half a minute, most of it the demo.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lightning_sharded.cli import main as cli_main
from tests.distributed.launch import REPO, shell_env

DOC = REPO / "docs" / "cli.md"
#: The command that regenerates the sessions (printed when they differ).
UPDATE = "python -m tests.doc_sessions --update"
#: The folder the sessions show: the folder they ran in (a temporary one) is written as this one.
DOCS_HOME = "/home/me/run"
DEMO = "lightning-sharded demo"

#: What differs from run to run, by name: the pattern, and why it varies. Both the docs and the output
#: have each match replaced by ``<name>`` before they are compared.
PLACEHOLDERS: dict[str, tuple[re.Pattern[str], str]] = {
    "seconds": (
        re.compile(r"(?<=\bin )\d+\.\d+(?= ?s\b)|(?<=\()\d+\.\d+(?= s\))"),
        "durations (`-v` logs, the demo's phases) depend on the machine and its load",
    ),
}


def blocks(markdown: Path) -> list[tuple[str, str]]:
    """The fenced code blocks of a Markdown file: ``(language, text)``, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", markdown.read_text(), re.S | re.M)


def shell(command: str, cwd: Path, timeout: float = 300) -> tuple[int, str]:
    """``command`` in bash, in ``cwd``, as a user's shell runs it (the docs' environment)."""
    tmp = cwd.parent / "tmp"  # the examples' temporary folders, kept out of /tmp
    tmp.mkdir(exist_ok=True)
    proc = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env={**shell_env(), "TMPDIR": str(tmp)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout


def run_demo(folder: Path) -> str:
    """The README's main job, ``lightning-sharded demo``, in the empty ``folder``, as a user runs it (the
    console script, its defaults); what it printed."""
    code, out = shell(DEMO, folder, timeout=600)
    assert code == 0, out[-4000:]
    return out


def workspace(root: Path, demo_folder: Path) -> Path:
    """``root/run``: a copy of the folder the demo ran in, with the repository's examples beside it."""
    cwd = root / "run"
    shutil.copytree(demo_folder, cwd, symlinks=True)
    (cwd / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    return cwd


def shown(text: str, cwd: Path) -> str:
    """What the docs show for ``text`` printed in ``cwd``: the folder as :data:`DOCS_HOME`, lines without
    trailing spaces."""
    for folder in sorted({str(cwd.resolve()), str(cwd)}, key=len, reverse=True):
        text = text.replace(folder, DOCS_HOME)
    return "".join(line.rstrip() + "\n" for line in text.splitlines())


def canonical(text: str) -> str:
    """``text`` with every placeholder's match replaced by its name, for comparing."""
    for name, (pattern, _) in PLACEHOLDERS.items():
        text = pattern.sub(f"<{name}>", text)
    return text


#: The size of a set of files on disk (``10 files, 114.9 KiB``, ``files:       1, 14.2 KiB``, ``Wrote
#: full.ckpt (14.2 KiB)``): it holds ``torch.save`` archives (``meta.pt``, a full file), whose layout
#: torch changes by a few dozen bytes between releases (2.14.1 writes the demo's ``meta.pt`` 0.1 KiB
#: smaller than 2.13.0 and 2.15.0). Such a size may differ from the docs by one unit of its last printed
#: digit; tensor sizes, counts, checksums and everything else are compared exactly.
FILES_SIZE = re.compile(r"(?:\bfiles?(?::\s+\d+)?, |^Wrote \S+ \()(\d+\.\d) (?:B|KiB|MiB|GiB)\b", re.M)
FILES_SIZE_SLACK = 0.1


def same_output(shown: str, printed: str) -> bool:
    """Whether ``printed`` is what the docs show: equal up to the placeholders and up to
    :data:`FILES_SIZE_SLACK` in each :data:`FILES_SIZE` (same unit, same place in the text)."""
    shown, printed = canonical(shown), canonical(printed)
    if shown == printed:
        return True
    a, b = list(FILES_SIZE.finditer(shown)), list(FILES_SIZE.finditer(printed))
    if len(a) != len(b) or FILES_SIZE.sub("<size>", shown) != FILES_SIZE.sub("<size>", printed):
        return False
    for x, y in zip(a, b, strict=True):
        if x.group(0).rsplit(" ", 1)[1] != y.group(0).rsplit(" ", 1)[1]:  # the unit
            return False
        if abs(float(x.group(1)) - float(y.group(1))) > FILES_SIZE_SLACK + 1e-9:
            return False
    return True


@contextlib.contextmanager
def _terminal(cwd: Path) -> Iterator[None]:
    """In ``cwd``, with the docs' terminal width (argparse's help is as wide as the terminal)."""
    old_cwd, old_columns = os.getcwd(), os.environ.get("COLUMNS")
    os.chdir(cwd)
    os.environ["COLUMNS"] = "80"
    try:
        yield
    finally:
        os.chdir(old_cwd)
        if old_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old_columns


def _in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    buffer = io.StringIO()
    with (
        _terminal(cwd),
        warnings.catch_warnings(record=True) as caught,
        contextlib.redirect_stdout(buffer),
        contextlib.redirect_stderr(buffer),
    ):
        warnings.simplefilter("default")
        warnings.simplefilter("ignore", DeprecationWarning)  # hidden outside __main__
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        code = cli_main(argv)
    out = buffer.getvalue()
    for warning in caught:
        out += f"{warning.category.__name__}: {warning.message}\n"
    return code, out


def run_console_command(command: str, cwd: Path, demo_output: str = "") -> tuple[int, str]:
    """A ``$`` line of a session: ``lightning-sharded ...`` in this process, anything else in bash; the
    demo's line shows ``demo_output``, the run that made the folder."""
    echo_exit = command.endswith('; echo "exit $?"')
    rest = command.removesuffix('; echo "exit $?"')
    cut = re.search(r" \| (head|tail) -n (\d+)$", rest)
    rest = rest[: cut.start()] if cut else rest
    if rest == DEMO:
        code, out = 0, demo_output
    elif rest.startswith("lightning-sharded ") and not re.search(r"[;&|<>]", rest):
        code, out = _in_process(shlex.split(rest)[1:], cwd)
    else:
        code, out = shell(rest, cwd)
    if cut:
        lines = out.splitlines(keepends=True)
        n = int(cut.group(2))
        out = "".join(lines[:n] if cut.group(1) == "head" else lines[-n:])
    if echo_exit:
        out += f"exit {code}\n"
        code = 0
    return code, out


@dataclass
class Step:
    """One ``$`` line of a session and the lines the docs show below it."""

    command: str
    shown: str


_SESSION = re.compile(r"^```console\n(.*?)^```", re.S | re.M)


def sessions(text: str) -> list[list[Step]]:
    """The sessions of a Markdown text, in order."""
    found = []
    for match in _SESSION.finditer(text):
        steps: list[Step] = []
        for line in match.group(1).splitlines():
            if line.startswith("$ "):
                steps.append(Step(line[2:], ""))
            else:
                assert steps, f"a console block must start with a `$ ` line:\n{match.group(1)}"
                steps[-1].shown += line + "\n"
        found.append(steps)
    return found


def regenerate(cwd: Path, demo: tuple[Path, str], doc: Path = DOC) -> tuple[str, str]:
    """Run every session of ``doc`` in ``cwd``, a :func:`workspace` of the folder the demo ran in
    (``demo``: that folder, and what the demo printed): the doc as it should read, and the unified diff
    from the doc as it reads (empty when they agree).

    Raises:
        AssertionError: a command failed (a nonzero status without ``; echo "exit $?"``).
    """
    text = doc.read_text()
    demo_output = demo[1].replace(str(demo[0]), str(cwd))  # as if it had run in cwd
    rewritten = []
    for steps in sessions(text):
        lines = []
        for step in steps:
            code, out = run_console_command(step.command, cwd, demo_output)
            assert code == 0, f"$ {step.command} failed ({code}):\n{out}"
            printed = shown(out, cwd)
            keep = same_output(step.shown, printed)
            lines.append(f"$ {step.command}\n" + (step.shown if keep else printed))
        rewritten.append("".join(lines))
    parts = iter(rewritten)
    new = _SESSION.sub(lambda _: f"```console\n{next(parts)}```", text)
    rel = doc.relative_to(REPO) if doc.is_relative_to(REPO) else doc
    diff = difflib.unified_diff(
        text.splitlines(keepends=True), new.splitlines(keepends=True), f"{rel} (docs)", f"{rel} (printed)"
    )
    return new, "".join(diff)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.doc_sessions", description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="write what the commands print into the docs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="doc-sessions-") as tmp:
        demo = Path(tmp) / "demo"
        demo.mkdir()
        output = run_demo(demo)
        new, diff = regenerate(workspace(Path(tmp), demo), (demo, output))
    if not diff:
        print(f"{DOC.relative_to(REPO)}: every session prints what the docs show.")
        return 0
    if args.update:
        DOC.write_text(new)
        print(diff + f"Updated {DOC.relative_to(REPO)}.")
        return 0
    print(diff + f"{DOC.relative_to(REPO)} differs from what the commands print; `{UPDATE}` rewrites it.")
    return 1


if __name__ == "__main__":
    sys.exit(main())
