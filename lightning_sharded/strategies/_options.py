"""The checkpoint options both strategies take: each declared once here, with its default and its check.

The strategies take them as keyword arguments; their signatures (``inspect.signature``, ``help()``,
Lightning's CLI) show them after the parent strategy's parameters (:func:`show_options`), and static tools
(Pylance, PyCharm, mypy) read them from :class:`CheckpointOptionsKwargs` (PEP 692): mypy checks them
for ``ShardedModelParallelStrategy``; for ``ShardedFSDPStrategy`` they are hints only (its overload for
FSDP's own keywords takes ``**Any``).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypedDict

from lightning_sharded.checkpoint.backends import absolute, location
from lightning_sharded.checkpoint.integrity import VerifyMode, verify_mode
from lightning_sharded.checkpoint.load.parts import check_parts

__all__ = [
    "DEFAULT_CHECKPOINT_TIMEOUT",
    "CheckpointOptions",
    "CheckpointOptionsKwargs",
    "StateDictType",
    "show_options",
]

StateDictType = Literal["sharded", "full"]
#: The default ``checkpoint_timeout``: 5 minutes. It bounds how long the fastest rank waits for the
#: slowest at one step of a save or a load (rank 0's write of a full checkpoint included), not the
#: whole save.
DEFAULT_CHECKPOINT_TIMEOUT = 300.0


def _as_location(path: str | os.PathLike[str] | None) -> str | None:
    """A local path made absolute (so a checkpoint names it wherever it is read from), a URL as is."""
    return None if path is None else str(absolute(location(path)))


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """The checkpoint options of :class:`~lightning_sharded.ShardedFSDPStrategy` and
    :class:`~lightning_sharded.ShardedModelParallelStrategy`, checked when the strategy is made.

    The strategy keeps each as an attribute of the same name (``state_dict_type`` as
    ``_sharded_state_dict_type``), with ``verify`` as its mode (``None``, ``"before"`` or ``"during"``).
    """

    state_dict_type: StateDictType = "sharded"
    """``"sharded"`` writes a directory of shards per checkpoint (readable by stock ``FSDPStrategy`` and
    ``ModelParallelStrategy``); ``"full"`` one ``torch.save`` file that plain ``torch.load`` and a
    single-device Trainer read."""
    async_save: bool = False
    """``save_checkpoint`` returns once the state is copied to host memory; the write and the atomic
    publish run in the background (sharded only; see ``docs/async-save.md``). The next save, a load and
    the end of training wait for it and raise its error, if any."""
    verify: bool | VerifyMode = False
    """On a load, compare every file's CRC-32 with the manifest (presence and sizes are always checked).
    ``True`` or ``"before"``: nothing of a damaged checkpoint is loaded (local files: the model's values
    are read beside it, checked from the reads, then copied in; object storage: every file checksummed
    before the first read). ``"during"``: from the load's own reads, straight into the model; a damaged
    file then fails the resume after its tensors were read (see ``docs/checkpoint-format.md``)."""
    save_rank_state: bool = True
    """Save each rank's RNG states, train dataloader state and generators, and the objects registered
    with ``register_rank_state``, with every checkpoint, so a resume at the same world size continues
    exactly from any point (see ``docs/checkpoint-format.md``)."""
    warm_start: str | os.PathLike[str] | None = None
    """A checkpoint (sharded directory or full file) whose model state a ``fit`` without ``ckpt_path``
    starts from; the optimizers, LR schedulers, loops and step count start fresh. A ``fit`` that resumes
    (``ckpt_path``) ignores it, so a run configured with both resumes itself after a crash."""
    exclude_from_loading: Sequence[str] = ()
    """Parts of a checkpoint a resume leaves out, by their Lightning checkpoint key:
    ``"optimizer_states"``, ``"lr_schedulers"``, ``"loops"``, ``"callbacks"``, ``"callbacks.<Name>"``
    (one callback), ``"rank_state"``; one line says what was left out."""
    save_trainable_only: bool = False
    """Save only the parameters with ``requires_grad`` (and buffers, sharded attributes and everything
    else); the checkpoint names ``frozen_source`` as where a load reads the frozen parameters from."""
    frozen_source: str | os.PathLike[str] | None = None
    """The weights the frozen parameters were loaded from (a Hugging Face directory, a full or a sharded
    checkpoint); required with ``save_trainable_only``. On a load it overrides the source a
    trainable-only checkpoint names."""
    frozen_prefix: str = ""
    """The part of the frozen parameters' keys the source's keys lack (``"model."``)."""
    checkpoint_timeout: float | None = DEFAULT_CHECKPOINT_TIMEOUT
    """Seconds a rank waits for the others at a step of a save or a load (its collectives run on a gloo
    group of their own with this timeout) before it fails with a ``CheckpointError`` naming the ranks
    that did not come; ``None``: the process group's own timeout (30 minutes)."""
    check_space: bool = True
    """Refuse a local save before writing anything when its estimated size (plus a margin) does not fit
    in the free space of its filesystem (see ``docs/troubleshooting.md``)."""

    def __post_init__(self) -> None:
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(  # stock's words first (it raises them at save time; this is at construction)
                f"Unknown state_dict_type: {self.state_dict_type}. Choose 'sharded' (a directory) or 'full'"
                " (one file)."
            )
        if self.async_save and self.state_dict_type != "sharded":
            raise ValueError(
                "`async_save=True` needs `state_dict_type='sharded'`: a full checkpoint is gathered on rank 0"
                " and written by it alone. Save sharded, or set `async_save=False`."
            )
        verify_mode(self.verify)  # a value that is not a mode fails here, not at the first resume
        check_parts(self.exclude_from_loading)
        if self.save_trainable_only and self.frozen_source is None:
            raise ValueError(
                "`save_trainable_only=True` needs `frozen_source`: the weights the frozen parameters were"
                " loaded from (a Hugging Face directory, a full or a sharded checkpoint), which a load of"
                " such a checkpoint reads them from. Pass `frozen_source=PATH` (and `frozen_prefix=` if the"
                " module holds those weights under a prefix, such as 'model.')."
            )
        if self.checkpoint_timeout is not None and not self.checkpoint_timeout > 0:
            raise ValueError(
                f"`checkpoint_timeout={self.checkpoint_timeout!r}`: give the seconds a rank waits for the"
                " others at a step of a save or a load (a positive number), or None for the process group's"
                " own timeout."
            )

    @classmethod
    def take(cls, kwargs: dict[str, Any]) -> CheckpointOptions:
        """The options among a strategy's ``kwargs``, taken out of them and checked."""
        return cls(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(cls) if f.name in kwargs})

    def apply(self, strategy: Any) -> None:
        """Set the options on ``strategy`` as its attributes, in their one internal spelling."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        values.update(
            _sharded_state_dict_type=values.pop("state_dict_type"),
            verify=verify_mode(self.verify),
            exclude_from_loading=check_parts(self.exclude_from_loading),
            warm_start=_as_location(self.warm_start),
            frozen_source=_as_location(self.frozen_source),
        )
        for name, value in values.items():
            setattr(strategy, name, value)


class CheckpointOptionsKwargs(TypedDict, total=False):
    """:class:`CheckpointOptions` as the strategies' ``**options`` (``Unpack``), for static tools, which
    read no ``__signature__``; tests/strategies/test_signatures.py holds it to the dataclass's fields."""

    state_dict_type: StateDictType
    async_save: bool
    verify: bool | VerifyMode
    save_rank_state: bool
    warm_start: str | os.PathLike[str] | None
    exclude_from_loading: Sequence[str]
    save_trainable_only: bool
    frozen_source: str | os.PathLike[str] | None
    frozen_prefix: str
    checkpoint_timeout: float | None
    check_space: bool


def show_options(
    init: Callable[..., None], parent: Callable[..., None] | None = None, **defaults: Any
) -> None:
    """Give ``init`` (a strategy's ``__init__``) the signature users see: its named parameters (with
    ``*args``, the ``parent``'s, and its ``**kwargs``), then the options of :class:`CheckpointOptions` not
    among them, keyword-only. ``defaults`` replace defaults."""
    own = list(inspect.signature(init).parameters.values())
    if parent is not None and any(p.kind is p.VAR_POSITIONAL for p in own):
        own = [own[0], *[p for p in inspect.signature(parent).parameters.values() if p.name != "self"]]
    else:  # its own `**options` are the options below
        own = [p for p in own if p.kind is not p.VAR_KEYWORD]
    params = [p for p in own if p.kind is not p.VAR_KEYWORD]
    params += [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(CheckpointOptions)
        if f.name not in {p.name for p in params}
    ]
    params = [p.replace(default=defaults[p.name]) if p.name in defaults else p for p in params]
    rest = [p for p in own if p.kind is p.VAR_KEYWORD]
    init.__signature__ = inspect.Signature(params + rest, return_annotation=None)  # type: ignore[attr-defined]
