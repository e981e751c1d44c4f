"""Where an offline tool may write: the rules that keep it from destroying what it did not create.

A tool that writes a new file from a checkpoint (``consolidate``) asks :func:`output_file` first: never
the source, inside it, or a directory that holds it (symlinks and an interrupted save's ``.old``
version count as the source); what is already there only with ``overwrite=True`` (``--force``), and
a directory that is not a checkpoint never; ``DST/`` means inside ``DST``. The rules as the CLI gives
them: ``docs/cli.md``, ``consolidate``. The write itself then goes through the atomic commit, and
:func:`write_error` words a failed one for the destination.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lightning_sharded.checkpoint import names
from lightning_sharded.checkpoint.backends import (
    Location,
    backend_for,
    basename,
    join,
    local_path,
    location,
    resolve,
)
from lightning_sharded.checkpoint.errors import first_line

__all__ = ["output_file", "write_error"]

_FORCE = "To replace it, pass --force (overwrite=True in Python), or choose another destination."


def _force_ignored(overwrite: bool, why: str) -> str:
    """The sentence saying that ``--force`` was given and does not apply (``why``), or ``""``."""
    return f" --force (overwrite=True) does not apply here: {why}." if overwrite else ""


def output_file(
    src: str | os.PathLike[str], real_src: Location, dst: str | os.PathLike[str], *, overwrite: bool
) -> Location:
    """The file to write for destination ``dst`` (as the user gave it; a trailing ``/`` means inside that
    directory), after the rules above; changes nothing on disk. ``src``: the source checkpoint as the
    user gave it; ``real_src``: what is read for it (``src`` itself, or the version an interrupted save
    left); ``overwrite``: replace a file, an empty directory or a sharded checkpoint at the output.

    Raises:
        ValueError: the output is the source, inside it, or holds it.
        FileExistsError: something is at the output and ``overwrite`` is ``False``.
        IsADirectoryError: the output is a non-empty directory that is not a checkpoint.
        NotADirectoryError: the output's folder is a file.
    """
    text = os.fspath(dst)
    inside = text.endswith(("/", os.sep)) and text.rstrip("/" + os.sep) != ""
    out = location(text)
    if inside:
        out = join(out, basename(location(os.fspath(src))))
    on_disk = local_path(out)
    if on_disk is None:
        _check_url(str(out), src, real_src, overwrite)
    else:
        _check_local(on_disk, Path(os.fspath(src)), real_src, overwrite)
    return out


def _is_source(out: str, source: str, overwrite: bool) -> ValueError:
    return ValueError(
        f"The destination {out!r} is the source checkpoint {source!r}, lies inside it or holds it: writing"
        " there would destroy the only copy. Choose a destination outside the source."
        + _force_ignored(overwrite, "it replaces a previous output, never the source being read")
    )


def _check_local(out: Path, src: Path, real_src: Location, overwrite: bool) -> None:
    """``out``, ``src`` as the user spelled them (relative paths too); messages use those spellings."""
    real = local_path(real_src)
    sources = {src, real} if real is not None else {src}
    for source in sorted(sources, key=str):
        a, b = Path(os.path.realpath(out)), Path(os.path.realpath(source))  # symlinks resolved
        if a == b or a.is_relative_to(b) or b.is_relative_to(a):
            raise _is_source(str(out), str(source), overwrite)
    parent = Path(os.path.abspath(out)).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(
            f"Cannot write {str(out)!r}: {str(parent)!r} is a file, not a directory. Choose another"
            " destination."
        )
    existing = resolve(out)  # an interrupted save's `.old` version counts as being there
    if not os.path.lexists(existing):
        return
    if existing.is_dir() and not existing.is_symlink():
        members = os.listdir(existing)
        if members and not any(names.is_checkpoint_member(n) for n in members):
            listed = ", ".join(sorted(members)[:5]) + (", ..." if len(members) > 5 else "")
            raise IsADirectoryError(
                f"The destination {str(out)!r} is a directory that is not a checkpoint (it holds {listed}):"
                f" it is never replaced. To write inside it, end the destination with a slash"
                f" ({str(out) + os.sep!r}), or choose another destination."
                + _force_ignored(
                    overwrite,
                    "it replaces a file, an empty directory or a checkpoint, never a directory of other"
                    " files",
                )
            )
        what = "an empty directory" if not members else "a sharded checkpoint directory"
    else:
        what = "a file"
    if not overwrite:
        raise FileExistsError(f"The destination {str(out)!r} exists ({what}). {_FORCE}")


def _check_url(out: str, src: str | os.PathLike[str], real_src: Location, overwrite: bool) -> None:
    for source in sorted({str(location(os.fspath(src))), str(real_src)}):
        if out == source or out.startswith(source + "/") or source.startswith(out + "/"):
            raise _is_source(out, source, overwrite)
    backend = backend_for(out)
    if not backend.exists(out):
        return
    if not backend.is_file(out):
        raise IsADirectoryError(
            f"The destination {out!r} is a prefix with objects under it (a sharded checkpoint, or other"
            " data): it is never replaced by one object. To write inside it, end the destination with a"
            " slash, or choose another destination."
            + _force_ignored(overwrite, "it replaces one object, never a prefix with objects under it")
        )
    if not overwrite:
        raise FileExistsError(f"The destination {out!r} exists (an object). {_FORCE}")


def write_error(out: Location, err: Exception) -> OSError:
    """An error writing a tool's output ``out``, as one ``OSError`` that names the destination, not the
    temporary file it was writing."""
    if isinstance(err, OSError) and str(out) in str(err):
        return err
    if isinstance(err, OSError):
        why = err.strerror or str(err)
    else:  # "[enforce fail at inline_container.cc:747] . open file failed with strerror: ..."
        why = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", first_line(err).partition(": ")[2])
    error = (type(err) if isinstance(err, OSError) else OSError)(
        f"Cannot write the checkpoint file {str(out)!r}: {why}. Nothing was written there; check that its"
        " directory is writable and has space."
    )
    error.errno = getattr(err, "errno", None)
    return error
