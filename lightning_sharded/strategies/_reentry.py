"""A model object that meets a second Trainer: FSDP1 keeps the wrapper of its first setup (Lightning
#20373: stock wraps the flattened module again); sharding it with the other FSDP is refused. The why and
the rules: ``docs/strategies.md``, "FSDP1 keeps its wrapper".
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from torch import nn

__all__ = ["fsdp1_root", "refuse_fsdp1_for_fsdp2", "refuse_fsdp2_for_fsdp1", "remember_fsdp1_root"]

#: Where a module keeps the FSDP1 wrapper a strategy put around it (an ordinary attribute).
_ATTR = "_lightning_sharded_fsdp1_root"
_NEW_MODEL = (
    " Build a new model for this Trainer (load a checkpoint into it with `ckpt_path=`), or give this"
    " one to a Trainer whose strategy is like the first one's."
)


class _Root:
    """The FSDP1 wrapper around a module and the options it was made with. A copy or a pickle of the
    module holds an empty one: a wrapper belongs to its process and its process group."""

    __slots__ = ("options", "wrapper")

    def __init__(self, wrapper: nn.Module | None, options: Hashable) -> None:
        self.wrapper = wrapper
        self.options = options

    def __reduce__(self) -> tuple[Any, ...]:  # copy.copy and copy.deepcopy use it too
        return (_Root, (None, None))


def remember_fsdp1_root(module: nn.Module, wrapper: nn.Module, options: Hashable) -> None:
    """Keep ``wrapper`` (the FSDP1 root made around ``module`` with ``options``) on ``module``."""
    object.__setattr__(module, _ATTR, _Root(wrapper, options))


def fsdp1_root(module: nn.Module, options: Hashable, strategy: str) -> nn.Module | None:
    """The FSDP1 wrapper an earlier setup put around ``module``, to set up again; ``None`` if none did.

    Raises:
        ValueError: the wrapper was made with other FSDP options (sharding strategy, precision, CPU
            offload, ``use_orig_params``, device, world size) than ``options``: they cannot change on a
            module already wrapped.
    """
    root = module.__dict__.get(_ATTR)
    if (
        not isinstance(root, _Root)
        or root.wrapper is None
        or getattr(root.wrapper, "module", None) is not module
    ):
        return None
    if root.options != options:
        raise ValueError(
            f"`{strategy}`: this model was wrapped by FSDP1 in an earlier Trainer with other options"
            f" ({_describe(root.options)}; now {_describe(options)}); a wrapped model keeps its first"
            f" wrapping.{_NEW_MODEL}"
        )
    _drop_whole_copies(root.wrapper)
    return root.wrapper


def _drop_whole_copies(wrapper: nn.Module) -> None:
    """Free the whole (unsharded) parameters FSDP1 keeps after a forward without backward (an evaluation):
    the root keeps them for a backward, and its next forward uses them instead of gathering the shards.
    A load into the shards in between (this re-entry's) would then be ignored by the forward."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for module in wrapper.modules():
        handle: Any = (
            getattr(module, "_handle", None) if isinstance(module, FullyShardedDataParallel) else None
        )
        needs_unshard = getattr(handle, "needs_unshard", None)  # torch's FlatParamHandle (2.x)
        if needs_unshard is not None and handle.uses_sharded_strategy and not needs_unshard():
            handle.reshard(True)


def _describe(options: Hashable) -> str:
    return ", ".join(str(value) for value in options) if isinstance(options, tuple) else str(options)


def refuse_fsdp2_for_fsdp1(module: nn.Module, strategy: str) -> None:
    """Raise a ``TypeError`` if ``fully_shard`` (FSDP2) was applied to ``module`` or a submodule."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(sub, FSDPModule) for sub in module.modules()):
        raise TypeError(
            f"`{strategy}` (FSDP1) got a model sharded with FSDP2 (`fully_shard`, e.g. by"
            f" `ShardedModelParallelStrategy` in an earlier Trainer); FSDP1 cannot wrap it.{_NEW_MODEL}"
        )


def refuse_fsdp1_for_fsdp2(module: nn.Module, strategy: str) -> None:
    """Raise a ``TypeError`` if ``module`` was wrapped by FSDP1 (its parameters are flat shards)."""
    from torch.distributed.fsdp import FlatParameter, FullyShardedDataParallel

    root = module.__dict__.get(_ATTR)
    wrapped = isinstance(root, _Root) and root.wrapper is not None
    wrapped = wrapped or any(isinstance(sub, FullyShardedDataParallel) for sub in module.modules())
    # FSDP1 marks every parameter it flattened (with or without `use_orig_params`); FSDP2 none.
    flat = any(
        isinstance(p, FlatParameter) or getattr(p, "_fsdp_flattened", False) for p in module.parameters()
    )
    if wrapped or flat:
        raise TypeError(
            "Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel`. The"
            f" `{strategy}` only supports the new FSDP2 APIs in PyTorch >= 2.4: this model was wrapped with"
            " FSDP1 (`FullyShardedDataParallel`, by `ShardedFSDPStrategy` or `FSDPStrategy` in an earlier"
            f" Trainer, or by `configure_model`): its parameters are flat shards now.{_NEW_MODEL}"
            " For FSDP1, use `ShardedFSDPStrategy`."
        )
