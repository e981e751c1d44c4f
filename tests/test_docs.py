"""Every documented command and snippet runs as the docs show it, with no extra argument: README.md,
docs/quickstart.md, docs/cli.md and the run commands in the examples' docstrings.

The code blocks are read from the Markdown (and the docstrings) here, so docs and test cannot drift:

- ``bash`` blocks: each line is a command, run by bash in a folder where the README's main job
  (``lightning-sharded demo``) has run; a ``# ...`` line after a command is a line of its output;
- ``python`` blocks: one whose first line is ``# NAME.py`` is saved as that file (a later command
  runs it); any other runs as a script, and a ``text`` block right after it is its whole output;
- ``console`` blocks (docs/cli.md): ``$ COMMAND`` lines and the output below each, compared line by
  line. Numbers and checksums may differ from run to run, so digits and 8-digit hex words are
  compared as placeholders, and runs of spaces as one; a line ``...`` stands for any lines.
  ``lightning-sharded`` commands of the console blocks run in this process (``main``, the console
  script's entry point), with ``; echo "exit $?"`` and ``| head -n N`` / ``| tail -n N`` applied to
  their output; the README's run through the installed console script.

Not run here: ``pip install`` lines (they built this environment) and ``bash .ci/run`` (it runs this).
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sharded.cli import main
from tests.distributed.launch import REPO, shell_env

#: The folder the docs' sessions show: the test's own folder is written as this one.
DOCS_HOME = "/home/me/run"
NOT_RUN = ("pip install ", "bash .ci/run")
DEMO = "lightning-sharded demo"


def blocks(markdown: Path) -> list[tuple[str, str]]:
    """The fenced code blocks of a Markdown file: ``(language, text)``, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", markdown.read_text(), re.S | re.M)


def shell(command: str, cwd: Path, timeout: float = 300) -> tuple[int, str]:
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


def normalize(text: str, cwd: Path) -> list[str]:
    text = text.replace(str(cwd), DOCS_HOME)
    lines = []
    for line in text.splitlines():
        line = re.sub(r"\b[0-9a-f]{8}\b", "<hex>", line)
        line = re.sub(r"\d+(\.\d+)?", "<n>", line)
        lines.append(" ".join(line.split()))
    return lines


def matches(expected: list[str], actual: list[str]) -> bool:
    """``expected`` equals ``actual``, where a line ``...`` in ``expected`` stands for any lines."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


def printed(expected: str, out: str) -> bool:
    """Whether a line of ``out`` is ``expected``, where ``...`` in it stands for any characters."""
    pattern = re.compile(".*".join(map(re.escape, expected.split("..."))))
    return any(pattern.fullmatch(line) for line in out.splitlines())


def workspace(tmp_path: Path, demo_run: tuple[Path, str]) -> Path:
    """A folder ``run`` as the main job leaves it, with the repository's examples beside it."""
    cwd = tmp_path / "run"
    shutil.copytree(demo_run[0], cwd, symlinks=True)
    (cwd / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    return cwd


def run_bash_block(text: str, cwd: Path) -> None:
    """Each command; the ``# ...`` lines after it are lines of its output (see :func:`printed`)."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# ") and steps:
            steps[-1][1].append(line[2:])
        elif line.strip() and not line.startswith("#"):
            steps.append((line, []))
    for command, outputs in steps:
        parts = [p for p in command.split(" && ") if not p.startswith(NOT_RUN)]
        if not parts or parts == [DEMO]:
            continue  # set-up commands; the main job ran once already (see demo_run)
        code, out = shell(" && ".join(parts), cwd)
        assert code == 0, f"{command!r} failed ({code}):\n{out[-4000:]}"
        for expected in outputs:
            assert printed(expected, out), f"{command!r} did not print {expected!r}:\n{out[-4000:]}"


def run_python_blocks(doc: list[tuple[str, str]], cwd: Path) -> None:
    """Save the named blocks, then run the others in order; a ``text`` block after one is its output."""
    for language, text in doc:
        if language == "python" and (name := re.match(r"# (\w+\.py)\n", text)):
            (cwd / name.group(1)).write_text(text)
    for i, (language, text) in enumerate(doc):
        if language == "bash":
            run_bash_block(text, cwd)
        if language != "python" or re.match(r"# \w+\.py\n", text):
            continue
        (cwd / "snippet.py").write_text(text)
        code, out = shell(f"{shlex.quote(sys.executable)} snippet.py", cwd)
        assert code == 0, f"snippet {i} failed ({code}):\n{text}\n{out[-4000:]}"
        if i + 1 < len(doc) and doc[i + 1][0] == "text":
            assert matches(normalize(doc[i + 1][1], cwd), normalize(out, cwd)), out


def test_readme(tmp_path: Path, demo_run: tuple[Path, str]) -> None:
    readme = blocks(REPO / "README.md")
    first = readme[0][1]
    main_job = next(line for line in first.splitlines() if line.startswith("pip install"))
    assert re.match(r"^pip install .*lightning-sharded demo$", main_job), main_job
    assert main_job.split(" && ")[-1] == DEMO  # what demo_run ran
    assert "bash .ci/run" in first.splitlines()
    run_python_blocks(readme, workspace(tmp_path, demo_run))


def quickstart() -> tuple[list[tuple[str, str]], int]:
    """The quickstart's blocks, and where the part that loads in a plain process starts."""
    doc = blocks(REPO / "docs" / "quickstart.md")
    assert any(language == "python" and text.startswith("# quickstart.py\n") for language, text in doc)
    load = next(
        i
        for i, (lang, text) in enumerate(doc)
        if lang == "python" and text.startswith("from quickstart import")
    )
    return doc, load


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory: pytest.TempPathFactory, demo_run: tuple[Path, str]) -> Path:
    """The quickstart up to its plain-process load: the script trains, saves and resumes."""
    doc, load = quickstart()
    cwd = workspace(tmp_path_factory.mktemp("quickstart"), demo_run)
    run_python_blocks(doc[:load], cwd)
    return cwd


def test_quickstart_trains_saves_and_resumes(quickstart_run: Path) -> None:
    assert (quickstart_run / "quickstart.ckpt" / ".metadata").is_file()


def test_quickstart_loads_in_a_plain_process(quickstart_run: Path) -> None:
    doc, load = quickstart()
    run_python_blocks(doc[load:], quickstart_run)


def run_console_command(command: str, cwd: Path) -> tuple[int, str]:
    """A ``$`` line of a console block: ``lightning-sharded ...`` in this process, anything else in bash."""
    echo_exit = command.endswith('; echo "exit $?"')
    rest = command.removesuffix('; echo "exit $?"')
    cut = re.search(r" \| (head|tail) -n (\d+)$", rest)
    rest = rest[: cut.start()] if cut else rest
    if rest.startswith("lightning-sharded ") and not re.search(r"[;&|<>]", rest):
        buffer = io.StringIO()
        old_cwd = os.getcwd()
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
                code = main(shlex.split(rest)[1:])
        finally:
            os.chdir(old_cwd)
        out = buffer.getvalue()
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


def test_cli_doc(tmp_path: Path, demo_run: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # argparse's help is as wide as the terminal
    cwd = workspace(tmp_path, demo_run)
    sessions = [text for language, text in blocks(REPO / "docs" / "cli.md") if language == "console"]
    assert len(sessions) >= 5
    commands = 0
    for session in sessions:
        steps: list[tuple[str, list[str]]] = []
        for line in session.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                steps[-1][1].append(line)
        for command, expected in steps:
            code, out = run_console_command(command, cwd)
            assert code == 0, f"$ {command} failed ({code}):\n{out}"
            assert matches(normalize("\n".join(expected), cwd), normalize(out, cwd)), (
                f"$ {command}\n--- the docs show:\n" + "\n".join(expected) + f"\n--- it printed:\n{out}"
            )
            commands += 1
    assert commands >= 15


def example_runs(script: Path) -> tuple[str, list[str]]:
    """The run command of an example's docstring, and what each run prints (the ``It prints`` quotes)."""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    commands = [line.strip() for line in doc.splitlines() if line.startswith("    ") and "examples/" in line]
    assert len(commands) == 1, f"{script.name}: one indented run command expected, found {commands}"
    flat = " ".join(doc.split())
    prints = re.findall(r"prints ``(.+?)``", flat)
    assert prints, f"{script.name}: its docstring says nothing of what it prints"
    return commands[0], prints


@pytest.mark.slow
@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.py")))
def test_example_runs_as_documented(tmp_path: Path, demo_run: tuple[Path, str], example: str) -> None:
    command, prints = example_runs(REPO / "examples" / example)
    cwd = workspace(tmp_path, demo_run)
    for expected in prints:  # one run per quoted output: "run it again and it prints ..."
        code, out = shell(command, cwd)
        assert code == 0, f"{command!r} failed ({code}):\n{out[-4000:]}"
        assert printed(expected, out), f"{command!r} did not print {expected!r}:\n{out[-4000:]}"
