"""Decisions every rank shares: taken once and broadcast, or checked everywhere and agreed on.

A check that picks a code path (what is at the path, is a file there, is it whole) may see other
things on other ranks (an NFS attribute cache, a transient read error). Run alone on each rank, one
rank would raise or branch while the others enter a collective and wait for it until the timeout.
So a check runs through one of two functions here:

- :func:`decide`: rank 0 runs it; its result, or its error, is broadcast; every rank returns the same
  value or raises the same error (for what is at a path: every rank then takes the same branch);
- :func:`agree`: every rank runs it (for what each rank must see itself, such as the files it reads);
  the outcomes are gathered; if any rank failed, every rank raises the same error, that of the lowest
  failing rank, naming it.

Without an initialized process group both simply run the function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from lightning_sharded.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Ranks", "agree", "all_gather", "broadcast", "decide", "describe", "gather", "ranks"]

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in a process group.

    Attributes:
        rank: Its rank in the group.
        world_size: The group's size (1 without a process group).
        src: The global rank of the group's rank 0 (what collectives name as source).
        group: The group (``None``: the default group, or none at all).
    """

    rank: int
    world_size: int
    src: int
    group: ProcessGroup | None


def ranks(group: ProcessGroup | None = None, *, alone: bool = False) -> Ranks:
    """This process's rank, world size and source rank in ``group`` (the default group when ``None``);
    with ``alone``, this process by itself (rank 0 of 1), whatever process group is up."""
    import torch.distributed as dist

    if alone or not (dist.is_available() and dist.is_initialized()):
        return Ranks(0, 1, 0, None if alone else group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    return Ranks(dist.get_rank(group), dist.get_world_size(group), src, group)


def broadcast(obj: Any, where: Ranks) -> Any:
    """Rank 0's ``obj`` on every rank of ``where.group`` (collective)."""
    if where.world_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=where.src, group=where.group)
    return box[0]


def all_gather(obj: Any, where: Ranks) -> list[Any]:
    """Every rank's ``obj``, in rank order (collective)."""
    if where.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * where.world_size
    dist.all_gather_object(out, obj, group=where.group)
    return out


def gather(obj: Any, where: Ranks) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank 0; ``None`` on the others (collective).

    For what only rank 0 needs (the manifest entries of every rank): each rank receives nothing, where
    :func:`all_gather` would send every rank all N objects.
    """
    if where.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] | None = [None] * where.world_size if where.rank == 0 else None
    dist.gather_object(obj, out, dst=where.src, group=where.group)
    return out


def describe(err: BaseException) -> str:
    """``"TypeName: message"`` of an exception, for reports across ranks."""
    return f"{type(err).__name__}: {err}"


# Exceptions a check may raise that travel between ranks as themselves; anything else becomes a
# CheckpointError that names it.
_SHARED_ERRORS: dict[str, type[Exception]] = {
    "CheckpointError": CheckpointError,
    "FileNotFoundError": FileNotFoundError,
    "IsADirectoryError": IsADirectoryError,
}


def _pack(err: Exception) -> tuple[str, str]:
    name = type(err).__name__
    return (name, str(err)) if name in _SHARED_ERRORS else ("CheckpointError", describe(err))


def _unpack(packed: tuple[str, str], suffix: str = "") -> Exception:
    name, message = packed
    return _SHARED_ERRORS[name](message + suffix)


def decide(check: Callable[[], T], group: ProcessGroup | None = None) -> T:
    """Run ``check`` on rank 0 and give every rank its result, or raise its error on every rank.

    Collective over ``group``. An ``Exception`` of rank 0 is raised on every rank as the same type
    (``CheckpointError``, ``FileNotFoundError``, ``IsADirectoryError``; any other type as a
    ``CheckpointError`` naming it) with the same message. The result must be picklable.
    """
    where = ranks(group)
    if where.world_size == 1:
        return check()
    outcome: tuple[bool, Any] = (True, None)
    if where.rank == 0:
        try:
            outcome = (True, check())
        except Exception as err:
            outcome = (False, _pack(err))
    ok, value = broadcast(outcome, where)
    if not ok:
        raise _unpack(value)
    return value  # type: ignore[no-any-return]


def agree(check: Callable[[], T], group: ProcessGroup | None = None) -> T:
    """Run ``check`` on every rank; if it failed on any, raise the lowest failing rank's error everywhere.

    Collective over ``group``. When only some ranks failed, the message says which rank saw it.
    Returns this rank's result.
    """
    where = ranks(group)
    if where.world_size == 1:
        return check()
    result: Any = None
    failure: tuple[str, str] | None = None
    try:
        result = check()
    except Exception as err:
        failure = _pack(err)
    failures = [(r, f) for r, f in enumerate(all_gather(failure, where)) if f is not None]
    if not failures:
        return result  # type: ignore[no-any-return]
    first_rank, first = failures[0]
    if len(failures) == where.world_size:
        raise _unpack(first)
    seen = ", ".join(str(r) for r, _ in failures)
    raise _unpack(first, f" (seen by rank(s) {seen} of {where.world_size}; rank {first_rank}'s report)")
