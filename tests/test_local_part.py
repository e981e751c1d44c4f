"""``tensors.dtensor.local_part`` cuts a full tensor for ``Shard`` and ``Replicate`` as torch does, and
refuses a placement it cannot cut from a full value (a ``Partial``: its parts sum to the value) instead
of returning the full tensor as if it were this rank's part. (A mutant dropping that refusal survived
the hooks' tests.)
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from lightning_sharded.tensors.dtensor import local_part

pytestmark = pytest.mark.usefixtures("process_group")


def test_shard_and_replicate_are_cut_as_torch_cuts_them() -> None:
    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(12.0).reshape(4, 3)
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        expected = distribute_tensor(full, mesh, placements).to_local()
        assert torch.equal(local_part(full, mesh, placements), expected), placements


def test_a_partial_placement_is_refused_naming_it() -> None:
    mesh = init_device_mesh("cpu", (1,))
    with pytest.raises(ValueError, match="Cannot cut a full tensor for the placement Partial"):
        local_part(torch.ones(4), mesh, [Partial()])
