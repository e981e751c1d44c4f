"""Every documented command and snippet runs as the docs show it, with no extra argument: README.md,
docs/quickstart.md, docs/cli.md and the run commands in the examples' docstrings.

The code blocks are read from the Markdown (and the docstrings) here, so docs and test cannot drift:

- ``bash`` blocks: each line is a command, run by bash in a folder where the README's main job
  (``lightning-sharded demo``) has run; a ``# ...`` line after a command is a line of its output
  (``...`` in it stands for any characters);
- ``python`` blocks: one whose first line is ``# NAME.py`` is saved as that file (a later command
  runs it); any other runs as a script, and a ``text`` block right after it is its whole output,
  compared exactly;
- ``console`` blocks (docs/cli.md): sessions, run by ``tests/doc_sessions.py`` and compared exactly,
  numbers included; the only placeholders are those named in ``doc_sessions.PLACEHOLDERS``. When an
  output changes on purpose, ``python -m tests.doc_sessions --update`` rewrites the sessions.

No documented command may print a message of :data:`AVOIDABLE`. Not run here: ``pip install`` lines
(they built this environment) and ``bash .ci/run`` (it runs this).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import REPO
from tests.doc_sessions import DEMO, UPDATE, blocks, canonical, regenerate, sessions, shell, shown, workspace

NOT_RUN = ("pip install ", "bash .ci/run")
#: Messages of stock Lightning that a documented snippet causes when it leaves out an argument
#: Lightning asks for (``trainer.save_checkpoint(path)`` without ``weights_only``): none may show.
AVOIDABLE = ("`weights_only` was not set",)


def normalize(text: str, cwd: Path) -> str:
    """``text`` as the docs show it, placeholders replaced (``doc_sessions.PLACEHOLDERS``)."""
    return canonical(shown(text, cwd))


def no_avoidable_message(command: str, out: str) -> None:
    for message in AVOIDABLE:
        assert message not in out, f"{command!r} printed {message!r} (see AVOIDABLE):\n{out[-4000:]}"


def printed(expected: str, out: str) -> bool:
    """Whether a line of ``out`` is ``expected``, where ``...`` in it stands for any characters."""
    pattern = re.compile(".*".join(map(re.escape, expected.split("..."))))
    return any(pattern.fullmatch(line) for line in out.splitlines())


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
        no_avoidable_message(command, out)
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
        no_avoidable_message(f"snippet {i}", out)
        if i + 1 < len(doc) and doc[i + 1][0] == "text":
            expected = doc[i + 1][1]
            assert normalize(expected, cwd) == normalize(out, cwd), (
                f"the docs show:\n{expected}it printed:\n{out}"
            )


KEEP_OR_PIN_TORCH = '$(python -c "import torch" 2>/dev/null || echo torch==2.13.0)'


def test_readme(tmp_path: Path, demo_run: tuple[Path, str]) -> None:
    readme = blocks(REPO / "README.md")
    first = readme[0][1]
    main_job = next(line for line in first.splitlines() if line.startswith("pip install"))
    assert re.match(r"^pip install .*lightning-sharded demo$", main_job), main_job
    assert main_job.split(" && ")[-1] == DEMO  # what demo_run ran
    # It keeps the torch the venv has (any supported one) and asks for 2.13.0 only where there is none.
    assert main_job.replace(KEEP_OR_PIN_TORCH, "").count("torch") == 0, main_job
    assert KEEP_OR_PIN_TORCH in main_job, main_job
    assert "bash .ci/run" in first.splitlines()
    run_python_blocks(readme, workspace(tmp_path, demo_run[0]))


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
    cwd = workspace(tmp_path_factory.mktemp("quickstart"), demo_run[0])
    run_python_blocks(doc[:load], cwd)
    return cwd


def test_quickstart_trains_saves_and_resumes(quickstart_run: Path) -> None:
    assert (quickstart_run / "quickstart.ckpt" / ".metadata").is_file()


def test_quickstart_loads_in_a_plain_process(quickstart_run: Path) -> None:
    doc, load = quickstart()
    run_python_blocks(doc[load:], quickstart_run)


def test_cli_doc(tmp_path: Path, demo_run: tuple[Path, str]) -> None:
    """docs/cli.md's sessions print exactly what the docs show (``tests/doc_sessions.py``)."""
    steps = [step for session in sessions((REPO / "docs" / "cli.md").read_text()) for step in session]
    assert len(steps) >= 20 and any(step.command == DEMO for step in steps)
    _, diff = regenerate(workspace(tmp_path, demo_run[0]), demo_run)
    assert not diff, (
        "docs/cli.md's sessions differ from what the commands print (- the docs, + printed). If the"
        f" change is meant, run `{UPDATE}` and commit docs/cli.md.\n{diff}"
    )


#: Examples that need TorchRec: run in ``.ci/run``'s TorchRec venv (marker ``torchrec``), where a missing
#: TorchRec fails the run; skipped elsewhere. They need no demo folder.
TORCHREC_EXAMPLES = ("torchrec_dlrm.py",)


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
@pytest.mark.parametrize(
    "example", sorted(p.name for p in (REPO / "examples").glob("*.py") if p.name not in TORCHREC_EXAMPLES)
)
def test_example_runs_as_documented(tmp_path: Path, demo_run: tuple[Path, str], example: str) -> None:
    command, prints = example_runs(REPO / "examples" / example)
    cwd = workspace(tmp_path, demo_run[0])
    for expected in prints:  # one run per quoted output: "run it again and it prints ..."
        code, out = shell(command, cwd)
        assert code == 0, f"{command!r} failed ({code}):\n{out[-4000:]}"
        assert printed(expected, out), f"{command!r} did not print {expected!r}:\n{out[-4000:]}"


@pytest.mark.slow
@pytest.mark.torchrec
@pytest.mark.skipif(
    importlib.util.find_spec("torchrec") is None, reason="needs TorchRec (.ci/run's TorchRec venv)"
)
@pytest.mark.parametrize("example", TORCHREC_EXAMPLES)
def test_torchrec_example_runs_as_documented(tmp_path: Path, example: str) -> None:
    command, prints = example_runs(REPO / "examples" / example)
    cwd = tmp_path / "run"
    cwd.mkdir()
    (cwd / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    for expected in prints:
        code, out = shell(command, cwd)
        assert code == 0, f"{command!r} failed ({code}):\n{out[-4000:]}"
        assert printed(expected, out), f"{command!r} did not print {expected!r}:\n{out[-4000:]}"
