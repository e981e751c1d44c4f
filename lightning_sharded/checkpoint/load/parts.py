"""The parts of a Lightning checkpoint a resume can leave out (``exclude_from_loading``).

A part is named by the key Lightning keeps it under in the checkpoint dict, so the names read the
same in a config and in ``torch.load(path).keys()``; the table of parts: ``docs/strategies.md``,
"Partial loads".

Everything here works on the dict the strategies' ``load_checkpoint`` returns to the Trainer (what is
left once the model and optimizer states are in place): dropping a part there is what keeps Lightning
from restoring it. Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

from lightning_sharded.checkpoint.errors import CheckpointError
from lightning_sharded.checkpoint.names import OPTIMIZER_STATES, RANK_STATE_KEY

__all__ = ["CALLBACKS", "LR_SCHEDULERS", "PARTS", "RANK_STATE", "check_parts", "drop_parts"]

LR_SCHEDULERS = "lr_schedulers"
LOOPS = "loops"
CALLBACKS = "callbacks"
RANK_STATE = "rank_state"
#: Every part by name, with what leaving it out means (for the one line a resume logs).
PARTS: dict[str, str] = {
    OPTIMIZER_STATES: "the optimizer states (the optimizers start fresh)",
    LR_SCHEDULERS: "the LR scheduler states",
    LOOPS: "the loops' progress (epoch, global step and dataloader position start at 0)",
    CALLBACKS: "every callback's state",
    RANK_STATE: "the per-rank RNG and train dataloader states",
}
_CALLBACK_PREFIX = CALLBACKS + "."
#: The key of a part in the checkpoint dict, where it is not the part's own name.
_KEYS = {RANK_STATE: RANK_STATE_KEY}


def check_parts(parts: Iterable[str] | str | None) -> tuple[str, ...]:
    """The parts to exclude, each checked; a ``ValueError`` naming an unknown one and the choices.

    A single string counts as one part (``exclude_from_loading="optimizer_states"``).
    """
    if parts is None:
        return ()
    given = [parts] if isinstance(parts, str) else list(parts)
    for part in given:
        if not isinstance(part, str) or (part not in PARTS and not _callback_name(part)):
            choices = ", ".join(repr(p) for p in PARTS)
            raise ValueError(
                f"Unknown part {part!r} in `exclude_from_loading`: choose from {choices}, or"
                f" '{_CALLBACK_PREFIX}<Name>' for one callback's state (its class name or state key)."
                " The model's own weights are always loaded: for a run that loads the weights only, use"
                " `warm_start=PATH`."
            )
    return tuple(dict.fromkeys(given))


def _callback_name(part: str) -> str:
    return part[len(_CALLBACK_PREFIX) :] if part.startswith(_CALLBACK_PREFIX) else ""


def drop_parts(checkpoint: MutableMapping[str, Any], parts: tuple[str, ...], path: str) -> list[str]:
    """Remove ``parts`` from the Lightning ``checkpoint`` dict, so the Trainer does not restore them.

    ``optimizer_states`` must already have been left out of the load itself (nothing to remove here);
    ``lr_schedulers`` becomes an empty list (Lightning then restores no scheduler and does not raise
    for a checkpoint without any). A part the checkpoint does not hold (a weights-only checkpoint's
    optimizer states) is fine; a named callback it does not hold is an error.

    Returns:
        What was not loaded, in words, one item per part (for one log line).

    Raises:
        CheckpointError: a ``callbacks.<Name>`` that matches no callback state in the checkpoint (the
            message lists those it has).
    """
    dropped = []
    states = checkpoint.get(CALLBACKS) or {}
    for part in parts:
        name = _callback_name(part)
        if name:
            if CALLBACKS in parts:
                continue  # all of them go anyway
            keys = [k for k in states if isinstance(k, str) and (k == name or k.startswith(name + "{"))]
            if not keys:
                have = sorted(map(str, states))
                raise CheckpointError(
                    f"`exclude_from_loading` names the callback {name!r}, but the checkpoint {path!r} holds"
                    f" no state of it (callback states: {have or 'none'}). Name one of those (its class name"
                    f" is enough), or remove {part!r}."
                )
            for key in keys:
                del states[key]
            dropped.append(f"the state of {', '.join(keys)}")
            continue
        key = _KEYS.get(part, part)
        held = part == OPTIMIZER_STATES or bool(checkpoint.get(key))
        if part == LR_SCHEDULERS:
            checkpoint[key] = []
        elif part != OPTIMIZER_STATES:
            checkpoint.pop(key, None)
        dropped.append(PARTS[part] + ("" if held else " (not in the checkpoint)"))
    return dropped
