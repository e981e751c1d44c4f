"""The doc-session runner itself (``tests/doc_sessions.py``): exact comparison, named placeholders only,
and an update that rewrites what changed and keeps what only a placeholder tells apart."""

from __future__ import annotations

from pathlib import Path

from tests.doc_sessions import DOCS_HOME, PLACEHOLDERS, canonical, regenerate, same_output

DOC = """Some prose.

```console
$ echo "3 files, 14.2 KiB"
3 files, 14.2 KiB
$ python -c "import time; print(f'Consolidated a into b in {time.time() % 1 + 1:.2f}s')"
Consolidated a into b in 0.29s
$ echo "exit status"; false; echo "exit $?"
exit status
exit 1
```

More prose.

```console
$ pwd
/home/me/run
$ echo "4 files"
5 files
```
"""


def test_only_durations_are_placeholders() -> None:
    assert set(PLACEHOLDERS) == {"seconds"}
    assert (
        canonical("Consolidated x in 0.29s; trained (4.7 s)")
        == "Consolidated x in <seconds>s; trained (<seconds> s)"
    )
    for exact in ("14.2 KiB", "7 files", "the manifest says 19290", "crc32 is 73acb954", "global step 4"):
        assert canonical(exact) == exact


def test_a_number_that_differs_is_caught_and_rewritten(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(DOC)
    cwd = tmp_path / "run"
    cwd.mkdir()
    new, diff = regenerate(cwd, (cwd, ""), doc)
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert changed == ["-5 files", "+4 files"]  # the duration keeps what the docs show; pwd is DOCS_HOME
    assert new == DOC.replace("5 files", "4 files") and DOCS_HOME in new
    doc.write_text(new)
    assert regenerate(cwd, (cwd, ""), doc)[1] == ""


def test_a_size_of_files_may_differ_by_one_unit_of_its_last_digit_and_nothing_else_may() -> None:
    """torch.save's archives differ by a few bytes between torch releases (meta.pt 0.1 KiB smaller on
    torch 2.14.1): the size of a set of files tolerates one unit of its last printed digit; tensor sizes,
    counts and larger differences do not."""
    shown = "files:       10, 114.9 KiB\nOK: ckpt (sharded, 10 files, 114.9 KiB; checksums match)\n"
    assert same_output(shown, shown.replace("114.9", "114.8"))
    assert same_output("Wrote full.ckpt (14.2 KiB): load it", "Wrote full.ckpt (14.3 KiB): load it")
    assert not same_output(shown, shown.replace("114.9", "114.7"))  # two units
    assert not same_output(shown, shown.replace("114.9 KiB", "114.9 MiB"))
    assert not same_output(shown, shown.replace("10 files", "11 files"))
    assert not same_output(
        "entries:     29: 17 tensors, 7.0 KiB; 12 values", "entries:     29: 17 tensors, 7.1 KiB; 12 values"
    )
    assert not same_output(
        "model.head.weight  (8, 32)  torch.float32  1.0 KiB",
        "model.head.weight  (8, 32)  torch.float32  1.1 KiB",
    )
