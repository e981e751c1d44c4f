"""Unit tests of the sharded state-dict hooks (world size 1, in process)."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

from lightning_sharded import has_sharded_state_hooks, register_sharded_state_hooks

pytestmark = pytest.mark.usefixtures("process_group")


def dt(value: torch.Tensor, placement: Any = None) -> DTensor:
    mesh = init_device_mesh("cpu", (1,))
    return distribute_tensor(value, mesh, [placement or Shard(0)])


def sharded_tensor(value: torch.Tensor) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from torch.distributed._shard import sharded_tensor as st
        from torch.distributed._shard.sharding_spec import ChunkShardingSpec

        out = st.zeros(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), *value.shape, dtype=value.dtype)
    out.local_shards()[0].tensor.copy_(value)
    return out


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.table = dt(torch.arange(12.0).reshape(4, 3))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(2, 1)
        self.cache: Any = None  # set later, as in configure_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner.lin(x + self.inner.table.to_local().sum()))


def model() -> Model:
    return register_sharded_state_hooks(Model())  # type: ignore[return-value]


def full(value: Any) -> torch.Tensor:
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value.local_shards()[0].tensor


def test_state_dict_has_the_attribute_under_its_parameter_key() -> None:
    m = model()
    assert list(m.state_dict()) == [
        "inner.lin.weight",
        "inner.lin.bias",
        "head.weight",
        "head.bias",
        "inner.table",
    ]
    assert list(m.state_dict(prefix="outer."))[-1] == "outer.inner.table"


def test_attribute_set_after_registration_counts() -> None:
    m = model()
    m.state_dict()  # warm the cache, then change the tree
    m.cache = dt(torch.ones(5), Replicate())
    assert "cache" in m.state_dict()
    m.cache = None
    assert "cache" not in m.state_dict()
    m.head.extra = dt(torch.ones(2))
    assert "head.extra" in m.state_dict()
    m.head = nn.Linear(2, 1)
    assert "head.extra" not in m.state_dict()


def test_keep_vars() -> None:
    m = model()
    m.inner.table.requires_grad_(True)
    assert m.state_dict(keep_vars=True)["inner.table"] is m.inner.table
    detached = m.state_dict()["inner.table"]
    assert not detached.requires_grad
    assert detached.to_local().data_ptr() == m.inner.table.to_local().data_ptr()


def test_load_copies_in_place_and_strict_passes() -> None:
    source, target = model(), model()
    with torch.no_grad():
        source.inner.table.mul_(-1)
    before = target.inner.table
    assert str(target.load_state_dict(source.state_dict())) == "<All keys matched successfully>"
    assert target.inner.table is before
    assert torch.equal(full(target.inner.table), full(source.inner.table))


def test_full_tensor_is_resharded() -> None:
    target = model()
    state = target.state_dict()
    state["inner.table"] = torch.full((4, 3), 7.0)
    target.load_state_dict(state)
    assert torch.equal(full(target.inner.table), torch.full((4, 3), 7.0))


def test_missing_key_strict_and_not() -> None:
    m = model()
    state = m.state_dict()
    del state["inner.table"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "inner.table"'):
        m.load_state_dict(state)
    assert m.load_state_dict(state, strict=False).missing_keys == ["inner.table"]


def test_size_mismatch_message() -> None:
    m = model()
    state = m.state_dict()
    state["inner.table"] = torch.zeros(5, 3)
    with pytest.raises(
        RuntimeError,
        match=r"size mismatch for inner.table: copying a param with shape "
        r"torch.Size\(\[5, 3\]\) from checkpoint, the shape in current model is "
        r"torch.Size\(\[4, 3\]\)",
    ):
        m.load_state_dict(state)


def test_dtype_mismatch_message() -> None:
    m = model()
    state = m.state_dict()
    state["inner.table"] = torch.zeros(4, 3, dtype=torch.int64)
    with pytest.raises(
        RuntimeError,
        match=r"dtype mismatch for inner.table: copying a param with dtype "
        r"torch.int64 from checkpoint, the dtype in current model is torch.float32",
    ):
        m.load_state_dict(state)


def test_not_a_tensor_message() -> None:
    m = model()
    state = m.state_dict()
    state["inner.table"] = [1, 2]
    with pytest.raises(RuntimeError, match=r'sharded attribute named "inner.table", expected torch.Tensor'):
        m.load_state_dict(state)


def test_unexpected_keys_still_reported() -> None:
    m = model()
    state = m.state_dict()
    state["inner.nope"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "inner.nope"'):
        m.load_state_dict(state)
    assert m.load_state_dict(state, strict=False).unexpected_keys == ["inner.nope"]


def test_assign_true_assigns_the_sharded_value() -> None:
    source, target = model(), model()
    state = source.state_dict()
    value = state["inner.table"]
    target.load_state_dict(state, assign=True)
    assert target.inner.table is value


def test_strict_load_refuses_a_sharded_value_the_model_does_not_have() -> None:
    source = model()
    source.head.new_table = dt(torch.ones(3))  # a renamed or stale attribute: the target has none
    source.cache = dt(torch.ones(2))  # the target's cache is None
    state = source.state_dict()
    target = model()
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "cache", "head.new_table"'):
        target.load_state_dict(state)
    assert target.cache is None and "new_table" not in vars(target.head)


def test_non_strict_load_assigns_where_torch_would() -> None:
    # strict=False: as torch's own ShardedTensor hook, only to an attribute the module already has.
    source = model()
    source.head.new_table = dt(torch.ones(3))
    source.cache = dt(torch.ones(2))
    target = model()
    result = target.load_state_dict(source.state_dict(), strict=False)
    assert result.unexpected_keys == ["head.new_table"]
    assert "new_table" not in vars(target.head)
    assert torch.equal(full(target.cache), torch.ones(2))


def test_assign_true_assigns_a_sharded_value_the_model_does_not_have() -> None:
    source = model()
    source.head.new_table = dt(torch.ones(3))
    state = source.state_dict()
    target = model()
    assert str(target.load_state_dict(state, assign=True)) == "<All keys matched successfully>"
    assert target.head.new_table is state["head.new_table"]


def test_a_sharded_value_never_replaces_a_submodule_or_buffer() -> None:
    state = model().state_dict()
    state["inner"] = dt(torch.ones(2))  # a submodule's name
    target = model()
    target.head.register_buffer("stats", torch.zeros(2))
    state["head.stats"] = torch.zeros(2)
    state["head.stats.x"] = dt(torch.ones(2))  # below a buffer: no module there
    result = target.load_state_dict(state, strict=False, assign=True)
    assert sorted(result.unexpected_keys) == ["head.stats.x", "inner"]
    assert isinstance(target.inner, nn.Module)


def test_full_tensor_without_attribute_stays_unexpected() -> None:
    m = model()
    state = m.state_dict()
    state["head.plain"] = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"head\.plain"):
        m.load_state_dict(state)


def test_sharded_tensor_attribute() -> None:
    source, target = model(), model()
    source.inner.st = sharded_tensor(torch.arange(6.0))
    target.inner.st = sharded_tensor(torch.zeros(6))
    state = source.state_dict()
    assert "inner.st" in state
    target.load_state_dict(state)
    assert torch.equal(full(target.inner.st), torch.arange(6.0))
    # A DTensor value into a ShardedTensor attribute, and the reverse.
    state["inner.st"] = dt(torch.full((6,), 3.0))
    state["inner.table"] = sharded_tensor(torch.full((4, 3), 2.0))
    target.load_state_dict(state)
    assert torch.equal(full(target.inner.st), torch.full((6,), 3.0))
    assert torch.equal(full(target.inner.table), torch.full((4, 3), 2.0))


def test_no_sharded_attribute_state_dict_unchanged() -> None:
    plain = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    hooked = register_sharded_state_hooks(copy.deepcopy(plain))
    a, b = plain.state_dict(), hooked.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None)


def test_double_registration_is_idempotent() -> None:
    m = model()
    hooks = (len(m._state_dict_hooks), len(m._load_state_dict_pre_hooks), len(m._load_state_dict_post_hooks))
    assert register_sharded_state_hooks(m) is m
    assert (
        len(m._state_dict_hooks),
        len(m._load_state_dict_pre_hooks),
        len(m._load_state_dict_post_hooks),
    ) == hooks
    keys = list(m.state_dict())
    assert len(keys) == len(set(keys))


def test_submodule_with_its_own_registration() -> None:
    m = Model()
    register_sharded_state_hooks(m.inner)
    register_sharded_state_hooks(m)
    state = m.state_dict()
    assert list(state).count("inner.table") == 1
    assert str(m.load_state_dict(state)) == "<All keys matched successfully>"
    del state["inner.table"]
    assert m.load_state_dict(state, strict=False).missing_keys == ["inner.table"]


def test_nested_in_parent_with_prefix() -> None:
    parent = nn.ModuleDict({"body": model()})
    state = parent.state_dict()
    assert "body.inner.table" in state
    state["body.inner.table"] = torch.full((4, 3), 5.0)
    assert str(parent.load_state_dict(state)) == "<All keys matched successfully>"
    assert torch.equal(full(parent["body"].inner.table), torch.full((4, 3), 5.0))


def test_deepcopy_keeps_hooks_and_follows_the_copy() -> None:
    m = model()
    m.state_dict()  # the cache now points at m's modules
    clone = copy.deepcopy(m)
    assert has_sharded_state_hooks(clone)
    with torch.no_grad():
        clone.inner.table.fill_(9.0)
    assert torch.equal(full(clone.state_dict()["inner.table"]), torch.full((4, 3), 9.0))
    assert not torch.equal(full(m.state_dict()["inner.table"]), torch.full((4, 3), 9.0))


def test_pickle_round_trip() -> None:
    m = model()
    m.state_dict()
    clone = pickle.loads(pickle.dumps(m))
    assert has_sharded_state_hooks(clone)
    assert torch.equal(full(clone.state_dict()["inner.table"]), full(m.inner.table))
    clone.load_state_dict(m.state_dict())


def test_torch_compile() -> None:
    m = model()
    compiled = torch.compile(m, backend="eager")
    x = torch.ones(2, 3)
    assert torch.equal(compiled(x), m(x))
    state = compiled.state_dict()
    assert "_orig_mod.inner.table" in state
    state["_orig_mod.inner.table"] = torch.full((4, 3), 2.0)
    compiled.load_state_dict(state)
    assert torch.equal(full(m.inner.table), torch.full((4, 3), 2.0))


def test_dcp_save_and_load(tmp_path: Any) -> None:
    source, target = model(), model()
    with torch.no_grad():
        source.inner.table.add_(100)
    dcp.save(source.state_dict(), checkpoint_id=tmp_path)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=tmp_path)
    target.load_state_dict(state)
    assert torch.equal(full(target.inner.table), full(source.inner.table))
    assert torch.equal(target.head.weight, source.head.weight)


def test_get_and_set_model_state_dict() -> None:
    source, target = model(), model()
    with torch.no_grad():
        source.inner.table.add_(1)
    sharded = get_model_state_dict(source)
    assert isinstance(sharded["inner.table"], DTensor)
    set_model_state_dict(target, sharded)
    assert torch.equal(full(target.inner.table), full(source.inner.table))
    full_sd = get_model_state_dict(source, options=StateDictOptions(full_state_dict=True))
    assert type(full_sd["inner.table"]) is torch.Tensor
    other = model()
    set_model_state_dict(other, full_sd, options=StateDictOptions(full_state_dict=True))
    assert torch.equal(full(other.inner.table), full(source.inner.table))


def test_shared_submodule_under_two_paths() -> None:
    m = Model()
    m.alias = m.inner
    register_sharded_state_hooks(m)
    state = m.state_dict()
    assert "inner.table" in state and "alias.table" in state
    assert str(m.load_state_dict(state)) == "<All keys matched successfully>"


def test_import_is_silent_and_lazy() -> None:
    code = (
        "import sys, lightning_sharded; "
        "assert 'torch' not in sys.modules, 'torch imported eagerly'; "
        "assert 'lightning_sharded.checkpoint.verify' not in sys.modules, 'the tools imported eagerly'; "
        "lightning_sharded.ShardedStateMixin; "
        "assert 'torch.distributed._shard.sharded_tensor' not in sys.modules, "
        "'ShardedTensor imported eagerly'; "
        "assert 'lightning' not in sys.modules, 'Lightning imported eagerly'; "
        "assert 'lightning_sharded.checkpoint.tools' not in sys.modules, 'the tools imported eagerly'; "
        "[getattr(lightning_sharded, name) for name in lightning_sharded.__all__]"  # each one resolves
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)


def test_works_without_sharded_tensor(tmp_path: Any) -> None:
    """On a torch that removed ShardedTensor, the library imports and DTensor attributes round-trip.

    torch 2.13 itself imports ``torch.distributed._shard`` when DTensor's compile support loads, so the
    removal is simulated after that: the modules are dropped and any further import of them fails.
    """
    script = tmp_path / "no_st.py"
    script.write_text(
        "import sys, importlib.abc\n"
        "import torch, torch.distributed as dist\n"
        "from torch.distributed.tensor import distribute_tensor, init_device_mesh, Shard\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "mesh = init_device_mesh('cpu', (1,))\n"
        "distribute_tensor(torch.ones(1), mesh, [Shard(0)])  # torch 2.13 loads _shard itself here\n"
        "for name in [n for n in sys.modules if n.startswith('torch.distributed._shard')]:\n"
        "    del sys.modules[name]\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.startswith('torch.distributed._shard'):\n"
        "            raise ImportError('removed')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import lightning_sharded\n"
        "m = lightning_sharded.register_sharded_state_hooks(torch.nn.Linear(2, 2))\n"
        "m.t = distribute_tensor(torch.ones(3), mesh, [Shard(0)])\n"
        "sd = m.state_dict(); sd['t'] = torch.full((3,), 4.0); m.load_state_dict(sd)\n"
        "assert m.t.full_tensor().tolist() == [4.0, 4.0, 4.0]\n"
        "assert 'torch.distributed._shard.sharded_tensor' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


# ------------------------------------------------------------------------------------- wrappers


def wrapped(kind: str) -> tuple[nn.Module, Inner]:
    """A root whose child ``block`` is ``Inner`` wrapped by ``kind``; returns (root, the Inner)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = Inner()
    block: nn.Module = inner
    if kind in ("ac", "compile-ac"):
        block = checkpoint_wrapper(block)
    if kind in ("compile", "compile-ac"):
        block = torch.compile(block, backend="eager")
    if kind == "ddp":
        block = torch.nn.parallel.DistributedDataParallel(block)
    root = nn.Module()
    root.block = block
    root.top = dt(torch.arange(2.0))
    return register_sharded_state_hooks(root), inner


RAW_KEYS = {
    "ac": "block.table",  # the checkpoint wrapper's own hooks drop its part from parameter keys
    "compile": "block._orig_mod.table",  # torch keeps `_orig_mod.` in parameter keys
    "compile-ac": "block._orig_mod.table",
    "ddp": "block.module.table",
}


@pytest.mark.parametrize("kind", list(RAW_KEYS))
def test_keys_through_a_wrapper(kind: str) -> None:
    root, inner = wrapped(kind)
    raw = root.state_dict()
    weight_key = RAW_KEYS[kind].replace("table", "lin.weight")
    assert weight_key in raw and RAW_KEYS[kind] in raw  # named as torch names a parameter there
    clean = get_model_state_dict(root)
    assert sorted(clean) == ["block.lin.bias", "block.lin.weight", "block.table", "top"]
    # Either spelling loads, strictly, into the attribute of the wrapped module.
    for key, state in ((RAW_KEYS[kind], raw), ("block.table", dict(clean))):
        state[key] = torch.full((4, 3), float(len(key)))
        if key == "block.table":
            set_model_state_dict(root, state)
        else:
            assert str(root.load_state_dict(state)) == "<All keys matched successfully>"
        assert torch.equal(full(inner.table), torch.full((4, 3), float(len(key))))


def test_a_compiled_root_loads_clean_keys() -> None:
    m = model()
    compiled = torch.compile(m, backend="eager")
    state = get_model_state_dict(compiled)
    assert "inner.table" in state  # no `_orig_mod.`
    state["inner.table"] = torch.full((4, 3), 3.0)
    set_model_state_dict(compiled, state)  # the hooks see the prefix "_orig_mod." and the clean key
    assert torch.equal(full(m.inner.table), torch.full((4, 3), 3.0))


def test_assignment_goes_to_the_wrapped_module_not_the_wrapper() -> None:
    root, inner = wrapped("compile")
    state = root.state_dict()
    state["block.extra"] = dt(torch.ones(2))  # clean spelling, through torch.compile
    root.load_state_dict(state, assign=True)
    assert "extra" in vars(inner) and "extra" not in vars(root.block)
    assert "block._orig_mod.extra" in root.state_dict()


def test_fabric_forward_module_is_not_a_second_path() -> None:
    from lightning.fabric.wrappers import _FabricModule

    inner = Inner()
    root = nn.Module()
    root.fab = _FabricModule(torch.compile(inner, backend="eager"), strategy=None, original_module=inner)  # type: ignore[arg-type]
    register_sharded_state_hooks(root)
    keys = [k for k in root.state_dict() if k.endswith("table")]
    assert keys == ["fab.table"]  # as _FabricModule.state_dict names its parameters


def test_clean_parameter_names_are_torch_optimizer_names() -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from lightning_sharded._fqn import parameter_names

    root, _ = wrapped("compile-ac")
    root.head = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(root.parameters())
    names = parameter_names(root)
    ours = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    theirs = get_optimizer_state_dict(root, optimizer)["param_groups"][0]["params"]
    assert ours == theirs == ["block.lin.weight", "block.lin.bias", "head.weight", "head.bias"]


# ------------------------------------------------------------------------------ after exceptions


class Exploding(nn.Module):
    """Raises while the root's state_dict() / load_state_dict() is between its pre- and post-hooks."""

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        raise RuntimeError("boom in state_dict")

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom in load_state_dict")


def test_state_dict_after_an_exception_uses_its_own_keep_vars() -> None:
    m = model()
    m.bomb = Exploding()
    m.inner.table.requires_grad_(True)
    with pytest.raises(RuntimeError, match="boom in state_dict"):
        m.state_dict(keep_vars=True)
    del m.bomb
    shared = next(h for h in m._state_dict_pre_hooks.values()).shared
    assert len(shared.keep_vars) == 1  # what the failed call left
    state = m.state_dict()  # keep_vars=False: detached, not the failed call's True
    assert state["inner.table"] is not m.inner.table and not state["inner.table"].requires_grad
    assert shared.keep_vars == []  # released by the next call
    assert m.state_dict(keep_vars=True)["inner.table"] is m.inner.table


class Peeking(nn.Module):
    """Calls the root's state_dict() (keep_vars=False) from inside the root's own state_dict() once, as a
    user's logging hook might."""

    def __init__(self) -> None:
        super().__init__()
        self.root: list[nn.Module] = []
        self.seen: list[dict[str, Any]] = []

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        if self.root:
            root = self.root.pop()  # once: the nested call comes back here
            self.seen.append(root.state_dict())


def test_a_state_dict_nested_in_another_keeps_each_calls_keep_vars() -> None:
    m = model()
    m.peek = Peeking()
    m.peek.root.append(m)
    m.inner.table.requires_grad_(True)
    outer = m.state_dict(keep_vars=True)
    inner = m.peek.seen[0]
    assert inner["inner.table"] is not m.inner.table and not inner["inner.table"].requires_grad
    assert outer["inner.table"] is m.inner.table  # the outer call's own keep_vars, after the inner one
    shared = next(h for h in m._state_dict_pre_hooks.values()).shared
    assert shared.keep_vars == []


def test_a_failed_load_keeps_no_reference_to_the_checkpoint() -> None:
    import gc
    import weakref

    m = model()
    m.bomb = Exploding()
    state = m.inner.state_dict(prefix="inner.")
    state["inner.extra"] = dt(torch.ones(2))  # an unclaimed sharded value, looked at by the hooks
    refs = [weakref.ref(v) for v in state.values()]
    with pytest.raises(RuntimeError, match="boom in load_state_dict"):
        m.load_state_dict(state, strict=False)
    del state
    gc.collect()
    assert all(ref() is None for ref in refs), "a hook still holds the checkpoint's tensors"


def test_strictness_is_the_callers_when_nested_in_a_parent() -> None:
    parent = nn.ModuleDict({"body": model()})
    state = parent.state_dict()
    state["body.cache"] = dt(torch.ones(2))  # the body's cache is None
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "body.cache"'):
        parent.load_state_dict(state)
    assert not parent.load_state_dict(state, strict=False).unexpected_keys
    assert torch.equal(full(parent["body"].cache), torch.ones(2))
