"""Loading a sharded checkpoint into a live, already sharded model (and optimizers), at any world size.

Each rank reads only the pieces of its shards, through DCP. Keys and shapes are checked against the
checkpoint's index before anything is read, so a strict load that does not fit fails without touching
the model; the Lightning metadata is read (once, on rank 0, and shared) before the first tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_sharded.checkpoint import collective, fsdp1, names, rank_index, shard_pieces
from lightning_sharded.checkpoint.backends import Backend, Location, join
from lightning_sharded.checkpoint.backends.dcp_reader import SafeBytesPlanner
from lightning_sharded.checkpoint.backends.observed import Observed
from lightning_sharded.checkpoint.dcp_index import ShardedLayout, read_indexed_layout, read_sharded_layout
from lightning_sharded.checkpoint.detect import Found
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.failures import dcp_errors
from lightning_sharded.checkpoint.faults import FaultPoint, fault
from lightning_sharded.checkpoint.integrity import ReadVerification
from lightning_sharded.checkpoint.lightning_meta import read_meta
from lightning_sharded.checkpoint.load.checks import (
    KeyReport,
    Stored,
    check_optimizer_count,
    check_shapes,
    copy_full_into,
    fit_model,
    named_optimizer_params,
    set_model_state,
    set_optimizer_state,
    template_like,
)
from lightning_sharded.checkpoint.manifest import FrozenPart
from lightning_sharded.checkpoint.staging import StagingBuffers
from lightning_sharded.checkpoint.state_dicts import (
    PARAM_GROUPS,
    PARAMS,
    STATE,
    key_by_index,
    model_state_dict,
    optimizer_pieces,
    torch_optimizer_template,
)

__all__ = ["make_template", "restore_sharded"]


def restore_sharded(
    found: Found,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    strict: bool,
    weights_only: bool | None,
    verification: ReadVerification | None = None,
    keep_model: bool = False,
    read_metadata: bool = True,
) -> tuple[dict[str, Any], KeyReport, FrozenPart | None]:
    """Load the sharded checkpoint ``found`` into ``model`` and ``optimizers``; collective.

    Returns the Lightning metadata (``meta.pt``; ``{}`` without ``read_metadata``), the comparison of
    model keys, and a trainable-only checkpoint's frozen part limited to the model's keys (not read
    here). ``verification`` checks the checksums from the reads before the model's remaining state and
    the optimizers are set (``verify="during"``); with ``keep_model`` too, the model is read into CPU
    buffers and copied in once they matched (``verify="before"``, :func:`~.load.restore_checkpoint`).
    """
    backend, path = found.backend, found.data
    # The DCP index is read once, on rank 0, and shared (with the DCP readers too): N ranks reading the
    # same small file once per dcp.load call is a metadata storm on a parallel file system and N GET
    # requests on S3 (see docs/benchmarks.md, "Scale").
    indexed = found.manifest is not None and any(e.path == names.INDEX_LAYOUT for e in found.manifest.files)
    with _reading(verification):
        layout = collective.decide(
            lambda: (
                read_indexed_layout(backend, path)
                if indexed
                else read_sharded_layout(path, backend, weights_only=weights_only)
            ),
            step="reading the index",
        )
    if optimizers:
        check_optimizer_count(path, len(optimizers), layout.optimizer_count)
    target = model_state_dict(model, full=False)
    frozen = found.manifest.frozen if found.manifest is not None else None
    report, to_load, frozen = fit_model(path, layout.model_entries, target, frozen, strict=strict)
    # Before the first read: a bad meta.pt must fail the load before the model changed. Read once,
    # on rank 0, and shared: every rank gets the same dict or raises the same error.
    metadata: dict[str, Any] = {}
    if read_metadata:
        with _reading(verification):
            metadata = collective.decide(
                lambda: read_meta(backend, join(path, names.LIGHTNING_METADATA), weights_only),
                step="reading meta.pt",
            )
    # Every optimizer's template is built and checked before anything is read: an optimizer that does
    # not fit fails before the model changed. Then one DCP pass reads the model and every optimizer:
    # each rank's file is read front to back once (the reader's streams and read-ahead span all of it).
    # verify=True from the reads: the model's values are read beside it, and copied in once checked.
    into = StagingBuffers().stage(to_load, copy=False) if keep_model and verification is not None else to_load
    state: dict[str, Any] = {layout.model_key: into}
    finishes = [
        _prepare_optimizer(
            path, layout, model, optimizer, index, strict=strict, into=state, model_state=target
        )
        for index, optimizer in enumerate(optimizers)
    ]
    _read(found, layout, state, verification, weights_only)
    if into is not to_load:
        _copy_into(to_load, into)
    set_model_state(model, to_load)  # FSDP1: the parameters were read into views of the flat shards
    for finish in finishes:
        finish()
    return metadata, report, frozen


def _read(
    found: Found,
    layout: ShardedLayout,
    state: dict[str, Any],
    verification: ReadVerification | None,
    weights_only: bool | None,
) -> None:
    """DCP reads ``state`` (every rank its pieces), then the checksums are compared (``verification``)."""
    metadata = layout.metadata
    if layout.index is not None:
        # Each rank reads the index files of the ranks that wrote what it loads, and nothing else. A
        # file that cannot be read fails the load on every rank with the same error.
        with _reading(verification):
            metadata = collective.agree(
                lambda: _rank_metadata(found.backend, found.data, layout, state),
                step="reading the per-rank index",
            )
    fault(FaultPoint.BEFORE_READ, collective.ranks().rank)
    with _reading(verification):
        _dcp_load(found.backend, state, found.data, metadata, verification, weights_only)
    if verification is not None:
        verification.check()


def _copy_into(to_load: dict[str, Any], read: dict[str, Any]) -> None:
    """The values ``read`` (:meth:`StagingBuffers.stage` twins of ``to_load``'s tensors) into
    ``to_load``'s own tensors; an entry read as an object replaces its value. A twin has its target's
    layout, so each sharded copy is local (no collective)."""
    for key, value in read.items():
        to_load[key] = copy_full_into(to_load[key], value)


def _prepare_optimizer(
    path: Location,
    layout: ShardedLayout,
    model: nn.Module,
    optimizer: Optimizer,
    index: int,
    *,
    strict: bool,
    into: dict[str, Any],
    model_state: dict[str, Any],
) -> Callable[[], None]:
    """Put what DCP reads for this optimizer into ``into`` (the state of the load); returns what loads
    it into the optimizer once read. Checks first."""
    key = names.optimizer_key(index)
    where = f"{key}.{STATE}."
    stored: Stored = {}  # parameter name -> entry -> (global shape, dtype)
    for flat_key in sorted(layout.entries):
        if flat_key.startswith(where):
            name, _, entry = flat_key[len(where) :].rpartition(".")
            stored.setdefault(name, {})[entry] = (layout.entries[flat_key], layout.dtypes.get(flat_key))
    template, from_index, load = make_template(model, optimizer, stored, model_state, where, repr(str(path)))
    groups: list[dict[str, Any]] = template[PARAM_GROUPS]
    prefix = f"{key}.{PARAM_GROUPS}."
    groups_in_checkpoint = {int(k.split(".")[2]) for k in layout.entries if k.startswith(prefix)}
    if len(groups_in_checkpoint) != len(groups):
        raise CheckpointError(
            f"The optimizer {key} in {str(path)!r} has {len(groups_in_checkpoint)} parameter group(s), the"
            f" optimizer configured now has {len(groups)}. Resume with the same parameter"
            " groups as the run that saved the checkpoint."
        )
    missing = _missing_state(path, layout, key, template[STATE], from_index, model, optimizer)
    if missing and strict:
        raise CheckpointError(
            f"The optimizer state {key} in {str(path)!r} does not fit the optimizer (strict loading)."
            f" {KeyReport(missing, []).describe()} Resume with the same model and optimizer, or set"
            " `strict_loading = False` on the LightningModule to load the state both have."
        )
    # The param groups' entries go to DCP under their flat keys: a group of plain values is one leaf to
    # DCP's flattening (no tensor inside), whose key the checkpoint does not have, so a partial load
    # skipped it on the ranks whose groups held no tensor, and kept their current values.
    flat_groups = {
        f"{prefix}{i}.{name}": (group, name)
        for i, group in enumerate(groups)
        for name in group
        if name != PARAMS and f"{prefix}{i}.{name}" in layout.entries
    }
    into[key] = {STATE: template[STATE]}
    into.update({flat_key: group[name] for flat_key, (group, name) in flat_groups.items()})

    def finish() -> None:
        # DCP puts the plain values it reads (lr, betas...) in place in `into`.
        for flat_key, (group, name) in flat_groups.items():
            group[name] = into[flat_key]
        load()

    return finish


def _missing_state(
    path: Location,
    layout: ShardedLayout,
    key: str,
    state: dict[str, dict[str, Any]],
    from_index: bool,
    model: nn.Module,
    optimizer: Optimizer,
) -> list[str]:
    """The keys of the optimizer's state the checkpoint does not have. A template not made from the
    index (torch's) loses them, after a shape check of the rest: those parameters start with fresh state
    (a non-strict load; the caller refuses a strict one)."""
    if from_index:
        # The template holds what the checkpoint has. With any state at all (not a stateless optimizer),
        # a trainable parameter without state is missing from the checkpoint.
        trainable = [name for name, param in named_optimizer_params(model, optimizer) if param.requires_grad]
        return [f"{key}.{STATE}.{name}" for name in trainable if name not in state] if state else []
    flat = {f"{key}.{STATE}.{name}.{entry}": (name, entry) for name in state for entry in state[name]}
    missing = [k for k in flat if k not in layout.entries]
    check_shapes(
        path,
        {k: state[name][entry] for k, (name, entry) in flat.items() if k in layout.entries},
        layout.entries,
    )
    for k in missing:
        name, entry = flat[k]
        state[name].pop(entry)
    for name in [n for n, entries in state.items() if not entries]:
        state.pop(name)
    return missing


def make_template(
    model: nn.Module,
    optimizer: Optimizer,
    stored: Stored,
    model_state: dict[str, Any],
    where: str,
    source: str,
) -> tuple[dict[str, Any], bool, Callable[[], None]]:
    """What to read ``optimizer``'s state into (name-keyed): from ``stored`` (the checkpoint's entries,
    checked and agreed by every rank: :func:`template_like`, or FSDP1's local pieces) (``True``), else
    torch's helper's (``False``); and what loads it into the optimizer once read.

    The state of a parameter that is this rank's piece of a sharded model value (TorchRec's tables) is
    read as a sharded value of that layout (:mod:`~lightning_sharded.checkpoint.shard_pieces`), so each
    rank reads its own piece, resharded from whatever plan and world size saved it."""
    pieces, _ = optimizer_pieces(model, optimizer, model_state)
    backing: dict[int, torch.Tensor] = {}
    template = collective.agree(
        lambda: template_like(model, optimizer, stored, pieces, backing, where=where, source=source),
        step="checking the optimizer state",
    )
    if template is None:
        template = fsdp1.optimizer_template(model, optimizer, stored, backing)
    from_index = template is not None
    if template is None:
        # FSDP1's flat parameters: torch's helper builds the template (with one zero-lr step) and
        # FSDP's own optim_state_dict_to_load maps it onto the flat parameters.
        template = torch_optimizer_template(model, optimizer)
        backing = shard_pieces.wrap_state(template, pieces)

    def load() -> None:
        shard_pieces.unwrap_state(template, backing)
        if from_index:
            optimizer.load_state_dict(key_by_index(template))
        else:
            set_optimizer_state(model, optimizer, template)

    return template, from_index, load


def _rank_metadata(backend: Backend, path: Location, layout: ShardedLayout, state: dict[str, Any]) -> Any:
    """The DCP ``Metadata`` this rank plans its reads with, from the index files of the ranks it needs."""
    assert layout.index is not None
    wanted = rank_index.ranks_to_read(layout.index, rank_index.flat_tensors(state))
    pieces = []
    for rank in sorted(wanted):
        file = join(path, names.rank_index_file(rank))
        try:
            raw = backend.read_bytes(file)
        except OSError as ex:
            raise CheckpointError(
                f"Could not read the index file {str(file)!r} of rank {rank} ({type(ex).__name__}: {ex});"
                " restore the checkpoint directory from a copy, or load an earlier checkpoint."
            ) from ex
        pieces += rank_index.parse_rank_file(raw, str(file), rank)
    read = ", ".join(repr(names.rank_index_file(r)) for r in sorted(wanted)) or "(none)"
    return rank_index.partial_metadata(
        layout.index, pieces, (piece for needed in wanted.values() for piece in needed), read
    )


def _dcp_load(
    backend: Backend,
    state: dict[str, Any],
    path: Location,
    metadata: Any,
    verification: ReadVerification | None,
    weights_only: bool | None,
) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load

    where = collective.ranks()
    reader = backend.dcp_reader(
        path, metadata=metadata, checksums=verification.checksums if verification is not None else None
    )
    reader = Observed(reader, {"read_data": collective.marking(where, "DCP load: shards read")})
    planner = SafeBytesPlanner(
        allow_partial_load=True,
        weights_only=weights_only,
        what=lambda item: f"The value {item.dest_index.fqn!r} of the sharded checkpoint {str(path)!r}",
    )
    with (
        collective.watched(where, "DCP load: planning"),
        dcp_errors(f"Loading the sharded checkpoint {str(path)!r}"),
    ):
        load(state, storage_reader=reader, planner=planner, process_group=where.group)


def _reading(verification: ReadVerification | None) -> contextlib.AbstractContextManager[None]:
    """Around a read: with a verification, a failure is replaced by the damage the checksums show."""
    return verification.reading() if verification is not None else contextlib.nullcontext()
