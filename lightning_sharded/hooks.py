"""State-dict hooks that save and restore the sharded attributes of a module tree.

``register_sharded_state_hooks(module)`` registers four hooks on ``module`` (the *root*), through
``nn.Module``'s public hook APIs:

- a state-dict pre-hook, which only remembers ``keep_vars`` (the post-hook is not given it);
- a state-dict post-hook, which adds every sharded attribute of the tree under the key a parameter
  at that place would have (``prefix`` + path + name), unless the key is already there;
- a load pre-hook, which pops each sharded attribute's key from the state dict and copies the value
  into the attribute, resharding as needed; errors go to ``error_msgs`` like torch's own, absent keys
  to ``missing_keys``. Popping means the key can never be reported as unexpected;
- a load post-hook, which assigns sharded values that no attribute consumed and that torch reported
  as unexpected, to the submodule the key names (as torch's own ShardedTensor hook does), and keeps
  consumed keys out of ``unexpected_keys``.

The hooks find the attributes at call time (:class:`~lightning_sharded._sites.SiteIndex`), so
attributes set after ``__init__`` count, and stop at submodules with their own registration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_sharded._sites import MARKER, SiteIndex, resolve
from lightning_sharded.tensors import adapter_for

__all__ = ["has_sharded_state_hooks", "register_sharded_state_hooks"]


class _StateDictPreHook:
    def __init__(self, shared: _Shared) -> None:
        self.shared = shared

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.shared.keep_vars.append(keep_vars)


class _StateDictHook:
    def __init__(self, shared: _Shared) -> None:
        self.shared = shared

    def __call__(
        self, module: nn.Module, destination: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
    ) -> None:
        stack = self.shared.keep_vars
        keep_vars = stack.pop() if stack else False
        for site in self.shared.index.find(module):
            key = prefix + site.key
            if key in destination:
                continue
            value = site.value
            if not keep_vars:
                adapter = adapter_for(value)
                assert adapter is not None
                value = adapter.detach(value)
            destination[key] = value


@dataclass
class _LoadCall:
    """What the load pre-hook of one ``load_state_dict`` call hands to the post-hook."""

    prefix: str
    consumed: set[str] = field(default_factory=set)
    candidates: dict[str, Any] = field(default_factory=dict)
    assign: bool = False


class _LoadPreHook:
    def __init__(self, shared: _Shared) -> None:
        self.shared = shared

    def __call__(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,  # torch always passes True here, whatever the caller asked for
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        call = _LoadCall(prefix=prefix, assign=bool(local_metadata.get("assign_to_params_buffers", False)))
        self.shared.loads.append(call)
        for site in self.shared.index.find(module):
            key = prefix + site.key
            if key not in state_dict:
                missing_keys.append(key)
                continue
            # Popping keeps the key out of torch's unexpected-key check here and in every submodule.
            value = state_dict.pop(key)
            call.consumed.add(key)
            error = _load_into(site.module, site.name, key, value, assign=call.assign)
            if error is not None:
                error_msgs.append(error)
        # Sharded values that no attribute took: the post-hook assigns those torch found unexpected.
        for key in sorted(state_dict):
            if key.startswith(prefix) and adapter_for(state_dict[key]) is not None:
                call.candidates[key] = state_dict[key]


class _LoadPostHook:
    def __init__(self, shared: _Shared) -> None:
        self.shared = shared

    def __call__(self, module: nn.Module, incompatible_keys: Any) -> None:
        if not self.shared.loads:
            return
        call = self.shared.loads.pop()
        unexpected: list[str] = incompatible_keys.unexpected_keys
        for key in sorted(call.candidates):
            if key not in unexpected:
                continue
            target = resolve(module, key[len(call.prefix) :])
            if target is None:
                continue
            owner, name = target
            if name in owner._parameters or name in owner._buffers or name in owner._modules:
                continue
            setattr(owner, name, call.candidates[key])
            call.consumed.add(key)
        if call.consumed:
            unexpected[:] = [key for key in unexpected if key not in call.consumed]


class _Shared:
    """State the four hooks of one root share: the site index and the per-call stacks."""

    def __init__(self) -> None:
        self.index = SiteIndex()
        self.keep_vars: list[bool] = []
        self.loads: list[_LoadCall] = []

    def __getstate__(self) -> dict[str, Any]:
        return {}  # per-call stacks and caches are never carried into a copy

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


def _load_into(owner: nn.Module, name: str, key: str, value: Any, assign: bool) -> str | None:
    """Load ``value`` into the sharded attribute ``owner.<name>``; an error message, or ``None``."""
    target = owner.__dict__[name]
    adapter = adapter_for(target)
    assert adapter is not None
    if not isinstance(value, torch.Tensor):
        return (
            f'While copying the sharded attribute named "{key}", expected torch.Tensor or a sharded tensor'
            f" from checkpoint but received {type(value).__name__}"
        )
    source = adapter_for(value)
    shape = source.global_shape(value) if source is not None else value.shape
    dtype = source.dtype(value) if source is not None else value.dtype
    if shape != adapter.global_shape(target):
        return (
            f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, "
            f"the shape in current model is {adapter.global_shape(target)}."
        )
    if dtype != adapter.dtype(target):
        return (
            f"dtype mismatch for {key}: copying a param with dtype {dtype} from checkpoint, "
            f"the dtype in current model is {adapter.dtype(target)}."
        )
    if assign and source is not None:
        setattr(owner, name, value)
        return None
    try:
        adapter.copy_into(target, value)
    except Exception as ex:
        return (
            f'While copying the sharded attribute named "{key}" ({adapter.name}, global shape '
            f"{tuple(shape)}), an exception occurred: {ex!r}."
        )
    return None


def has_sharded_state_hooks(module: nn.Module) -> bool:
    """Whether :func:`register_sharded_state_hooks` was called on ``module`` (or on a copy of it)."""
    return MARKER in vars(module) and any(
        isinstance(hook, _StateDictHook) for hook in module._state_dict_hooks.values()
    )


def register_sharded_state_hooks(module: nn.Module) -> nn.Module:
    """Make ``module.state_dict()`` and ``module.load_state_dict()`` include its sharded attributes.

    A sharded attribute is a ``DTensor`` or legacy ``ShardedTensor`` held as a plain attribute of
    ``module`` or of any submodule (not an ``nn.Parameter`` or buffer). It is saved under the key a
    parameter at that place would have, and on load it is copied in place (same layout) or resharded
    into the attribute's layout (another layout, or a full ``torch.Tensor``). Idempotent.

    Args:
        module: the root of the tree; the hooks walk the tree at every call, so attributes set later
            (in ``configure_model``, say) count.

    Returns:
        ``module`` itself.

    Example::

        >>> import torch
        >>> from lightning_sharded import register_sharded_state_hooks
        >>> model = register_sharded_state_hooks(torch.nn.Linear(2, 2))
        >>> sorted(model.state_dict())  # nothing changes for a module without sharded attributes
        ['bias', 'weight']
    """
    if has_sharded_state_hooks(module):
        return module
    shared = _Shared()
    module.register_state_dict_pre_hook(_StateDictPreHook(shared))
    module.register_state_dict_post_hook(_StateDictHook(shared))
    module.register_load_state_dict_pre_hook(_LoadPreHook(shared))
    module.register_load_state_dict_post_hook(_LoadPostHook(shared))
    # object.__setattr__: a plain marker, invisible to nn.Module's parameter/module bookkeeping.
    object.__setattr__(module, MARKER, True)
    return module
