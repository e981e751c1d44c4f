"""The doc-session runner itself (``tests/doc_sessions.py``): exact comparison, named placeholders only,
and an update that rewrites what changed and keeps what only a placeholder tells apart."""

from __future__ import annotations

from pathlib import Path

from tests.doc_sessions import DOCS_HOME, PLACEHOLDERS, canonical, regenerate

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
