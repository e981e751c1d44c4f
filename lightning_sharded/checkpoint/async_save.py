"""Checkpoints written in the background: stage into host memory, return, write and publish later.

:class:`AsyncSaver` is what a strategy with ``async_save=True`` holds (what users see:
``docs/async-save.md``): one save in flight per process (the staging buffers,
:class:`~lightning_sharded.checkpoint.staging.StagingBuffers`, are reused; saves publish in order),
written by one background thread whose collectives use a gloo group of the background writes, so they
never interleave with training's. A background error is raised, as a
:class:`~lightning_sharded.CheckpointError` naming the path, by the next :meth:`~AsyncSaver.wait`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from lightning_sharded.checkpoint import collective
from lightning_sharded.checkpoint.backends import Location, absolute
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.failures import background_failed
from lightning_sharded.checkpoint.staging import StagingBuffers

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["AsyncSaver", "wait_for_saves_to"]

log = logging.getLogger(__name__)

#: ``write(path, staged_state, group)``: writes (and publishes) the staged state at ``path``.
WriteFn = Callable[[Location, Any, "ProcessGroup | None"], None]

#: The savers of this process with a save in flight (not yet waited for).
_SAVING: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()


def wait_for_saves_to(path: Location) -> None:
    """Wait until every save in flight to ``path`` in this process, whichever saver started it, is
    published: the checkpoint a new ``Trainer`` loads may be the one its predecessor's
    ``trainer.save_checkpoint(path)`` still writes in the background.

    Raises:
        CheckpointError: that save failed (the message names the path); what is at ``path`` is not it.
    """
    key = str(absolute(path))
    for saver in list(_SAVING):
        in_flight = saver.in_flight
        if in_flight is not None and str(absolute(in_flight)) == key:
            saver.wait()


class AsyncSaver:
    """Background checkpoint writes with one save in flight at a time; see the module docstring.

    Args:
        name: shown in the background thread's name and in log messages.
        timeout_s: seconds a background save's collectives wait for the other ranks before failing
            with an error that names the missing ones (``None``: the process group's default timeout).
    """

    def __init__(self, name: str = "lightning-sharded", timeout_s: float | None = None) -> None:
        self._name = name
        self._timeout_s = timeout_s
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[BaseException | None] | None = None
        self._path: Location | None = None
        self._group: ProcessGroup | None = None
        self._group_made = False
        self._lock = threading.Lock()
        self.buffers = StagingBuffers()
        # Called in the training thread once the save in flight is published (never if it fails).
        self._on_published: list[Callable[[], None]] = []
        # The deferred copies of the save in flight, and the optimizer step hooks that wait for them.
        self._staging: Future[None] | None = None
        self._copier: ThreadPoolExecutor | None = None
        self._step_hooks: list[Any] = []
        # Optimizers whose step() this saver follows (id -> steps in progress, the hooks that count).
        self._in_step: dict[int, int] = {}
        self._tracking: list[Any] = []
        #: Seconds the last :meth:`save` blocked its caller (waiting for the previous save excluded).
        self.last_stall_s = 0.0
        # Work queued after the saves (removals of older checkpoints): (what, its future).
        self._chores: list[tuple[str, Future[None]]] = []
        #: Where the last save that failed was to be published (set by the :meth:`wait` that raised its
        #: error): what is at that path is not that save.
        self.failed: Location | None = None

    @property
    def writing(self) -> bool:
        """Whether a save is in flight and not finished yet (never blocks)."""
        future = self._future
        return future is not None and not future.done()

    @property
    def in_flight(self) -> Location | None:
        """The path of the save in flight (possibly finished but not yet waited for), or ``None``."""
        return self._path if self._future is not None else None

    def on_published(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the save in flight is published (from :meth:`wait` or :meth:`poll`, in
        their thread), now if none is; a failed save drops it (what it would report was never published)."""
        if self._future is None:
            callback()
        else:
            self._on_published.append(callback)

    def poll(self) -> None:
        """Run the :meth:`on_published` callbacks if the save in flight has been published; never blocks
        and never raises the save's error (the next :meth:`wait` does)."""
        self._drop_step_hooks(unless_pending=True)
        future = self._future
        if future is not None and future.done() and future.result() is None:
            self._run_published()

    def _run_published(self) -> None:
        callbacks, self._on_published = self._on_published, []
        for callback in callbacks:
            callback()

    def group(self) -> ProcessGroup | None:
        """The process group of the background writes (:func:`~.collective.bounded_group`, ``timeout_s``),
        made on first use: collective the first time, as :meth:`save` is."""
        if not self._group_made:
            self._group = collective.bounded_group(self._timeout_s, background=True)
            self._group_made = True
        return self._group

    def save(
        self,
        path: Location,
        state: Any,
        write: WriteFn,
        *,
        defer: Sequence[tuple[Any, ...]] = (),
        optimizers: Sequence[torch.optim.Optimizer] = (),
        watch: Sequence[torch.Tensor] = (),
    ) -> None:
        """Stage ``state`` into host memory, then run ``write(path, staged, group)`` in the background.

        Collective: every rank calls it with its own shards, in the same order. Returns once the state
        is copied (but see ``defer``); the model and optimizer may change right after.

        Args:
            defer: key paths into ``state`` of tensors that only the ``optimizers``' ``step()`` changes
                (their ``state``): their host copies are made after this returns, in a thread of the
                caller's priority, and the next ``step()`` of every optimizer waits for them before it
                changes its state (a step pre-hook; after the step's closure where it has one: see
                :func:`_waiting_step`). Ignored unless every optimizer has ``register_step_pre_hook``.
            optimizers: the optimizers whose ``step()`` waits for the deferred copies.
            watch: tensors that nothing but those ``step()`` calls may change while the deferred copies
                run (the optimizers' parameters and state): their in-place version counters are read
                when the state is staged and again once the copies are done; a change fails the save
                (its copies may mix old and new values) instead of publishing it.

        Raises:
            CheckpointError: the previous background save failed (this save is then not started).
        """
        self.wait()
        # The other savers' saves in flight too (their errors are their own wait's): the background
        # writes of all of them run on one process group (collective.bounded_group), so one at a time, in
        # the order every rank started them (an earlier Trainer's save_checkpoint may still be writing).
        for other in list(_SAVING):
            future = other._future
            if other is not self and future is not None:
                concurrent.futures.wait([future])
        group = self.group()
        start = time.perf_counter()
        # Deferred only when every optimizer is followed (`follow`) and not inside its step() now: a save
        # from inside a training step, whose update comes right after, copies everything at once (a
        # step that raised leaves its count up: that optimizer's state is then always copied at once).
        if not optimizers or any(self._in_step.get(id(o), 1) for o in optimizers):
            defer = ()
        staged = self.buffers.stage(state, defer=defer)
        staging = self._copy_deferred(optimizers, watch) if self.buffers.deferred else None
        with self._lock:
            self._path = path
            self._staging = staging
            self._future = self._worker().submit(self._run, write, path, staged, group, staging)
            _SAVING.add(self)
        self.last_stall_s = time.perf_counter() - start
        log.info(
            "Staged checkpoint %s in %.2f s (%.2f GB, %.2f GB newly allocated, %.2f GB of optimizer state"
            " copied next); writing in the background",
            path,
            self.last_stall_s,
            self.buffers.copied_bytes / 1e9,
            self.buffers.allocated_bytes / 1e9,
            self.buffers.deferred_bytes / 1e9,
        )

    def follow(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Follow these optimizers' ``step()`` calls from now on (step pre- and post-hooks, removed by
        :meth:`close`), so that a later :meth:`save` knows whether it runs inside one and may defer
        their state. Call it before training steps start (the strategies do, in ``on_train_start``)."""
        for optimizer in optimizers:
            key = id(optimizer)
            if key not in self._in_step and hasattr(optimizer, "register_step_post_hook"):
                self._in_step[key] = 0
                self._tracking += [
                    optimizer.register_step_pre_hook(functools.partial(self._count_step, key, 1)),
                    optimizer.register_step_post_hook(functools.partial(self._count_step, key, -1)),
                ]

    def _count_step(self, key: int, change: int, *_: Any) -> None:
        self._in_step[key] += change

    def _copy_deferred(
        self, optimizers: Sequence[torch.optim.Optimizer], watch: Sequence[torch.Tensor]
    ) -> Future[None]:
        """Start the deferred copies in the copier thread (which has the caller's priority, not the writer's);
        every optimizer's next ``step()`` waits until they are done. A ``watch`` tensor changed in place
        from now (the state was just staged) until they are done fails them."""
        watch = list(watch)
        versions = [tensor._version for tensor in watch]

        def copy() -> None:  # its error is raised by the write (the save fails), never lost
            self.buffers.copy_deferred()
            changed = sum(tensor._version != version for tensor, version in zip(watch, versions, strict=True))
            if changed:
                raise CheckpointError(
                    f"{changed} parameter or optimizer state tensor(s) were changed in place while an"
                    " async save copied them: until that copy is done (the next step() waits for it)"
                    " only the optimizers' step() may change them. Change them inside step(), or save"
                    " with `async_save=False`."
                )

        if self._copier is None:
            # Made by the first save, in the caller's thread: it has the caller's priority. Kept: starting
            # a thread per save waited for it to run, 0.1 ms idle and 1.5-2.3 ms on a loaded machine here.
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self._name}-stage")
        done = self._copier.submit(copy)
        self._step_hooks = [optimizer.register_step_pre_hook(_waiting_step(done)) for optimizer in optimizers]
        return done

    def _drop_step_hooks(self, *, unless_pending: bool = False) -> None:
        """Remove the step hooks of the last save (in the training thread: never from inside a step)."""
        if unless_pending and self._staging is not None and not self._staging.done():
            return
        hooks, self._step_hooks, self._staging = self._step_hooks, [], None
        for hook in hooks:
            hook.remove()

    @staticmethod
    def _run(
        write: WriteFn, path: Location, staged: Any, group: ProcessGroup | None, staging: Future[None] | None
    ) -> BaseException | None:
        """The background write; its error is returned, for :meth:`wait` to raise in the training thread."""
        start = time.perf_counter()
        try:
            # The deferred copies (made at the training's priority), agreed: a copy that failed on one
            # rank (a watched tensor changed in place meanwhile) fails the save on every rank before the
            # commit (alone, that rank would leave the others waiting in the commit's first collective).
            collective.agree(
                lambda: staging.result() if staging is not None else None, group, "copying the state"
            )
            _lower_priority()
            write(path, staged, group)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            return err
        log.info("Background save of %s finished in %.2f s", path, time.perf_counter() - start)
        return None

    def _worker(self) -> ThreadPoolExecutor:
        """The one background thread: saves and the chores queued after them run in order."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self._name}-save")
        return self._executor

    def later(self, chore: Callable[[], None], what: str) -> None:
        """Run ``chore`` in the background thread once the save in flight (if any) is published, as
        ``ModelCheckpoint``'s removal of an older checkpoint: in the training thread, rank 0's removal of
        a 50 MB checkpoint (rename, delete, directory ``fsync``) took 0.02-0.05 s of every save here.
        Its error is raised by the next :meth:`wait`, naming ``what``. After a save that failed it does
        not run: what the save was to replace stays (the save's own error is raised by :meth:`wait`)."""
        after = self._future  # one worker: done (published or failed) by the time the chore starts

        def run() -> None:
            if after is None or after.result() is None:
                chore()

        self._chores.append((what, self._worker().submit(run)))

    def wait(self) -> None:
        """Block until the save in flight, if any, is published, and the chores queued after it are done.

        Raises:
            CheckpointError: the background save failed; the message names the path and the error.
                The previous checkpoint at that path, if any, is unchanged. Or a chore failed.
        """
        chores, self._chores = self._chores, []
        for what, chore in chores:
            try:
                chore.result()
            except Exception as err:
                raise CheckpointError(
                    f"In the background, {what} failed: {collective.describe(err)}"
                ) from err
        with self._lock:
            future, path = self._future, self._path
            self._future = self._path = None
            _SAVING.discard(self)
        if future is None:
            return
        cause = future.result()
        self._drop_step_hooks()
        if cause is not None:
            self._on_published = []  # nothing was published: nobody hears of it
            self.failed = path
            raise background_failed(path, cause, collective.ranks().rank) from cause
        self._run_published()

    def close(self) -> None:
        """Wait for the save in flight (raising its error), then stop the background thread."""
        try:
            self.wait()
        finally:
            for hook in self._tracking:
                hook.remove()
            self._tracking, self._in_step = [], {}
            for executor in (self._executor, self._copier):
                if executor is not None:
                    executor.shutdown(wait=True)
            self._executor = self._copier = None


def _waiting_step(done: Future[None]) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]:
    """A step pre-hook that keeps ``step()`` from changing the optimizer's state before ``done``.

    torch's optimizers run the closure (Lightning's training step: forward and backward) before they
    change their state, so with a closure the hook waits after it, and the copy is hidden behind the
    step's own compute; without one, or for an optimizer that is not torch's, it waits at once. A
    failed copy fails the save (raised by the write), not the step.
    """

    def waiting(closure: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            result = closure(*args, **kwargs)
            concurrent.futures.wait([done])
            return result

        return run

    def before_step(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if done.done():
            return None
        if type(optimizer).__module__.startswith("torch.optim."):
            if callable(kwargs.get("closure")):
                return args, {**kwargs, "closure": waiting(kwargs["closure"])}
            if len(args) > 1 and callable(args[1]):  # args[0] is the optimizer
                return (args[0], waiting(args[1]), *args[2:]), kwargs
        concurrent.futures.wait([done])
        return None

    return before_step


#: The background writer's ``nice`` increment (Linux: per thread; inherited by the threads it starts,
#: such as the checksum helper). Training keeps the cores it needs; the writer gets the time training
#: leaves (waiting on collectives, data, the interpreter lock), so a save in flight slows the training
#: steps less and takes longer on a saturated machine.
WRITER_NICE = 10


def _lower_priority() -> None:
    """Lower the calling thread's scheduling priority to :data:`WRITER_NICE` (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # not permitted here: the writer runs at the training's priority
        if os.getpriority(os.PRIO_PROCESS, tid) < WRITER_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)
