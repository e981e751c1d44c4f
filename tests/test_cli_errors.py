"""The CLI's failures: one line on stderr saying what and where, exit 1, no traceback (``--debug``
shows it); ``-v`` and ``--debug`` before and after the command; progress bars; ``demo --help``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_sharded import CheckpointError
from lightning_sharded.checkpoint import progress
from lightning_sharded.checkpoint.manifest import MANIFEST_NAME
from lightning_sharded.cli import main
from tests._compare import run_cli
from tests.distributed.launch import REPO
from tests.test_tools_safety import flip_a_bit_of_the_weight, unwritable
from tests.test_verify_errors import truncate

NOT_A_CHECKPOINT = (
    "The file 'notes.txt' is not a checkpoint: it is not a torch.save file (it starts with b'hell', not a zip"
    " archive or a pickle). Make sure the path points to either a directory with sharded checkpoint files"
    " (`.metadata`, `__<rank>_0.distcp` and `meta.pt`), or a single file with a full checkpoint."
)


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run a failing command: exit 1, nothing on stdout, one line on stderr; returns that line's message."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 1, (code, out, err)
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    prefix = f"lightning-sharded {argv[0]}: error: "
    assert err.startswith(prefix), err
    return err[len(prefix) : -1]


@pytest.fixture
def workdir(sharded_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory, holding ``ckpt`` (a 2-rank sharded checkpoint) and ``notes.txt``."""
    root = sharded_ckpt.parent
    monkeypatch.chdir(root)
    (root / "notes.txt").write_text("hello, not a checkpoint\n")
    return root


def test_not_a_checkpoint_is_one_message_in_every_command(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["inspect", "notes.txt"], ["verify", "notes.txt"], ["consolidate", "notes.txt", "out.ckpt"]):
        assert one_line_error(capsys, *argv) == NOT_A_CHECKPOINT
    (workdir / "empty").mkdir()
    for command in ("inspect", "verify"):
        assert one_line_error(capsys, command, "empty").startswith("The directory 'empty' is empty")


def damage(root: Path, how: str) -> None:
    ckpt = root / "ckpt"
    if how == "missing":
        (ckpt / "__1_0.distcp").unlink()
    elif how == "truncated":
        truncate(ckpt / "__1_0.distcp", 100)
    elif how == "corrupted":
        flip_a_bit_of_the_weight(ckpt)
    elif how == "nonexistent":
        shutil.rmtree(ckpt)
    elif how == "metadata":
        (ckpt / MANIFEST_NAME).unlink()
        (ckpt / ".metadata").write_bytes(b"garbage")


CASES: list[tuple[str, list[str], Callable[[Path], None] | str | None, str]] = [
    ("inspect", ["inspect", "ckpt"], "missing", "is damaged: '__1_0.distcp' (written by rank 1) is missing."),
    (
        "inspect",
        ["inspect", "ckpt"],
        "truncated",
        "'__1_0.distcp' (written by rank 1) is truncated: 100 bytes",
    ),
    (
        "inspect",
        ["inspect", "ckpt"],
        "metadata",
        "Could not read the DCP index 'ckpt/.metadata': the file `.metadata` of the sharded",
    ),
    (
        "verify",
        ["verify", "ckpt"],
        "corrupted",
        "'__1_0.distcp' (written by rank 1) is corrupted: its crc32 is",
    ),
    (
        "verify",
        ["verify", "ckpt"],
        "nonexistent",
        "There is no checkpoint at 'ckpt': the path does not exist (no file, directory or object",
    ),
    (
        "consolidate",
        ["consolidate", "ckpt", "out.ckpt"],
        "corrupted",
        "'__1_0.distcp' (written by rank 1) is",
    ),
    ("consolidate", ["consolidate", "ckpt", "ckpt", "--force"], None, "is the source checkpoint 'ckpt'"),
    (
        "consolidate",
        ["consolidate", "ckpt", "notes.txt"],
        None,
        "'notes.txt' exists (a file). To replace it, pass --force",
    ),
    ("consolidate", ["consolidate", "ckpt", "notes.txt/x.ckpt"], None, "is a file, not a directory"),
    (
        "consolidate",
        ["consolidate", "ckpt", "."],
        None,
        "'.' is the source checkpoint 'ckpt', lies inside it or holds it",
    ),
]


@pytest.mark.parametrize(
    ("command", "argv", "how", "says"), CASES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)]
)
def test_expected_failures_are_one_line(
    workdir: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    argv: list[str],
    how: str | None,
    says: str,
) -> None:
    if isinstance(how, str):
        damage(workdir, how)
    before = sorted(p.name for p in workdir.iterdir())
    assert says in one_line_error(capsys, *argv)
    assert sorted(p.name for p in workdir.iterdir()) == before  # nothing written, not even hidden files


def test_a_directory_destination_and_an_unwritable_one(
    workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (workdir / "runs").mkdir()
    (workdir / "runs" / "notes.txt").write_text("keep me")
    message = one_line_error(capsys, "consolidate", "ckpt", "runs", "--force")
    assert message.startswith(
        "The destination 'runs' is a directory that is not a checkpoint (it holds notes.txt)"
    )
    assert "end the destination with a slash ('runs/')" in message
    target = unwritable(tmp_path) / "x.ckpt"
    message = one_line_error(capsys, "consolidate", "ckpt", str(target))
    assert message.startswith(f"Cannot write the checkpoint file '{target}': ")
    assert "enforce fail" not in message and "Nothing was written there" in message


def test_no_verify_and_force(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_a_bit_of_the_weight(workdir / "ckpt")
    code, out, err = run_cli(capsys, "consolidate", "--no-verify", "ckpt", "out.ckpt")
    assert (code, err) == (0, "") and out.startswith("Wrote out.ckpt (")
    code, out, _ = run_cli(capsys, "consolidate", "ckpt", "out.ckpt", "--no-verify", "--force")
    assert code == 0 and out.startswith("Wrote out.ckpt (")


def test_force_that_does_not_apply_says_so(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (workdir / "notes").mkdir()
    (workdir / "notes" / "todo.txt").write_text("keep me")
    without = one_line_error(capsys, "consolidate", "ckpt", "notes")
    assert "is never replaced" in without and "--force" not in without
    forced = one_line_error(capsys, "consolidate", "ckpt", "notes", "--force")
    assert forced.startswith(without) and forced.endswith(
        " --force (overwrite=True) does not apply here: it replaces a file, an empty directory or a"
        " checkpoint, never a directory of other files."
    )
    assert (workdir / "notes" / "todo.txt").read_text() == "keep me"
    source = one_line_error(capsys, "consolidate", "ckpt", "ckpt/inside.ckpt", "--force")
    assert "would destroy the only copy" in source and "never the source being read" in source


def test_an_unexpected_error_is_one_line_too(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_sharded.checkpoint import tools

    def boom(path: object, **kwargs: object) -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(tools, "inspect_checkpoint", boom)
    code, _, err = run_cli(capsys, "inspect", "ckpt")
    assert code == 1
    assert err == (
        "lightning-sharded inspect: unexpected error: RuntimeError: boom second line (this is a bug in"
        " lightning_sharded: run again with --debug for the traceback, and report it)\n"
    )
    with pytest.raises(RuntimeError, match="boom"):
        main(["inspect", "ckpt", "--debug"])


def test_debug_before_and_after_the_command(workdir: Path) -> None:
    for argv in (["--debug", "verify", "notes.txt"], ["verify", "notes.txt", "--debug"]):
        with pytest.raises(CheckpointError, match="is not a checkpoint"):
            main(argv)


def test_verbose_before_and_after_the_command(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["-v", "verify", "ckpt"], ["verify", "ckpt", "-v"], ["verify", "-v", "ckpt"]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 0 and out.startswith("OK: ckpt (sharded, 5 files, ")  # the manifest counts
        assert err.startswith("Verified ckpt (sharded, 5 files, ") and " KiB) in " in err, err
    code, _, err = run_cli(capsys, "inspect", "ckpt", "--verbose")
    assert code == 0 and err.startswith("Inspected ckpt (8 entries) in ")
    code, _, err = run_cli(capsys, "consolidate", "-v", "ckpt", "full.ckpt")
    assert code == 0 and err.startswith("Consolidated ckpt into full.ckpt (456 B of tensors) in ")
    code, _, err = run_cli(capsys, "verify", "ckpt")
    assert (code, err) == (0, "")  # quiet without -v


def test_progress_bars(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "PROGRESS_MIN_BYTES", 1)  # every checkpoint is "large"
    code, _, err = run_cli(capsys, "verify", "ckpt")
    assert code == 0 and "verifying ckpt: 100%" in err and " MiB [" in err, err
    code, _, err = run_cli(capsys, "consolidate", "ckpt", "full.ckpt")
    assert code == 0 and "consolidating ckpt: 100%" in err, err
    code, _, err = run_cli(capsys, "verify", "full.ckpt")
    assert code == 0 and "verifying full.ckpt: 100%" in err, err
    for argv in (["verify", "ckpt", "--no-progress"], ["consolidate", "ckpt", "f2.ckpt", "--no-progress"]):
        code, _, err = run_cli(capsys, *argv)
        assert (code, err) == (0, ""), err


def test_the_console_script_shows_no_traceback(workdir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_sharded.cli", "inspect", "notes.txt"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == f"lightning-sharded inspect: error: {NOT_A_CHECKPOINT}\n"


def test_demo_help(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["demo", "--help"], ["-v", "demo", "--help"]):
        code, out, _ = run_cli(capsys, *argv)
        assert code == 0 and out.startswith("usage: lightning-sharded demo [-h]")
        flat = " ".join(out.split())
        assert "--strategy {fsdp,model-parallel} fsdp: ShardedFSDPStrategy (FSDP1, default)" in flat
        assert "ShardedModelParallelStrategy (FSDP2, DTensor parameters)" in flat
        assert "--state-dict-type {sharded,full} sharded: a directory of shards" in flat
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "--debug" in out and "--verbose" in out
    code, out, _ = run_cli(capsys, "consolidate", "--help")
    assert code == 0 and "--force" in out and "--no-verify" in out and "--debug" in out


def test_demo_writes_only_into_its_own_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "saved.pt").write_text("someone's file")
    code, _, err = run_cli(capsys, "demo", "--output", str(tmp_path / "mine"))
    assert code == 2
    assert (
        "is a folder the demo did not create, and not empty: the demo writes only into its own folder" in err
    )
    assert err.rstrip().endswith("Choose another with --output, or pass --force to write into it.")
    assert (tmp_path / "mine" / "saved.pt").read_text() == "someone's file"
