"""Which ranks did not come: marks of the checkpoint's steps in the job's store, read when a collective fails.

A collective that fails says nothing of who is missing: gloo reports "Connection closed by peer" at
once when a rank died, and "Timed out waiting 300000ms for recv" after the group's timeout when one
hangs. So at each of the checkpoint's collectives (:mod:`~lightning_sharded.checkpoint.collective`)
and DCP's, every rank records in the job's key-value store (the one ``torch.distributed`` was started
with; without a process group, no marks and no names) how many steps it has reached on that group,
and the step's name: one small ``set`` per step. Every rank runs the same steps in the same order, so
the ranks whose mark is behind are those that did not come. A rank that gives up marks so, with the
ranks it found missing, so that a rank which was waiting on it names the same ranks instead of it.
When the store itself does not answer, the process that serves it (rank 0, unless a launcher's agent
does, as torchrun's) is gone, and that is what the error says.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_sharded.checkpoint.errors import RanksLost

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["GRACE_S", "LINGER_S", "RanksLost", "gave_up", "lost", "reach", "set_timeout"]

#: Seconds a rank whose collective failed waits for the marks of the ranks behind it (which may be
#: giving up at the same moment, or just arriving): a rank that died never comes, so this is the most
#: a failure's error is delayed by.
GRACE_S = 1.0
#: Seconds rank 0, which serves the job's store in most launches (Lightning's, ``init_method="tcp://"``,
#: ``env://``; not torchrun's, whose agent serves it), waits after giving up for the other survivors to
#: read the marks and give up too, before its error (and its exit) takes the store away; it stops
#: waiting as soon as every rank that came has given up.
LINGER_S = 3.0
_PREFIX = "lightning_sharded/reached"


@dataclass
class _Group:
    """This process's marks on one process group."""

    name: str
    members: list[int]  # global ranks, in group order
    me: int  # this process's global rank
    count: int = 0
    step: str = ""
    timeout: float | None = None  # what it was made with (set_timeout), for the messages of its failures
    gave_up: bool = False  # a collective on it failed here (see lost): not to be used again


_lock = threading.Lock()
_groups: dict[str, _Group] = {}
_store_state: dict[int, Any] = {}  # id of the default process group -> its store, or None


def _store() -> Any:
    import torch.distributed as dist

    world = id(dist.group.WORLD)  # a new default group (re-initialized) has a new store
    with _lock:
        if world not in _store_state:
            try:
                from lightning_sharded._compat import default_store

                _store_state[world] = default_store()
            except Exception:  # no store here (no process group, a launcher without one)
                _store_state[world] = None
        return _store_state[world]


def _group(group: ProcessGroup | None) -> _Group:
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    name = str(getattr(pg, "group_name", "world"))  # the same on every rank: the store's keys use it
    local = _local_name(pg)
    with _lock:
        known = _groups.get(local)
        if known is None:
            members = dist.get_process_group_ranks(pg)
            known = _groups[local] = _Group(name, list(members), dist.get_rank())
        return known


def _local_name(pg: Any) -> str:
    """This process's name of a group: its name and the default group's identity (a world that is
    initialized again reuses the group names)."""
    import torch.distributed as dist

    return f"{getattr(pg, 'group_name', 'world')}-{id(dist.group.WORLD)}"


def _key(group: _Group, rank: int) -> str:
    return f"{_PREFIX}/{group.name}/{rank}"


def set_timeout(group: ProcessGroup, seconds: float) -> None:
    """Remember the timeout ``group`` was made with, for the messages of its failures."""
    _group(group).timeout = seconds


def _put(key: str, value: list[Any]) -> None:
    store = _store()
    if store is None:
        return
    try:
        store.set(key, json.dumps(value))
    except Exception:  # the store went away (its process died) or does not store: no marks from now on
        import torch.distributed as dist

        with _lock:
            _store_state[id(dist.group.WORLD)] = None


def reach(group: ProcessGroup | None, step: str) -> None:
    """Mark that this rank reached ``step`` of the checkpoint's collectives on ``group``.

    Every rank must call it at the same points, in the same order (as it calls the collectives).
    """
    state = _group(group)
    state.count += 1
    state.step = step
    _put(_key(state, state.me), [state.count, step])


def gave_up(group: ProcessGroup) -> bool:
    """Whether a checkpoint collective on ``group`` failed in this process (:func:`lost`): a gloo group
    whose collective timed out or lost a peer is not used again."""
    with _lock:
        known = _groups.get(_local_name(group))
    return known is not None and known.gave_up


def _read(state: _Group) -> dict[int, list[Any]] | None:
    """Every member's mark (``[count, step]`` or ``[count, step, missing]``); ``None`` if the store
    does not answer."""
    store = _store()
    if store is None:
        return None
    marks: dict[int, list[Any]] = {}
    try:
        for rank in state.members:
            key = _key(state, rank)
            if store.check([key]):
                marks[rank] = json.loads(store.get(key))
    except Exception:
        return None
    return marks


def lost(group: ProcessGroup | None, err: BaseException) -> RanksLost:
    """The error of a checkpoint collective on ``group`` that failed with ``err``, naming the ranks
    that did not reach this rank's current step; marks this rank as having given up."""
    state = _group(group)
    state.gave_up = True
    count, step = state.count, state.step
    others = [r for r in state.members if r != state.me]

    def behind(marks: dict[int, list[Any]]) -> list[int]:  # neither at this step nor given up
        return [r for r in others if r not in marks or (marks[r][0] < count and len(marks[r]) < 3)]

    marks = _poll(state, GRACE_S, lambda marks: not behind(marks))
    cause = _first_line(err)
    within = f" within {state.timeout:g} s" if state.timeout is not None else ""
    if marks is None:
        if state.me == 0:
            names: list[int] = []
            message = f"the job's store does not answer, and a collective failed ({cause})"
        else:
            names = [0]
            message = (
                f"rank 0 most likely died: a collective failed ({cause}) and the job's store, which rank 0"
                " serves (unless a launcher's agent does), does not answer"
            )
        return RanksLost(f"{message}. Check the log of rank 0 and of the machine it ran on.", names)
    given_up = {r: m for r, m in marks.items() if r != state.me and len(m) >= 3}
    missing = set(behind(marks))
    for mark in given_up.values():
        missing |= {int(r) for r in mark[2] if int(r) != state.me}
    missing -= set(given_up)
    names = sorted(missing)
    _put(_key(state, state.me), [count, step, names])
    if state.me == 0:  # every other rank that came has given up (read the marks), or LINGER_S passed
        _poll(
            state, LINGER_S, lambda marks: all(len(marks.get(r, [])) >= 3 for r in others if r not in names)
        )
    if not names:
        return RanksLost(
            f"a collective at the checkpoint's step {step!r} failed ({cause}) although every rank had reached"
            " it: a rank most likely died or lost its connection during it. Check the other ranks' logs.",
            [],
        )
    last = "; ".join(
        f"rank {r} last reached {marks[r][1]!r}" if r in marks else f"rank {r} reached none" for r in names
    )
    shown = ", ".join(map(str, names))
    return RanksLost(
        f"rank(s) {shown} did not reach the checkpoint's step {step!r}{within} (dead, hung, or slower than"
        f" the timeout; {last}; the collective failed with {cause}). Check their logs. If they are only slow"
        " (a large write), raise the strategy's `checkpoint_timeout` (seconds).",
        names,
    )


def _poll(
    state: _Group, seconds: float, done: Callable[[dict[int, list[Any]]], bool]
) -> dict[int, list[Any]] | None:
    """The marks, read until ``done(marks)``, the store does not answer, or ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    while True:
        marks = _read(state)
        if marks is None or done(marks) or time.monotonic() >= deadline:
            return marks
        time.sleep(0.05)


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    text = lines[0] if lines else ""
    # gloo's messages start with the source location of the check that failed: keep what it says
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    text = text.split(". This is typically", 1)[0]  # gloo's advice after its message
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(err).__name__}: {text}"
