"""Every pickle of a checkpoint, read without unpickling it: what a safe load would refuse.

``verify`` never runs code from a checkpoint, with or without ``--unsafe-unpickle``: the globals of
each ``torch.save`` archive (a full file, ``meta.pt``, the per-rank state files, DCP's non-tensor
entries inside the shard files; only their ``data.pkl``) are read statically, and DCP's ``.metadata``
with the restricted unpickler, which refuses before building anything else.
"""

from __future__ import annotations

from typing import Any

from lightning_sharded.checkpoint import names, unpickling
from lightning_sharded.checkpoint.backends import Backend, Location, basename, join
from lightning_sharded.checkpoint.dcp_index import object_archives, read_index
from lightning_sharded.checkpoint.detect import CheckpointKind
from lightning_sharded.checkpoint.problems import Problem, damaged

__all__ = ["check_pickles", "refused_pickles"]


def refused_pickles(backend: Backend, root: Location, kind: CheckpointKind) -> list[tuple[str, str]]:
    """Each pickle of the checkpoint at ``root`` that a safe load would refuse, as ``(what, names)``.

    Runs nothing from the files; each shard file is opened once.

    Raises:
        CheckpointError: a pickle that cannot be read at all (not a ``torch.save`` archive, cut short):
            the checkpoint is damaged, and the message names the file, the entry, its byte and rank.
    """

    def whole(file: Location, rel: str, what: str, rank: int | None = None) -> list[tuple[str, str]]:
        with backend.open_file(file) as f:
            found = _globals_or_raise(root, f, rel, "its pickle", rank)
        return [(what, ", ".join(found))] if found else []

    if kind is CheckpointKind.FULL:
        return whole(root, basename(root), f"The checkpoint file {str(root)!r}")
    try:
        metadata = read_index(backend, root, weights_only=True, standins=True)
    except unpickling.RefusedPickleError as err:
        return [(err.what, err.name)]
    refused: list[tuple[str, str]] = []
    for fqn, rel, offset, archive in object_archives(backend, root, metadata):
        rank = names.shard_rank(rel)
        found = _globals_or_raise(root, archive, rel, f"its entry {fqn!r} at byte {offset}", rank)
        if found:
            who = f", written by rank {rank}" if rank is not None else ""
            what = f"The entry {fqn!r} of the sharded checkpoint {str(root)!r} (in {rel!r}{who})"
            refused.append((what, ", ".join(found)))
    state_files = (
        f"{names.RANK_STATE_DIR}/{n}" for n in backend.list_files(join(root, names.RANK_STATE_DIR))
    )
    for rel in sorted(state_files):
        if (m := names.RANK_STATE_FILE.match(rel)) is not None:
            rank = int(m.group(1))
            what = f"The per-rank state {rel!r} of the sharded checkpoint {str(root)!r} (rank {rank})"
            refused += whole(join(root, *rel.split("/")), rel, what, rank)
    meta = join(root, names.LIGHTNING_METADATA)
    if backend.exists(meta):
        refused += whole(meta, names.LIGHTNING_METADATA, f"The Lightning metadata {str(meta)!r}")
    return refused


def _globals_or_raise(root: Location, source: Any, rel: str, part: str, rank: int | None = None) -> list[str]:
    """:func:`unpickling.unsafe_globals` of ``source``; a pickle that cannot be read is damage."""
    try:
        return unpickling.unsafe_globals(source)
    except Exception as err:  # not a torch.save archive, cut short...
        detail = str(err).splitlines()[0] if str(err) else ""
        problem = Problem(rel, f"is corrupted: {part} cannot be read ({type(err).__name__}: {detail})", rank)
        error = damaged(root, [problem])
        assert error is not None
        raise error from None


def check_pickles(
    backend: Backend, root: Location, kind: CheckpointKind, weights_only: bool | None
) -> list[str]:
    """Check every pickle of a checkpoint without unpickling it: with ``weights_only`` (``True`` or
    ``None``) the first that a safe load would refuse is raised (a ``RefusedPickleError``); with ``False``
    (a file the user trusts) each is described in the notes returned. A pickle that cannot be read at
    all is damage (a ``CheckpointError``)."""
    found = refused_pickles(backend, root, kind)
    if found and unpickling.resolve_weights_only(weights_only):
        raise unpickling.RefusedPickleError(*found[0])
    return [
        f"{what} holds {held}, which a safe load refuses: it opens only with {unpickling.UNSAFE_FLAG}"
        " (weights_only=False), running code from the file"
        for what, held in found
    ]
