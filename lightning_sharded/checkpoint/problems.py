"""Bad files of a checkpoint, and the one error that names them (standard library only)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_sharded.checkpoint.errors import CheckpointError

__all__ = ["Problem", "damaged"]


@dataclass(frozen=True)
class Problem:
    """One bad file of a checkpoint.

    Attributes:
        path: The file, relative to the checkpoint directory (the file name for a full checkpoint).
        what: What is wrong with it, in words.
        rank: The rank that wrote it, when known.
        size: Its size in bytes, when it exists and that is what is wrong.
        needed: The size it should have at least (index) or exactly (manifest), when known.
    """

    path: str
    what: str
    rank: int | None = None
    size: int | None = None
    needed: int | None = None

    def __str__(self) -> str:
        who = f" (written by rank {self.rank})" if self.rank is not None else ""
        return f"{self.path!r}{who} {self.what}"


def damaged(path: object, problems: list[Problem], then: str = "") -> CheckpointError | None:
    """The error naming the first bad file of checkpoint ``path`` and the others (then ``then``, a
    sentence); ``None`` if none."""
    if not problems:
        return None
    first, others = problems[0], problems[1:]
    also = f" Also: {'; '.join(map(str, others))}." if others else ""
    return CheckpointError(
        f"The checkpoint {str(path)!r} is damaged: {first}.{also} Restore it from a copy, or load an earlier"
        " checkpoint." + (f" {then}" if then else "")
    )
