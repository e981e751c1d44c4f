"""State-dict hooks that save and restore the sharded attributes of a module tree (``docs/hooks.md``).

``register_sharded_state_hooks(module)`` registers four hooks on ``module`` (the *root*), through
``nn.Module``'s public hook APIs. They find the attributes at call time
(:class:`~lightning_sharded._sites.SiteIndex`), so attributes set after ``__init__`` count, and stop at
submodules with their own registration. Loading is collective when values are resharded: the ranks
holding an attribute agree on each attribute's outcome before its copy and after it, so a failure on
one rank is an error on all of them and no rank goes on to another attribute's collective.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch import nn

from lightning_sharded._compat import load_call, running_load
from lightning_sharded._exit import drain_at_exit
from lightning_sharded._fqn import clean_prefix
from lightning_sharded._sites import MARKER, STANDARD_KEYS, SiteIndex
from lightning_sharded.foreign import attach_fused_state
from lightning_sharded.tensors import adapter_for, exchange_codes

__all__ = ["has_sharded_state_hooks", "receiving_full_values", "register_sharded_state_hooks"]

#: Set by :func:`receiving_full_values`: attributes that are ``None`` or absent take full tensors.
_FULL_VALUES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lightning_sharded_full_values", default=False
)

_OK, _MISSING, _INVALID, _FAILED = 1, 2, 3, 4


@contextlib.contextmanager
def receiving_full_values() -> Iterator[None]:
    """Within this context, a load gives a key's tensor to the attribute it names when that is ``None``.

    For a load in one plain process (``ShardedStateMixin.load_from_checkpoint``): an attribute that
    becomes a ``DTensor`` in ``configure_model`` under a strategy is still ``None`` (or not set) there,
    and receives the full tensor of the checkpoint. Strict loading is otherwise unchanged.
    """
    token = _FULL_VALUES.set(True)
    try:
        yield
    finally:
        _FULL_VALUES.reset(token)


class _Hook:
    """One of a root's four hooks: they share its :class:`_HookState`."""

    def __init__(self, shared: _HookState) -> None:
        self.shared = shared


class _StateDictPreHook(_Hook):
    """Remembers ``keep_vars`` for the post-hook, which torch does not give it."""

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        attach_fused_state(module)  # TorchRec's fused optimizer state becomes sharded attributes
        stack = self.shared.keep_vars
        caller = sys._getframe(1)  # the nn.Module.state_dict call of `module`; the post-hook sees it too
        if stack:
            # A nested call, or what a call that raised left behind: drop the entries of finished calls.
            # An entry with this call's own frame id is one of them too: a finished frame's memory can
            # hold this new frame, and no frame runs this hook twice.
            live: set[int] = set()
            frame: FrameType | None = caller
            while frame is not None:
                live.add(id(frame))
                frame = frame.f_back
            stack[:] = [entry for entry in stack if entry[0] in live and entry[0] != id(caller)]
        stack.append((id(caller), keep_vars))


class _StateDictHook(_Hook):
    def __call__(
        self, module: nn.Module, destination: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
    ) -> None:
        keep_vars = self.shared.pop_keep_vars(id(sys._getframe(1)))
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


class _LoadPreHook(_Hook):
    """Loads every sharded attribute from the state dict, agreed with the other ranks that hold it."""

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
        _, assign, whole = load_call(sys._getframe(1))
        attach_fused_state(module)
        assign = assign or bool(local_metadata.get("assign_to_params_buffers", False))
        # A wrapper above the root (torch.compile, DDP) puts its part in `prefix`, but torch's
        # set_model_state_dict hands sharded attributes over under their clean FQN: such a key is
        # only in the caller's whole state dict, already reported unexpected by the wrapper.
        outer = clean_prefix(prefix)
        stopped = False
        for site in self.shared.index.find(module):
            source = state_dict
            key = _key_of(state_dict, prefix, site.key, site.clean_key)
            if key is None and outer != prefix and isinstance(whole, dict):
                key = _key_of(whole, outer, site.key, site.clean_key)
                if key is not None:
                    source = whole
                    with contextlib.suppress(ValueError):
                        unexpected_keys.remove(key)
            if stopped:  # a copy failed on some rank: every rank stops loading, keys are still consumed
                if key is not None:
                    source.pop(key)
                continue
            shown = key if key is not None else prefix + site.key
            if key is None:
                missing_keys.append(shown)
            value = source.pop(key) if key is not None else _ABSENT  # popped: never reported unexpected
            stopped = not _load_one(site.module, site.name, shown, value, assign, error_msgs)


#: The value of a sharded attribute the state dict does not have.
_ABSENT = object()


def _load_one(
    owner: nn.Module, name: str, shown: str, value: Any, assign: bool, error_msgs: list[str]
) -> bool:
    """Load ``value`` (:data:`_ABSENT`: missing) into ``owner.<name>``, agreed with the other ranks that
    hold the attribute; ``False`` if its copy failed on some rank (every rank then stops loading)."""
    target = owner.__dict__[name]
    error = None if value is _ABSENT else _check(target, shown, value)
    code = _MISSING if value is _ABSENT else _INVALID if error is not None else _OK
    codes = exchange_codes(target, code)  # one decision for every rank that holds the attribute
    invalid = sorted(rank for rank, c in codes.items() if c == _INVALID)
    missing = sorted(rank for rank, c in codes.items() if c == _MISSING)
    if invalid:
        elsewhere = f'The sharded attribute "{shown}" could not be loaded on rank(s) {invalid}'
        error_msgs.append(error or elsewhere + " (see their error); no rank loaded it.")
        return True
    if missing:
        if len(missing) < len(codes):
            error_msgs.append(
                f'The state dict has the sharded attribute "{shown}" on some ranks only (missing on'
                f" rank(s) {missing}); no rank loaded it. Every rank must load the same keys."
            )
        return True
    failure = None
    try:
        if assign and adapter_for(value) is not None:  # assigned; else copied into the attribute
            setattr(owner, name, value)
        else:
            adapter = adapter_for(target)
            assert adapter is not None  # _check passed
            adapter.copy_into(target, value)
    except Exception as ex:
        failure = (
            f'While copying the sharded attribute named "{shown}" ({type(target).__name__}), an'
            f" exception occurred: {ex!r}."
        )
    failed = sorted(
        rank for rank, c in exchange_codes(target, _FAILED if failure else _OK).items() if c == _FAILED
    )
    if not failed:
        return True
    failure = (
        failure or f'Copying the sharded attribute "{shown}" failed on rank(s) {failed} (see their error).'
    )
    error_msgs.append(
        failure + " Every rank stopped loading sharded attributes there, before any further collective."
    )
    return False


def _key_of(state_dict: dict[str, Any], prefix: str, raw: str, clean: str) -> str | None:
    """The first spelling of a site's key present in ``state_dict``: the raw key, then the clean FQN."""
    # Per site, per load: no generator object on this path.
    for key in (prefix + raw, prefix + clean):
        if key in state_dict:
            return key
    return None


class _LoadPostHook(_Hook):
    """Assigns the sharded values torch reported unexpected, where the strictness rule allows
    (``docs/hooks.md``, "What strict loading accepts"; never under ``strict=True`` alone).

    It runs after torch and every submodule's hooks (FSDP's included) took their keys, so only keys no
    one claimed are candidates. Everything it needs comes from the running ``load_state_dict`` call, so
    nothing is kept between hooks (or after an exception).
    """

    def __call__(self, module: nn.Module, incompatible_keys: Any) -> None:
        unexpected: list[str] = incompatible_keys.unexpected_keys
        if not unexpected:
            return
        call = running_load(module, sys._getframe(1))
        if call is None:
            return
        prefix, strict, assign, whole = call
        full_values = _FULL_VALUES.get()
        if strict and not assign and not full_values:
            return
        assigned = set()
        for key in sorted(k for k in unexpected if k.startswith(prefix)):
            value = whole.get(key)
            sharded = adapter_for(value) is not None
            if not (sharded and (assign or not strict)) and not (
                full_values and isinstance(value, torch.Tensor)
            ):
                continue
            target = self.shared.index.owner(module, key[len(prefix) :])
            if target is None:
                continue
            owner, name = target
            if (
                name in owner._parameters
                or name in owner._buffers
                or name in owner._modules
                or name in STANDARD_KEYS  # a checkpoint key never assigns one of them
                or hasattr(type(owner), name)
            ):
                continue
            empty = owner.__dict__.get(name) is None  # not set, or None
            allowed = (
                (sharded and assign)  # assign=True assigns
                or (full_values and empty)  # a plain-process load_from_checkpoint
                or (sharded and not strict and name in owner.__dict__)  # where torch's own hook would
            )
            if allowed:
                setattr(owner, name, value)
                assigned.add(key)
        if assigned:
            unexpected[:] = [key for key in unexpected if key not in assigned]


class _HookState:
    """State the hooks of one root share: the site index and the ``keep_vars`` of running calls."""

    def __init__(self) -> None:
        self.index = SiteIndex()
        self.keep_vars: list[tuple[int, bool]] = []  # (id of the state_dict frame, keep_vars)

    def pop_keep_vars(self, frame_id: int) -> bool:
        """The ``keep_vars`` the pre-hook saw in this call; entries of nested calls that raised go too."""
        stack = self.keep_vars
        for index in range(len(stack) - 1, -1, -1):
            if stack[index][0] == frame_id:
                keep_vars = stack[index][1]
                del stack[index:]
                return keep_vars
        return False

    def __getstate__(self) -> dict[str, Any]:
        return {}  # per-call state and caches are never carried into a copy

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


def _check(target: Any, key: str, value: Any) -> str | None:
    """Why ``value`` cannot load into the sharded attribute ``target`` (torch's wording), or ``None``."""
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
    into the attribute's layout (another layout, or a full ``torch.Tensor``). Keys through wrappers
    (FSDP1, activation checkpointing, ``torch.compile``, DDP) are named as torch names parameters there;
    on load, the clean FQN that ``get_model_state_dict`` gives is accepted too. Idempotent. Also
    registers, once per process, the exit handler that lets gloo's collective threads finish before
    the interpreter shuts down (:mod:`lightning_sharded._exit`), so a model with sharded state under
    any strategy (stock DDP, FSDP, a single device) exits cleanly after its last collective.

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
    # A process group exists or may come (the model is often built before it): harmless without one.
    drain_at_exit()
    if has_sharded_state_hooks(module):
        return module
    shared = _HookState()
    module.register_state_dict_pre_hook(_StateDictPreHook(shared))
    module.register_state_dict_post_hook(_StateDictHook(shared))
    module.register_load_state_dict_pre_hook(_LoadPreHook(shared))
    module.register_load_state_dict_post_hook(_LoadPostHook(shared))
    # object.__setattr__: a plain marker, invisible to nn.Module's parameter/module bookkeeping.
    object.__setattr__(module, MARKER, True)
    return module
