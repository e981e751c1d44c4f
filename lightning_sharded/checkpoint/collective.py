"""Decisions every rank shares: taken once and broadcast, or checked everywhere and agreed on.

A check that picks a code path (what is at the path, is a file there, is it whole) may see other
things on other ranks (an NFS attribute cache, a transient read error); run alone on each rank, one
rank would raise or branch while the others wait in a collective until the timeout. So a check runs
through :func:`decide` (rank 0 runs it, every rank returns its result or raises its error) or
:func:`agree` (every rank runs it, for what each rank must see itself; any failure is raised on every
rank); without an initialized process group both simply run it.

Every collective here (and DCP's, given :func:`ranks`' group) runs on the group it is given, or inside
:func:`scope` on the scope's group, such as a :func:`bounded_group` whose collectives fail after the
strategy's ``checkpoint_timeout`` instead of the process group's 30 minutes. One that fails raises a
:class:`~lightning_sharded.checkpoint.errors.RanksLost` naming the ranks that did not reach it
(:mod:`~lightning_sharded.checkpoint.presence`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from lightning_sharded.checkpoint import presence
from lightning_sharded.checkpoint.errors import (
    CheckpointError,
    MissingCheckpointError,
    OptimizerCountError,
    StorageError,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "Ranks",
    "agree",
    "all_gather",
    "all_true",
    "bounded_group",
    "broadcast",
    "decide",
    "describe",
    "gather",
    "marking",
    "ranks",
    "scope",
    "watched",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in a process group (``group``; ``None``: the default group, or none):
    its ``rank`` there, the group's ``world_size`` (1 without a process group) and ``src``, the global
    rank of the group's rank 0 (what collectives name as source)."""

    rank: int
    world_size: int
    src: int
    group: ProcessGroup | None


_scoped: contextvars.ContextVar[ProcessGroup | None] = contextvars.ContextVar(
    "lightning_sharded_checkpoint_group", default=None
)


@contextlib.contextmanager
def scope(group: ProcessGroup | None) -> Iterator[None]:
    """Inside, in this thread, the checkpoint's collectives that are given no group run on ``group``
    (``None``: the default group, as outside)."""
    token = _scoped.set(group)
    try:
        yield
    finally:
        _scoped.reset(token)


#: The bounded groups of this process: (default group, role, timeout) -> group. Every ``Trainer``'s
#: strategy and async saver reuse them: a gloo group holds 3 threads and about 5 descriptors on each
#: rank for as long as the process lives, and a process that runs many Trainers (fit then test, a
#: sweep) made 2 more per Trainer.
_bounded: dict[tuple[int, bool, float | None], ProcessGroup] = {}


def bounded_group(timeout_s: float | None, *, background: bool = False) -> ProcessGroup | None:
    """A gloo group of every rank whose collectives fail after ``timeout_s`` seconds (the process
    group's default when ``None``); ``None`` without a process group or with one rank. Collective over
    the default group: every rank calls it, in the same order.

    Made once per process (and default group) for each timeout, and reused while it serves: one for the
    training thread's checkpoint collectives, one (``background``) for the async saves' thread, so the
    two never share a group. A group whose collective failed here (:func:`presence.gave_up`: gloo does
    not recover from a timeout or a lost peer) is replaced, and every rank agrees on that first.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    key = (id(dist.group.WORLD), background, timeout_s)
    group = _bounded.get(key)
    if group is not None:
        world = Ranks(dist.get_rank(), dist.get_world_size(), 0, None)
        if all_true(_serves(group), world, "bounded group check"):
            return group
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None  # None: the default
    group = _bounded[key] = cast("ProcessGroup", dist.new_group(backend="gloo", timeout=timeout))
    if timeout_s is not None:
        presence.set_timeout(group, timeout_s)
    return group


def _serves(group: ProcessGroup) -> bool:
    """Whether ``group`` is still registered (no ``destroy_process_group``) and none of its collectives
    failed in this process."""
    import torch.distributed as dist

    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return False
    return not presence.gave_up(group)


def ranks(group: ProcessGroup | None = None, *, alone: bool = False) -> Ranks:
    """This process's rank, world size and source rank in ``group`` (the :func:`scope`'s group, else
    the default group, when ``None``); with ``alone``, this process by itself (rank 0 of 1), whatever
    process group is up."""
    if alone:  # before torch's import: the offline tools may need none
        return Ranks(0, 1, 0, None)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return Ranks(0, 1, 0, group)
    if group is None:
        group = _scoped.get()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    return Ranks(dist.get_rank(group), dist.get_world_size(group), src, group)


@contextlib.contextmanager
def watched(where: Ranks, step: str) -> Iterator[None]:
    """Mark ``step`` (see :mod:`~lightning_sharded.checkpoint.presence`), then run the block, whose
    collectives' failure (a ``RuntimeError`` of the backend) becomes a ``RanksLost`` naming the ranks
    that did not reach this rank's last step. Nothing happens with one rank."""
    if where.world_size == 1:
        yield
        return
    presence.reach(where.group, step)
    try:
        yield
    except CheckpointError:
        raise
    except RuntimeError as err:  # gloo and NCCL errors (DistError and its kinds are RuntimeErrors)
        raise presence.lost(where.group, err) from err


def marking(where: Ranks, step: str) -> Callable[..., Any]:
    """A hook for :class:`~lightning_sharded.checkpoint.backends.observed.Observed` that marks ``step``
    each time the method it runs returns or raises (a step of DCP's between its own collectives, such
    as a storage writer's ``write_data``); with one rank it marks nothing."""

    def around(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        finally:
            if where.world_size > 1:
                presence.reach(where.group, step)

    return around


def broadcast(obj: Any, where: Ranks, step: str = "broadcast") -> Any:
    """Rank 0's ``obj`` on every rank of ``where.group`` (collective); ``step`` names it in errors."""
    if where.world_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    with watched(where, step):
        dist.broadcast_object_list(box, src=where.src, group=where.group)
    return box[0]


def all_gather(obj: Any, where: Ranks, step: str = "all-gather") -> list[Any]:
    """Every rank's ``obj``, in rank order (collective); ``step`` names it in errors."""
    if where.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * where.world_size
    with watched(where, step):
        dist.all_gather_object(out, obj, group=where.group)
    return out


def all_true(flag: bool, where: Ranks, step: str = "all-reduce") -> bool:
    """Whether ``flag`` is true on every rank of ``where.group`` (collective); ``step`` names it in errors.

    One all-reduce of one number, where :func:`all_gather` of a flag pickles it and takes two
    collectives (sizes, then bytes). The number lives where torch's object collectives put theirs:
    in host memory on a gloo group, on the current CUDA device on an NCCL one.
    """
    if where.world_size == 1:
        return flag
    import torch
    import torch.distributed as dist

    from lightning_sharded._compat import object_collective_device

    box = torch.tensor([int(flag)], dtype=torch.int32, device=object_collective_device(where.group))
    with watched(where, step):
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=where.group)
    return bool(box.item())


def gather(obj: Any, where: Ranks, step: str = "gather") -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank 0; ``None`` on the others (collective).

    For what only rank 0 needs (the manifest entries of every rank): each rank receives nothing, where
    :func:`all_gather` would send every rank all N objects. ``step`` names it in errors.
    """
    if where.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] | None = [None] * where.world_size if where.rank == 0 else None
    with watched(where, step):
        dist.gather_object(obj, out, dst=where.src, group=where.group)
    return out


def describe(err: BaseException) -> str:
    """``"TypeName: message"`` of an exception, for reports across ranks."""
    return f"{type(err).__name__}: {err}"


#: Exceptions a check may raise that travel between ranks as themselves; anything else becomes a
#: CheckpointError that names it. A StorageError keeps its cause's errno and file name.
_SHARED_ERRORS: dict[str, type[Exception]] = {
    "CheckpointError": CheckpointError,
    "StorageError": StorageError,
    "FileNotFoundError": FileNotFoundError,
    "IsADirectoryError": IsADirectoryError,
    "OptimizerCountError": OptimizerCountError,
    "MissingCheckpointError": MissingCheckpointError,
}
_Packed = tuple[str, str, "int | None", "str | None"]


def _pack(err: Exception) -> _Packed:
    if isinstance(err, StorageError):
        return ("StorageError", str(err), err.errno, err.filename)
    if type(err).__name__ in _SHARED_ERRORS:
        return (type(err).__name__, str(err), None, None)
    return ("CheckpointError", describe(err), None, None)


def _unpack(packed: _Packed, suffix: str = "") -> Exception:
    name, message, number, filename = packed
    if name == "StorageError":
        return StorageError(message + suffix, number, filename)
    return _SHARED_ERRORS[name](message + suffix)


def _run(check: Callable[[], T]) -> tuple[bool, Any]:
    """``(True, what check returned)``, or ``(False, its error packed)``: what a rank shares."""
    try:
        return True, check()
    except Exception as err:
        return False, _pack(err)


def _result(outcome: tuple[bool, Any]) -> Any:
    """The value of a shared :func:`_run` outcome, or its error raised."""
    ok, value = outcome
    if not ok:
        raise _unpack(value)
    return value


def decide(check: Callable[[], T], group: ProcessGroup | None = None, step: str = "decision") -> T:
    """Run ``check`` on rank 0 and give every rank its result, or raise its error on every rank.

    Collective over ``group``. An ``Exception`` of rank 0 is raised on every rank as the same type (one
    of :data:`_SHARED_ERRORS`, else a ``CheckpointError`` naming it) with the same message. The result
    must be picklable. ``step`` names the collective in the error of a rank that did not come.
    """
    where = ranks(group)
    if where.world_size == 1:
        return check()
    outcome = _run(check) if where.rank == 0 else None
    return _result(broadcast(outcome, where, step))  # type: ignore[no-any-return]


def decide_each(
    check: Callable[[int], list[T]], group: ProcessGroup | None = None, step: str = "decision"
) -> T:
    """Run ``check(world_size)`` on rank 0, which returns one value per rank, and give each rank its own;
    or raise rank 0's error on every rank (as :func:`decide`).

    Collective over ``group`` (a scatter): a rank receives its value only, where :func:`decide` would
    send every rank all of them (what rank 0 knows of every rank's files).
    """
    where = ranks(group)
    if where.world_size == 1:
        return check(1)[0]
    import torch.distributed as dist

    outcomes: list[tuple[bool, Any]] | None = None
    if where.rank == 0:

        def each() -> list[tuple[bool, Any]]:  # inside _run: a failure here reaches every rank too
            values = list(check(where.world_size))
            if len(values) != where.world_size:
                raise ValueError(f"{len(values)} values for {where.world_size} ranks")
            return [(True, value) for value in values]

        ok, result = _run(each)
        outcomes = result if ok else [(False, result)] * where.world_size
    box: list[Any] = [None]
    with watched(where, step):
        dist.scatter_object_list(box, outcomes, src=where.src, group=where.group)
    return _result(box[0])  # type: ignore[no-any-return]


def agree(check: Callable[[], T], group: ProcessGroup | None = None, step: str = "agreement") -> T:
    """Run ``check`` on every rank; if it failed on any, raise the lowest failing rank's error everywhere.

    Collective over ``group``. When only some ranks failed, the message says which rank saw it.
    Returns this rank's result. ``step`` names the collective in the error of a rank that did not come.
    """
    where = ranks(group)
    if where.world_size == 1:
        return check()
    ok, value = _run(check)
    failures = [(r, f) for r, f in enumerate(all_gather(None if ok else value, where, step)) if f is not None]
    if not failures:
        return value  # type: ignore[no-any-return]
    first_rank, first = failures[0]
    if len(failures) == where.world_size:
        raise _unpack(first)
    seen = ", ".join(str(r) for r, _ in failures)
    raise _unpack(first, f" (seen by rank(s) {seen} of {where.world_size}; rank {first_rank}'s report)")
