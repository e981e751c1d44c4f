"""Each rank's own state: its random number generators and its train dataloader position.

Lightning writes rank 0's non-tensor checkpoint part only, and no random number generator (RNG) state.
This keeps, per rank (``docs/checkpoint-format.md#per-rank-state``), the RNG states (plain data, which a
``weights_only`` load reads), the train dataloader's state and generators, and the registered objects'
states: in a sharded directory one file per rank (:func:`~.names.rank_state_file`, a marker in
``meta.pt``), in a full file every rank's under :data:`~.names.RANK_STATE_KEY`.
"""

from __future__ import annotations

import io
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed.checkpoint.stateful import Stateful

from lightning_sharded.checkpoint import collective, names, train_loaders
from lightning_sharded.checkpoint.backends import join
from lightning_sharded.checkpoint.detect import Found
from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.user_state import stateful

__all__ = [
    "FORMAT",
    "RankRestore",
    "collect",
    "gathered",
    "loader_state",
    "marker",
    "quoted",
    "restore",
    "rng_states",
    "set_loader_state",
    "set_rng_states",
    "to_bytes",
]

#: Version of the per-rank state's layout.
FORMAT = 1
#: Keys of one rank's state.
RANK = "rank"
WORLD_SIZE = "world_size"
RNG = "rng"
LOADER = "train_dataloader"
#: Each train dataloader's generators (:func:`.train_loaders.generator_states`), in loader order.
GENERATORS = "train_dataloader_generators"
#: The states of the objects registered with ``register_rank_state``, by name.
REGISTERED = "registered"
#: Keys of the RNG states.
TORCH = "torch"
CUDA = "torch.cuda"
PYTHON = "python"
NUMPY = "numpy"
#: Where Lightning's fit loop keeps the combined loader's state in a checkpoint (under its state_dict).
_COMBINED_LOADER = "combined_loader"


def _module_generators() -> dict[str, Stateful]:
    """The generators behind ``random``'s and NumPy's module functions (NumPy's when it is imported)."""
    found = {PYTHON: random.getstate.__self__}  # type: ignore[attr-defined]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        found[NUMPY] = numpy.random.get_state.__self__
    return {key: cast(Stateful, stateful(rng)) for key, rng in found.items()}


def rng_states() -> dict[str, Any]:
    """This process's RNG states: torch CPU, CUDA (when initialized), ``random``, NumPy (when imported)."""
    states: dict[str, Any] = {TORCH: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states[CUDA] = torch.cuda.get_rng_state_all()
    for key, rng in _module_generators().items():
        states[key] = rng.state_dict()["state"]
    return states


def set_rng_states(states: Mapping[str, Any]) -> list[str]:
    """Set the RNG states :func:`rng_states` returned; returns the ones that could not be set, with why."""
    torch.set_rng_state(states[TORCH])
    if NUMPY in states:
        import numpy  # noqa: F401 - its generator is set below
    for key, rng in _module_generators().items():
        if key in states:
            rng.load_state_dict({"state": states[key]})
    cuda = states.get(CUDA)
    count = torch.cuda.device_count() if cuda and torch.cuda.is_available() else 0
    if cuda and count < len(cuda):
        return [f"CUDA (saved for {len(cuda)} device(s), {count} available now)"]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
    return []


def loader_state(checkpoint: Mapping[str, Any]) -> Any:
    """This rank's train dataloader state in a Lightning checkpoint dict, or ``None`` when it has none."""
    return (train_loaders.fit_loop(checkpoint, "state_dict") or {}).get(_COMBINED_LOADER)


def set_loader_state(checkpoint: dict[str, Any], state: Any) -> None:
    """Put ``state`` where Lightning keeps the train dataloader state in ``checkpoint`` (``None``: none)."""
    loop = train_loaders.fit_loop(checkpoint, "state_dict")
    if isinstance(loop, dict) and state is None:
        loop.pop(_COMBINED_LOADER, None)
    elif isinstance(loop, dict):
        loop[_COMBINED_LOADER] = state


def collect(
    checkpoint: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    generators: list[dict[str, torch.Tensor]] | None = None,
    registered: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """This rank's state now: RNG states, the train dataloader state of ``checkpoint`` (this rank's), the
    train dataloaders' ``generators`` states and the ``registered`` objects' states (omitted if ``None``)."""
    state = {
        "format": FORMAT,
        RANK: rank,
        WORLD_SIZE: world_size,
        RNG: rng_states(),
        LOADER: loader_state(checkpoint),
    }
    if generators is not None:
        state[GENERATORS] = generators
    if registered:
        state[REGISTERED] = dict(registered)
    return state


def to_bytes(state: Mapping[str, Any]) -> bytes:
    """One rank's state as the bytes of its file (``torch.save``)."""
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return buffer.getvalue()


def marker(world_size: int) -> dict[str, Any]:
    """What ``meta.pt`` of a sharded directory records: every rank of ``world_size`` wrote its file."""
    return {"format": FORMAT, WORLD_SIZE: world_size, "dir": names.RANK_STATE_DIR}


def gathered(state: Mapping[str, Any]) -> dict[str, Any]:
    """Every rank's ``state`` (collective, all ranks), as a full file keeps it under the checkpoint key."""
    states = collective.all_gather(dict(state), collective.ranks())
    return {"format": FORMAT, WORLD_SIZE: len(states), "ranks": states}


@dataclass
class RankRestore:
    """What :func:`restore` decided for this rank.

    Attributes:
        rng: The RNG states to set (``None``: leave the generators alone).
        generators: Each train dataloader's generator states to set (``None``: leave them alone).
        registered: The registered objects' states to load, by name (this rank's own, or at another
            world size those that were the same on every saved rank).
        registered_saved: The names of every registered state the checkpoint holds.
        warning: What was not restored and why (one message for ``rank_zero_warn``), or ``None``.
        saved_world_size: Ranks that saved per-rank state; ``None`` when the checkpoint has none.
    """

    rng: dict[str, Any] | None = None
    generators: list[dict[str, torch.Tensor]] | None = None
    registered: dict[str, Any] = field(default_factory=dict)
    registered_saved: tuple[str, ...] = ()
    warning: str | None = None
    saved_world_size: int | None = None


def _checked(state: Any, rank: int, what: str) -> dict[str, Any]:
    """``state`` if it is rank ``rank``'s, else the error naming ``what`` it is."""
    if not isinstance(state, dict) or state.get(RANK) != rank or RNG not in state:
        raise CheckpointError(
            f"The per-rank state {what} is not rank {rank}'s state written by lightning_sharded."
            " Resume from another checkpoint."
        )
    return state


def _read(found: Found, rank: int, weights_only: bool | None) -> dict[str, Any]:
    loc = join(found.data, names.rank_state_file(rank))
    try:
        state = found.backend.torch_load(loc, map_location="cpu", weights_only=weights_only)
    except Exception as ex:
        raise CheckpointError(
            f"Could not read the per-rank state {str(loc)!r} of rank {rank}: {ex!r}. Resume from another"
            " checkpoint, or save with `save_rank_state=False` and delete the folder"
            f" {names.RANK_STATE_DIR!r} to resume without it."
        ) from ex
    return _checked(state, rank, repr(str(loc)))


def _same(a: Any, b: Any) -> bool:
    """Equal structure and values, tensors compared exactly (a tensor and another type: not alike)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


#: A registered name some saved rank has no state for.
_ABSENT = object()


def _alike(states: list[dict[str, Any]], what: str) -> tuple[RankRestore, bool]:
    """What a resume at another world size restores of every saved rank's ``states``: what they all had
    alike, ``what`` warned with the rest; and whether the train dataloader state must be dropped."""

    def loader(s: dict[str, Any]) -> Any:
        return (s.get(LOADER), s.get(GENERATORS) or None)

    has_loader = any(s.get(LOADER) is not None or any(s.get(GENERATORS) or ()) for s in states)
    same_loader = has_loader and all(_same(loader(states[0]), loader(s)) for s in states[1:])
    keys = sorted({k for s in states for k in (s.get(REGISTERED) or {})})
    per_name = {k: [(s.get(REGISTERED) or {}).get(k, _ABSENT) for s in states] for k in keys}
    alike = {k: v[0] for k, v in per_name.items() if all(x is not _ABSENT and _same(v[0], x) for x in v)}
    differing = [k for k in keys if k not in alike]
    if same_loader:
        what += " The train dataloader state, the same on every saved rank, was restored on every rank."
    elif has_loader:
        what += (
            " The train dataloader state was not restored either: it differs between the saved ranks (each"
            " had its own position or shuffle), so every train dataloader starts from its beginning."
        )
    if alike:
        what += (
            f" The registered per-rank state {quoted(alike)}, the same on every saved rank, was"
            " restored on every rank."
        )
    if differing:
        what += (
            f" The registered per-rank state {quoted(differing)} was not restored: it differs between"
            " the saved ranks, so those objects keep their current state."
        )
    outcome = RankRestore(
        generators=states[0].get(GENERATORS) if same_loader else None,
        registered=alike,
        registered_saved=(*alike, *differing),
        warning=what + " The model and optimizer states were restored (resharded).",
        saved_world_size=len(states),
    )
    return outcome, has_loader and not same_loader


def _shape(entry: Any) -> tuple[int, bool] | None:
    """The saved world size of a rank-state ``entry`` and whether it is a full file's (``"ranks"``)."""
    if not isinstance(entry, dict) or not isinstance(entry.get(WORLD_SIZE), int):
        return None
    return int(entry[WORLD_SIZE]), "ranks" in entry


def restore(
    metadata: dict[str, Any],
    found: Found,
    *,
    rank: int,
    world_size: int,
    weights_only: bool | None,
    path: str,
) -> RankRestore:
    """Take the per-rank state out of a loaded checkpoint's ``metadata`` (``Restored.metadata``; its
    ``found`` reads a directory's rank files, with ``weights_only`` as ``fit()`` was given it) and
    decide what to restore; ``path`` as the user gave it, for messages.

    Collective: what the entry is (its saved world size, a full file's or a directory's) is decided on
    rank 0, so every rank takes the same branch. ``metadata`` loses :data:`~.names.RANK_STATE_KEY`; at the
    same world size its train dataloader state becomes this rank's own, and the returned states are this
    rank's. At another world size the RNG states are not restored, nor the dataloader state (with its
    generators) or a registered state unless every saved rank had the same one (then every rank gets it);
    :attr:`RankRestore.warning` says which and why.

    Raises:
        CheckpointError: a per-rank file cannot be read, or holds another rank's state; on every rank.
    """
    entry = metadata.pop(names.RANK_STATE_KEY, None)
    shape = collective.decide(lambda: _shape(entry))
    if shape is None:
        return RankRestore()
    saved, full = shape
    states: Any = entry.get("ranks") if full and isinstance(entry, dict) else None

    def of(r: int) -> dict[str, Any]:  # rank r's state: a full file's entry, or a directory's file
        if not full:
            return _read(found, r, weights_only)
        own = states[r] if isinstance(states, list) and r < len(states) else None
        return _checked(own, r, f"of rank {r} in {path!r} ({names.RANK_STATE_KEY!r})")

    if saved == world_size:
        # Agreed: a rank whose own entry is bad must not raise alone while the others go on into the
        # next collective (in a full file every rank holds the same entries, so they normally agree).
        own = collective.agree(lambda: of(rank))
        set_loader_state(metadata, own.get(LOADER))
        return RankRestore(
            rng=own[RNG],
            generators=own.get(GENERATORS),
            registered=dict(own.get(REGISTERED) or {}),
            registered_saved=tuple(own.get(REGISTERED) or ()),
            saved_world_size=saved,
        )
    what = (
        f"The per-rank state of {path!r} was saved by {saved} rank(s), this run has {world_size}. The random"
        " number generator states (torch, CUDA, random, numpy) were not restored: they belong to ranks"
        " that do not exist now, so every rank keeps its generators as they are (call"
        " `lightning.seed_everything` for a reproducible continuation)."
    )
    # Rank 0 reads every saved rank's state (a full file: its copy) and decides for all.
    outcome, drop_loader = collective.decide(lambda: _alike([of(r) for r in range(saved)], what))
    if drop_loader:
        set_loader_state(metadata, None)
    return outcome


def quoted(keys: Any) -> str:
    """``keys`` sorted and quoted, for a message: ``'a', 'b'``."""
    return ", ".join(repr(k) for k in sorted(keys))
