"""Writing Lightning checkpoints: the one function per kind, both committed atomically.

:func:`write_sharded_checkpoint` (collective) writes a sharded directory through
:func:`~lightning_sharded.checkpoint.commit.commit_directory`, :func:`write_full_checkpoint` (rank 0)
one ``torch.save`` file through :func:`~lightning_sharded.checkpoint.commit.commit_file`, and
:func:`save_in_background` stages a sharded one on an
:class:`~lightning_sharded.checkpoint.async_save.AsyncSaver`. Local paths and fsspec URLs alike: the
backend of the path does what differs.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_sharded.checkpoint import collective, names, rank_index, space
from lightning_sharded.checkpoint.async_save import AsyncSaver
from lightning_sharded.checkpoint.backends import Location, backend_for, join, location
from lightning_sharded.checkpoint.backends.observed import Observed
from lightning_sharded.checkpoint.checksum import bytes_checksum
from lightning_sharded.checkpoint.commit import commit_directory, commit_file
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.failures import dcp_errors
from lightning_sharded.checkpoint.manifest import FrozenPart
from lightning_sharded.tensors import adapter_for

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "WRITER_THREADS",
    "check_same_shapes",
    "save_checkpoint",
    "save_in_background",
    "split_sharded_checkpoint",
    "write_full_checkpoint",
    "write_sharded_checkpoint",
]

#: DCP writer threads per rank (one shard file each). With 2 ranks on 2 cores, a second thread (plus
#: its hashing thread) only adds contention: 2 GB saves took 1.58 s with 2 threads, 1.13 s with 1
#: (stock ModelParallel in the same runs: 1.01 s and 1.26 s).
WRITER_THREADS = 1


def _planner() -> Any:
    """DCP's default save planner that first refuses what :func:`check_same_shapes` does (a plain
    tensor is written once, one rank's copy: another rank's shape would be lost without a word), on
    the coordinator from the plans it gathers anyway (no collective); DCP sends the error to every rank."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class SameShapes(DefaultSavePlanner):
        def create_global_plan(self, all_plans: list[Any]) -> Any:
            check_same_shapes(all_plans)
            return super().create_global_plan(all_plans)

    return SameShapes()


def check_same_shapes(all_plans: list[Any]) -> None:
    """Raise a ``CheckpointError`` naming the first key whose tensor's global shape differs between the
    ranks' DCP save plans (``all_plans[r]`` is rank r's), with both shapes and ranks."""
    seen: dict[str, tuple[tuple[int, ...], int]] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            if item.tensor_data is None:
                continue
            size = tuple(item.tensor_data.size)
            known = seen.setdefault(item.index.fqn, (size, rank))
            if known[0] != size:
                raise CheckpointError(
                    f"size mismatch for {item.index.fqn}: rank {known[1]} holds shape {list(known[0])}, rank"
                    f" {rank} {list(size)}. A plain tensor is saved once for all ranks (one rank's copy), so"
                    " a tensor whose shape differs per rank cannot be saved as one: make it a DTensor or a"
                    " ShardedTensor (or put one in the module's state_dict()) so that every rank's piece is"
                    " saved where it belongs."
                )


def write_sharded_checkpoint(
    path: Location | str | os.PathLike[str],
    state: dict[str, Any],
    metadata: dict[str, Any],
    *,
    rank: int,
    group: ProcessGroup | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    frozen: FrozenPart | None = None,
    check_space: bool = True,
) -> None:
    """Write a sharded checkpoint at ``path`` atomically: DCP shards and index, ``meta.pt``, manifest.

    Collective over ``group``, and raises what :func:`~.commit.commit_directory` raises (a
    ``StorageError`` led by the cause, for a full disk with the bytes needed against the bytes free; a
    ``CheckpointError`` naming the failing ranks). Every rank calls it with its own shards in ``state``
    (top-level keys such as ``"model"`` and ``"optimizer_0"``); rank 0 writes ``metadata`` (the rest of
    the Lightning checkpoint). ``extra_files`` (``{relative path: bytes}``, e.g. this rank's per-rank
    state file) are written by this rank next to its shards, listed in the manifest as its own.
    ``check_space``: refuse a local save that does not fit its filesystem's free space
    (:mod:`~lightning_sharded.checkpoint.space`). ``frozen``: a trainable-only checkpoint's frozen part
    (the model keys ``state`` leaves out and where they are), recorded in the manifest.
    """
    from torch.distributed.checkpoint.state_dict_saver import save

    target = location(path)
    backend = backend_for(target)
    where = collective.ranks(group)
    own: dict[str, bytes] = dict(extra_files or {})
    if rank == 0:
        buffer = io.BytesIO()
        torch.save(metadata, buffer)
        own[names.LIGHTNING_METADATA] = buffer.getvalue()
    needed = space.sharded_share(state, where.world_size, [len(data) for data in own.values()])

    def write(staging: Location) -> dict[str, tuple[int, str]]:
        writer = backend.dcp_writer(staging, thread_count=WRITER_THREADS)
        recorder = rank_index.RankIndexRecorder()
        marked = Observed(writer, recorder.hooks)
        marked = Observed(marked, {"write_data": collective.marking(where, "DCP save: shards written")})
        with (
            collective.watched(where, "DCP save: planning"),
            dcp_errors(f"Saving the sharded checkpoint to {str(target)!r}", saving=True),
        ):
            save(state, storage_writer=marked, process_group=where.group, planner=_planner())
        checksums: dict[str, tuple[int, str]] = dict(writer.checksums)
        # The per-rank index: rank 0's layout from the global index it holds anyway, each rank's own
        # file from its own write results (no collective). Without a layout (an index the grids cannot
        # describe), no rank's file is needed: the checkpoint loads from `.metadata` alone.
        layout = recorder.layout if rank == 0 else None
        if layout is not None:
            own[names.INDEX_LAYOUT] = layout
        if rank != 0 or layout is not None:
            own[names.rank_index_file(rank)] = recorder.rank_bytes(rank)
        for rel, data in sorted(own.items()):
            backend.write_bytes(join(staging, *rel.split("/")), data)
            checksums[rel] = bytes_checksum(data)
        return checksums

    commit_directory(
        target,
        write,
        metadata={k: metadata[k] for k in ("epoch", "global_step") if isinstance(metadata.get(k), int)},
        group=where.group,
        backend=backend,
        needed=needed,
        check_space=check_space,
        frozen=frozen,
    )


def split_sharded_checkpoint(
    checkpoint: dict[str, Any], model_key: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Lightning checkpoint dict as ``(state for DCP, the rest for meta.pt)``; consumes ``checkpoint``.
    The state holds the model under ``model_key`` and each optimizer state under ``optimizer_<i>``."""
    state = {model_key: checkpoint.pop(names.STATE_DICT)}
    for index, optim_state in enumerate(checkpoint.pop(names.OPTIMIZER_STATES, [])):
        state[names.optimizer_key(index)] = optim_state
    return state, checkpoint


def write_full_checkpoint(
    path: Location | str | os.PathLike[str],
    checkpoint: dict[str, Any],
    *,
    rank: int,
    check_space: bool = True,
) -> None:
    """Write a full checkpoint file at ``path`` atomically with ``torch.save`` (rank 0; others return),
    through :func:`~.commit.commit_file` (a sharded checkpoint directory at ``path`` is replaced by it).
    With ``check_space``, a local file that does not fit its filesystem's free space is refused.

    Raises:
        IsADirectoryError: ``path`` is a non-empty directory that is not a checkpoint.
        StorageError: the storage failed (the message starts with the cause), or the file did not fit.
    """
    if rank != 0:
        return

    def write(staged: Path) -> None:
        # Through a Python file: torch.save into a file name drops the OSError of a failed write
        with open(staged, "wb") as f:
            torch.save(checkpoint, f)

    commit_file(location(path), write, needed=space.full_size(checkpoint), check_space=check_space)


def save_checkpoint(
    path: Location | str | os.PathLike[str],
    checkpoint: dict[str, Any],
    *,
    sharded: bool,
    model_key: str,
    rank: int,
    extra_files: Mapping[str, bytes] | None = None,
    frozen: FrozenPart | None = None,
    check_space: bool = True,
) -> None:
    """Write a Lightning checkpoint dict (from ``Trainer._checkpoint_connector.dump_checkpoint``) at
    ``path``: a sharded directory (:func:`write_sharded_checkpoint`), or a full file written by rank 0,
    every rank returning or raising its outcome. Collective.

    ``checkpoint``'s states come from :mod:`~lightning_sharded.checkpoint.state_dicts` with ``full=not
    sharded``; it is consumed (its ``"state_dict"`` and ``"optimizer_states"`` popped). ``model_key``:
    the model state's top-level key in a sharded directory (``"model"`` or ``"state_dict"``). ``frozen``:
    in the manifest of a sharded directory, under :data:`~.names.FROZEN_KEY` in a full file.
    """
    if sharded:
        state, metadata = split_sharded_checkpoint(checkpoint, model_key)
        write_sharded_checkpoint(
            path, state, metadata, rank=rank, extra_files=extra_files, check_space=check_space, frozen=frozen
        )
    else:
        if frozen is not None:
            checkpoint[names.FROZEN_KEY] = frozen.to_dict()
        collective.decide(
            lambda: write_full_checkpoint(path, checkpoint, rank=0, check_space=check_space),
            step="writing the full checkpoint on rank 0",
        )


def save_in_background(
    saver: AsyncSaver,
    path: Location,
    checkpoint: dict[str, Any],
    *,
    model_key: str,
    rank: int,
    optimizers: Sequence[Any],
    rank_files: Callable[[], Mapping[str, bytes] | None],
    frozen: FrozenPart | None,
    check_space: bool,
) -> None:
    """Stage a sharded checkpoint on ``saver`` and return; it is written and published in the background.

    Not collective in the calling thread: the background write first agrees rank 0's ``path`` and
    whether every rank collected its own state (``rank_files()``, this rank's files for
    :func:`write_sharded_checkpoint`: its error is raised on every rank alike), then writes. The
    optimizers' "state" (not their param_groups, which LR schedulers change in place) and the
    parameters they update are copied after this returns (``defer`` of :meth:`AsyncSaver.save`).
    """
    collected: Exception | None = None
    try:
        extra_files = rank_files()
    except Exception as err:  # raised on every rank alike by the background write
        extra_files, collected = None, err
    state, metadata = split_sharded_checkpoint(checkpoint, model_key)

    def write(target: Location, staged: Any, group: Any) -> None:
        where = collective.ranks(group)
        target = location(collective.broadcast(str(target), where, "the checkpoint's path"))

        def check() -> None:
            if collected is not None:
                raise collected

        collective.agree(check, group, "collecting each rank's own state")
        write_sharded_checkpoint(
            target,
            staged[0],
            staged[1],
            rank=rank,
            group=group,
            extra_files=extra_files,
            frozen=frozen,
            check_space=check_space,
        )

    deferred = [(0, names.optimizer_key(i), "state") for i in range(len(optimizers))]
    deferred += [(0, model_key, key) for key in _updated_by(state[model_key], optimizers)]
    saver.save(
        path, (state, metadata), write, defer=deferred, optimizers=optimizers, watch=_watched(optimizers)
    )


def _local_tensors(value: Any) -> list[Tensor]:
    """A state-dict value's local tensors (a sharded value's, by its kind's adapter); none else."""
    adapter = adapter_for(value)
    if adapter is not None:
        return adapter.local_tensors(value)
    return [value] if isinstance(value, Tensor) else []


def _trainable(optimizers: Sequence[Any]) -> list[Tensor]:
    return [
        param
        for optimizer in optimizers
        for group in getattr(optimizer, "_optimizer", optimizer).param_groups
        for param in group["params"]
        if param.requires_grad
    ]


def _updated_by(model_state: Mapping[str, Any], optimizers: Sequence[Any]) -> list[str]:
    """The keys of ``model_state`` whose tensors lie in the memory of parameters the ``optimizers``
    update (FSDP2's sharded parameters, FSDP1's views of its flat parameters): nothing but ``step()``
    changes them. Buffers, sharded attributes and frozen parameters are not among them.

    By storage: a view lies in the memory of the tensor it views, so one set lookup per tensor (on the
    save's stall: comparing every key with every parameter took 20 ms at 1,000 parameters)."""
    storages = {_local_tensors(param)[0].untyped_storage().data_ptr() for param in _trainable(optimizers)}
    return sorted(
        key
        for key, value in model_state.items()
        if (local := _local_tensors(value)) and all(t.untyped_storage().data_ptr() in storages for t in local)
    )


def _watched(optimizers: Sequence[Any]) -> list[Tensor]:
    """What only the optimizers' ``step()`` may change while an async save copies it: their trainable
    parameters (and a ``DTensor``'s local tensor; FSDP1's original parameters share their flat
    parameter's version counter) and their state tensors."""
    watched: list[Tensor] = []
    for param in _trainable(optimizers):
        watched += {id(t): t for t in [param, *_local_tensors(param)]}.values()
    for optimizer in optimizers:
        for entries in getattr(optimizer, "_optimizer", optimizer).state.values():
            watched += [t for value in entries.values() for t in _local_tensors(value)]
    return watched
