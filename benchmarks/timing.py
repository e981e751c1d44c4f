"""The one way the benchmarks patch code they measure: for a block, and always undone.

:func:`patched` replaces an attribute for the duration of a ``with`` block and puts the original back
however the block ends (an attribute the owner did not hold itself, an inherited method or an
instance's method, is removed again, so the lookup finds the original). :func:`timer` is the one
timer: it patches a function so that each call reports its seconds. :class:`PhaseTimers` times many
functions by label, inclusive and exclusive (``benchmarks.phases``: the resume's profile); the restore
timer of the resumes, the recording of a resume's reads (``benchmarks.faithful``) and the counters of
``benchmarks.scale`` are built on the same two.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

_MISSING = object()


@contextlib.contextmanager
def patched(owner: Any, attr: str, replacement: Any) -> Iterator[None]:
    """``owner.attr`` is ``replacement`` inside the block; the original is restored on exit."""
    own = owner.__dict__ if isinstance(owner, type) else getattr(owner, "__dict__", {})
    original = own.get(attr, _MISSING)
    setattr(owner, attr, replacement)
    try:
        yield
    finally:
        if original is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)


def timer(
    owner: Any,
    attr: str,
    done: Callable[[float], None],
    before: Callable[[], None] | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Patch ``owner.attr`` (a function, method, classmethod or staticmethod) so that each call runs
    ``before()`` first (untimed) and passes its seconds to ``done``, raised or not."""
    found = inspect.getattr_static(owner, attr)
    if not isinstance(owner, type):
        raw = getattr(owner, attr)  # a module's function, or an instance's bound method
    elif isinstance(found, classmethod | staticmethod):
        raw = found.__func__
    else:
        raw = found  # a plain function: the wrapper, set on the class, is bound as it was

    @functools.wraps(raw)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        start = time.perf_counter()
        try:
            return raw(*args, **kwargs)
        finally:
            done(time.perf_counter() - start)

    replacement: Any = timed
    if isinstance(found, classmethod):
        replacement = classmethod(timed)
    elif isinstance(found, staticmethod):
        replacement = staticmethod(timed)
    return patched(owner, attr, replacement)


def resolve(dotted: str) -> Any:
    """The object a dotted name points to (module, then attributes), or ``None`` if there is none."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj
    return None


@dataclass
class _Frame:
    """A timed call in progress: whether it runs inside a root call, and its timed callees' seconds."""

    inside: bool
    callees: float = 0.0


class PhaseTimers:
    """Seconds and call counts per label, for ``(owner, attribute, label)`` triples.

    ``owner`` is a dotted name (a class is timed where it defines the attribute, so subclasses count
    too; a missing one is skipped) or an object (a class is timed on itself, inherited or not).
    :meth:`installed` patches them all for a block. Three tallies:

    - :attr:`seconds` and :attr:`calls`: inclusive seconds (a call's callees included), every thread;
    - :attr:`own`: exclusive seconds (a call's own, less its timed callees'), on the thread that
      installed the timers, of calls inside a call of a label in ``roots``, the roots' own included:
      they add up to the roots' inclusive seconds, so a profile made of them accounts for all of it;
    - :attr:`threads`: inclusive seconds of the calls made on other threads (a reader's threads),
      which overlap the installing thread's calls and are not part of :attr:`own`.
    """

    def __init__(self, roots: Iterable[str] = ()) -> None:
        self.roots = frozenset(roots)
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.own: dict[str, float] = {}
        self.threads: dict[str, float] = {}
        self._lock = threading.Lock()
        self._frames = threading.local()
        self._home: int | None = None

    def reset(self) -> None:
        with self._lock:
            self.seconds, self.calls, self.own, self.threads = {}, {}, {}, {}

    def _stack(self) -> list[_Frame]:
        stack: list[_Frame] | None = getattr(self._frames, "stack", None)
        if stack is None:
            stack = self._frames.stack = []
        return stack

    def _add(self, label: str) -> tuple[Callable[[], None], Callable[[float], None]]:
        root = label in self.roots

        def enter() -> None:
            stack = self._stack()
            stack.append(_Frame(root or (bool(stack) and stack[-1].inside)))

        def add(seconds: float) -> None:
            stack = self._stack()
            frame = stack.pop()
            if stack:
                stack[-1].callees += seconds
            home = threading.get_ident() == self._home
            with self._lock:
                self.seconds[label] = self.seconds.get(label, 0.0) + seconds
                self.calls[label] = self.calls.get(label, 0) + 1
                if not home:
                    self.threads[label] = self.threads.get(label, 0.0) + seconds
                elif frame.inside:
                    self.own[label] = self.own.get(label, 0.0) + seconds - frame.callees

        return enter, add

    @contextlib.contextmanager
    def installed(self, phases: Iterable[tuple[Any, str, str]]) -> Iterator[None]:
        self._home = threading.get_ident()
        with contextlib.ExitStack() as stack:
            for where, attr, label in phases:
                owner = resolve(where) if isinstance(where, str) else where
                if owner is None or not hasattr(owner, attr):
                    continue
                if isinstance(where, str) and isinstance(owner, type) and attr not in owner.__dict__:
                    owner = next(base for base in owner.__mro__ if attr in base.__dict__)
                enter, add = self._add(label)
                stack.enter_context(timer(owner, attr, add, before=enter))
            yield
