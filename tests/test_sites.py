"""The site index: every change to the tree between calls is seen, whatever the cache holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from lightning_sharded import register_sharded_state_hooks
from lightning_sharded._sites import SiteIndex

pytestmark = pytest.mark.usefixtures("process_group")


def dt() -> object:
    return distribute_tensor(torch.ones(2), init_device_mesh("cpu", (1,)), [Shard(0)])


def keys(index: SiteIndex, root: nn.Module) -> list[str]:
    return [site.key for site in index.find(root)]


def tree() -> nn.Module:
    root = nn.Module()
    root.body = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    root.leaf = nn.Linear(2, 2)
    return root


def test_every_kind_of_change_is_seen() -> None:
    root, index = tree(), SiteIndex()
    assert keys(index, root) == []
    root.body[1].t = dt()  # new attribute: a __dict__ grows
    assert keys(index, root) == ["body.1.t"]
    root.body[1] = nn.Linear(2, 2)  # child replaced: same counts everywhere
    assert keys(index, root) == []
    root.leaf.sub = nn.Module()  # a leaf gains a child: its _modules grows, not its __dict__
    root.leaf.sub.t = dt()
    assert keys(index, root) == ["leaf.sub.t"]
    root.leaf.x = None
    assert keys(index, root) == ["leaf.sub.t"]
    root.leaf.x = dt()  # same keys, another type
    assert keys(index, root) == ["leaf.x", "leaf.sub.t"]
    del root.leaf.x
    root.leaf.y = dt()  # one extra deleted, another added: same length
    assert keys(index, root) == ["leaf.y", "leaf.sub.t"]
    del root.leaf.sub
    assert keys(index, root) == ["leaf.y"]


def test_unchanged_tree_uses_the_snapshot() -> None:
    root, index = tree(), SiteIndex()
    root.leaf.t = dt()
    first = index.find(root)
    assert index.find(root) is first


def test_walk_stops_at_a_registered_submodule() -> None:
    root, index = tree(), SiteIndex()
    root.body[0].t = dt()
    root.leaf.t = dt()
    assert keys(index, root) == ["body.0.t", "leaf.t"]
    register_sharded_state_hooks(root.body)
    assert keys(index, root) == ["leaf.t"]


def test_another_root_is_walked_afresh() -> None:
    a, b, index = tree(), tree(), SiteIndex()
    b.leaf.t = dt()
    assert keys(index, a) == []
    assert keys(index, b) == ["leaf.t"]
