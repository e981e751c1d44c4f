"""Random module trees with sharded attributes, and the round-trip properties the hooks must keep.

Shared by the in-process tests (world size 1) and the two-process script (world size 2): every
function here is deterministic given its arguments, so ranks that draw the same hypothesis examples
build the same trees and issue the same collectives.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

from lightning_sharded import register_sharded_state_hooks
from lightning_sharded.tensors import adapter_for, to_full
from tests._compare import assert_same

DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64)


@dataclass(frozen=True)
class AttrSpec:
    """A sharded attribute: its kind ("dtensor" or "sharded_tensor"), layout and value."""

    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: int | None  # DTensor: Shard(dim) or None for Replicate; ShardedTensor: chunk dim
    seed: int


@dataclass
class NodeSpec:
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    buffers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    attrs: dict[str, AttrSpec] = field(default_factory=dict)
    children: dict[str, NodeSpec] = field(default_factory=dict)


_names = st.text(alphabet="abcdefgh", min_size=1, max_size=3).map(lambda s: "n_" + s)
shapes = st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple)


@st.composite
def attr_specs(draw: Any, kinds: tuple[str, ...] = ("dtensor", "sharded_tensor")) -> AttrSpec:
    kind = draw(st.sampled_from(kinds))
    shape = draw(shapes)
    dim = draw(st.integers(0, len(shape) - 1))
    placement: int | None = dim
    if kind == "dtensor" and draw(st.booleans()):
        placement = None
    return AttrSpec(kind, shape, draw(st.sampled_from(DTYPES)), placement, draw(st.integers(0, 2**16)))


@st.composite
def node_specs(draw: Any, depth: int = 2, sharded: bool = True) -> NodeSpec:
    names = draw(st.lists(_names, unique=True, max_size=6))
    node = NodeSpec()
    for name in names:
        choice = draw(
            st.sampled_from(["param", "buffer", "attr", "child"] if sharded else ["param", "buffer", "child"])
        )
        if choice == "child" and depth == 0:
            choice = "param"
        if choice == "param":
            node.params[name] = draw(shapes)
        elif choice == "buffer":
            node.buffers[name] = draw(shapes)
        elif choice == "attr":
            node.attrs[name] = draw(attr_specs())
        else:
            node.children[name] = draw(node_specs(depth=depth - 1, sharded=sharded))
    return node


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def make_value(spec: AttrSpec, offset: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(spec.seed + offset)
    if spec.dtype == torch.int64:
        return torch.randint(-1000, 1000, spec.shape, generator=gen)
    return torch.randn(spec.shape, generator=gen, dtype=torch.float64).to(spec.dtype)


def make_sharded(spec: AttrSpec, full: torch.Tensor) -> Any:
    _, world_size = world()
    if spec.kind == "dtensor":
        mesh = init_device_mesh("cpu", (world_size,))
        placements = [Replicate()] if spec.placement is None else [Shard(spec.placement)]
        return distribute_tensor(full, mesh, placements, src_data_rank=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from torch.distributed._shard import sharded_tensor
        from torch.distributed._shard.sharding_spec import ChunkShardingSpec

        sharding = ChunkShardingSpec(
            dim=spec.placement or 0, placements=[f"rank:{r}/cpu" for r in range(world_size)]
        )
        value = sharded_tensor.zeros(sharding, *spec.shape, dtype=spec.dtype)
        adapter = adapter_for(value)
        assert adapter is not None
        adapter.copy_into(value, full)
        return value


def build(spec: NodeSpec, offset: int = 0, hooks: bool = True) -> nn.Module:
    """The module tree of ``spec``; ``offset`` changes every value (a "different" model)."""

    def make(node: NodeSpec, salt: int) -> nn.Module:
        module = nn.Module()
        for i, (name, shape) in enumerate(sorted(node.params.items())):
            gen = torch.Generator().manual_seed(salt * 31 + i + offset)
            module.register_parameter(name, nn.Parameter(torch.randn(shape, generator=gen)))
        for i, (name, shape) in enumerate(sorted(node.buffers.items())):
            gen = torch.Generator().manual_seed(salt * 37 + i + offset)
            module.register_buffer(name, torch.randn(shape, generator=gen))
        for name, attr in sorted(node.attrs.items()):
            setattr(module, name, make_sharded(attr, make_value(attr, offset)))
        for j, (name, child) in enumerate(sorted(node.children.items())):
            module.add_module(name, make(child, salt * 7 + j + 1))
        return module

    root = make(spec, 1)
    return register_sharded_state_hooks(root) if hooks else root


def sharded_keys(spec: NodeSpec, prefix: str = "") -> dict[str, AttrSpec]:
    keys = {prefix + name: attr for name, attr in spec.attrs.items()}
    for name, child in spec.children.items():
        keys.update(sharded_keys(child, f"{prefix}{name}."))
    return keys


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of the state dict as a full tensor (collective for sharded values), sorted by key."""
    state = module.state_dict()
    return {key: to_full(state[key]) for key in sorted(state)}


def local_shards(value: Any) -> list[torch.Tensor]:
    if isinstance(value, DTensor):
        return [value.to_local()]
    return [shard.tensor for shard in value.local_shards()]


def digest(state: dict[str, torch.Tensor]) -> str:
    """A hash of keys and values, to compare results across ranks."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].contiguous().view(torch.uint8).numpy().tobytes() if state[key].numel() else b"")
    return h.hexdigest()


# ---- the properties -------------------------------------------------------------------------------


def prop_round_trip(spec: NodeSpec) -> str:
    """save then load into a different model restores every value exactly."""
    source, target = build(spec), build(spec, offset=1000)
    saved = full_state(source)
    result = target.load_state_dict(source.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert_same(full_state(target), saved, ordered=True)
    return digest(saved)


def prop_full_tensor_load(spec: NodeSpec) -> str:
    """loading full tensors gives the same local shards as distributing them."""
    source, target = build(spec), build(spec, offset=1000)
    full = full_state(source)
    target.load_state_dict(full)
    keys = sharded_keys(spec)
    for key in sorted(keys):
        got, expected = _attr(target, key), _attr(source, key)
        for a, b in zip(local_shards(got), local_shards(expected), strict=True):
            assert torch.equal(a, b), key
    return digest(full)


def prop_relayout(spec: NodeSpec, other: NodeSpec) -> str:
    """loading layout A into layout B (same global shapes and dtypes) gives the same global values."""
    source, target = build(spec), build(other, offset=1000)
    target.load_state_dict(source.state_dict())
    got, expected = full_state(target), full_state(source)
    assert_same(got, expected, ordered=True)
    return digest(got)


def prop_strict(spec: NodeSpec, drop: list[str], extra: bool) -> str:
    """strict loading passes exactly when the key sets match; non-strict reports the difference."""
    source, target = build(spec), build(spec, offset=1000)
    state = source.state_dict()
    for key in drop:
        del state[key]
    if extra:
        state["n_unexpected_key"] = torch.zeros(1)
    should_pass = not drop and not extra
    try:
        target.load_state_dict(dict(state), strict=True)
        passed = True
    except RuntimeError as err:
        passed = False
        for key in drop:
            assert key in str(err)
    assert passed == should_pass
    result = target.load_state_dict(dict(state), strict=False)
    assert sorted(result.missing_keys) == sorted(drop)
    assert result.unexpected_keys == (["n_unexpected_key"] if extra else [])
    return digest(full_state(target))


def prop_no_sharded_no_change(spec: NodeSpec) -> str:
    """a tree without sharded attributes has the same state dict with and without the hooks."""
    plain, hooked = build(spec, hooks=False), build(spec)
    a, b = plain.state_dict(), hooked.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key])
    return digest(dict(b))


def _attr(root: nn.Module, key: str) -> Any:
    *path, name = key.split(".")
    module = root
    for part in path:
        module = getattr(module, part)
    return module.__dict__[name]


def relayout(spec: NodeSpec, choices: list[int]) -> NodeSpec:
    """The same tree with other layouts for its sharded attributes, picked by ``choices``."""
    counter = iter(choices * 1000)

    def walk(node: NodeSpec) -> NodeSpec:
        attrs = {}
        for name, attr in sorted(node.attrs.items()):
            pick = next(counter)
            kind = ("dtensor", "sharded_tensor")[pick % 2]
            dim = (pick // 2) % len(attr.shape)
            placement = None if (kind == "dtensor" and pick % 3 == 0) else dim
            attrs[name] = AttrSpec(kind, attr.shape, attr.dtype, placement, attr.seed)
        return NodeSpec(
            dict(node.params),
            dict(node.buffers),
            attrs,
            {name: walk(child) for name, child in sorted(node.children.items())},
        )

    return walk(spec)
