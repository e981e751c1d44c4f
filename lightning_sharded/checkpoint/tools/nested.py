"""A sharded checkpoint's flat DCP entries as the nested dict of a full Lightning checkpoint (no torch)."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from typing import Any

from lightning_sharded.checkpoint import names
from lightning_sharded.checkpoint.backends import Location
from lightning_sharded.checkpoint.dcp_index import model_key
from lightning_sharded.checkpoint.errors import CheckpointError

__all__ = ["drop_rank_state", "get_path", "set_path", "to_lightning"]

log = logging.getLogger(__name__)


def to_lightning(
    flat: dict[str, Any], meta: dict[str, Any], path_of: Callable[[str], tuple[Any, ...]], root: Location
) -> dict[str, Any]:
    """DCP's entries (``flat``, by key; ``path_of`` gives each key's path in the state, from DCP's
    ``planner_data``) plus ``meta.pt`` as the dict of a full Lightning checkpoint: the model state under
    ``state_dict``, the optimizers' under ``optimizer_states``, indexed as ``Optimizer.state_dict()``
    numbers parameters."""
    nested: dict[str, Any] = {}
    for key in sorted(flat):
        set_path(nested, path_of(key), flat[key])
    checkpoint = dict(meta)
    checkpoint["state_dict"] = nested.pop(model_key(map(str, nested), root))
    optimizers = sorted((int(m.group(1)), k) for k in nested if (m := names.OPTIMIZER_KEY.match(k)))
    if [i for i, _ in optimizers] != list(range(len(optimizers))):
        raise CheckpointError(
            f"The sharded checkpoint {str(root)!r} has optimizer states"
            f" {[k for _, k in optimizers]}, not numbered 0, 1, ...: one is missing. Restore the"
            " directory from a copy."
        )
    if optimizers:
        checkpoint["optimizer_states"] = [_rekey_optimizer(nested.pop(k), k, root) for _, k in optimizers]
    checkpoint.update(nested)
    return checkpoint


def drop_rank_state(meta: dict[str, Any], root: Location) -> dict[str, Any]:
    """``meta.pt`` without the per-rank state (RNG, data position) a full checkpoint does not keep (rank 0's
    train dataloader state is in the loops, where Lightning keeps it); logs that it was dropped."""
    rank_state = meta.pop(names.RANK_STATE_KEY, None)
    if isinstance(rank_state, dict):
        log.info(
            "%s holds the per-rank state (RNG, train dataloader) of %s rank(s); the output keeps rank 0's"
            " train dataloader state where Lightning keeps it (the loops) and drops the rest, RNG included",
            root,
            rank_state.get("world_size"),
        )
    return meta


def set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = root
    for key, nxt in itertools.pairwise(path):
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def get_path(obj: Any, path: tuple[Any, ...]) -> Any:
    return functools.reduce(lambda node, key: node[key], path, obj)


def _rekey_optimizer(state: Any, key: str, root: Location) -> Any:
    """DCP's optimizer state, keyed by parameter name, to torch's, keyed by index."""
    if not isinstance(state, dict) or "param_groups" not in state:
        return state
    groups = state["param_groups"]
    params = [p for group in groups for p in group.get("params", [])]
    if all(isinstance(p, int) for p in params):
        return state
    index = {name: i for i, name in enumerate(params)}
    unknown = sorted(str(k) for k in state.get("state", {}) if k not in index)
    if unknown:
        raise CheckpointError(
            f"The optimizer state {key!r} of {str(root)!r} has state for {unknown[:3]} that no parameter"
            " group lists: the checkpoint is inconsistent. Load it with the strategy that wrote it."
        )
    return {
        **{k: v for k, v in state.items() if k not in ("state", "param_groups")},
        "state": {index[name]: value for name, value in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [index[p] for p in g.get("params", [])]} for g in groups],
    }
