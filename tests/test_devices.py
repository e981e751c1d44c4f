"""Each tensor on the device it belongs on: async staging takes no device memory, a full value is cut
before it goes to the device, a rank with no shard gathers on its peers' device, and a model loaded
from a full file with a device ``map_location`` moves only the model state.

On CPU these run at 4 real ranks (``tests/distributed/devices_script.py``) and in process; the GPU
twins check what only CUDA shows (pinned buffers, device memory, the device of each part) and skip,
with a reason, without a GPU. ``tests/gpu/run.sh`` runs them on a GPU machine with the figures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharded.checkpoint.staging import StagingBuffers, _on_cpu
from lightning_sharded.tensors import sharded_tensor as sharded_tensor_module
from lightning_sharded.tensors.sharded_tensor import rank_device
from tests.distributed.launch import run_ranks

SCRIPT = Path(__file__).with_name("distributed") / "devices_script.py"


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("devices")
    run_ranks(SCRIPT, 4, str(out), timeout=240)
    return json.loads((out / "devices.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("check", ["local_part", "copy_into", "empty_shard", "staging"])
def test_every_rank_passes(records: list[dict[str, Any]], check: str) -> None:
    mine = [r for r in records if r["check"] in (check, f"check_{check}")]
    assert {r["rank"] for r in mine} == {0, 1, 2, 3}, mine
    failed = [r for r in mine if not r["ok"]]
    assert not failed, json.dumps(failed, indent=1)


def test_placements_on_an_accelerator_are_moved_to_cpu_in_a_copy() -> None:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    shards = [ShardMetadata([0, 0], [2, 3], "rank:0/cuda:0"), ShardMetadata([2, 0], [2, 3], "rank:1/cuda:1")]
    metadata = ShardedTensorMetadata(shards, torch.Size([4, 3]), TensorProperties(dtype=torch.float32))
    moved = _on_cpu(metadata)
    assert [str(m.placement) for m in moved.shards_metadata] == ["rank:0/cpu", "rank:1/cpu"]
    assert [m.shard_offsets for m in moved.shards_metadata] == [[0, 0], [2, 0]]
    assert [str(m.placement) for m in metadata.shards_metadata] == ["rank:0/cuda:0", "rank:1/cuda:1"]
    assert str(_on_cpu(shards[1]).placement) == "rank:1/cpu"
    assert str(shards[1].placement) == "rank:1/cuda:1"
    on_cpu = ShardMetadata([0], [2], "rank:0/cpu")
    assert _on_cpu(on_cpu) is on_cpu  # nothing to move: no copy


class _NoLocalShards:
    """What :func:`rank_device` reads of a ShardedTensor on a rank that holds none of it."""

    def __init__(self, placements: list[str]) -> None:
        from torch.distributed._shard.metadata import ShardMetadata

        self._meta = [ShardMetadata([i], [1], p) for i, p in enumerate(placements)]

    def local_shards(self) -> list[Any]:
        return []

    def metadata(self) -> Any:
        class Meta:
            shards_metadata = self._meta

        return Meta()


def test_a_rank_without_shard_gathers_on_its_peers_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharded_tensor_module.torch.accelerator, "current_device_index", lambda: 3)
    assert rank_device(_NoLocalShards(["rank:0/cuda:0", "rank:1/cuda:1"])) == torch.device("cuda", 3)
    assert rank_device(_NoLocalShards(["rank:0/cpu", "rank:1/cpu"])) == torch.device("cpu")


def _full_file(path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch.save(
        {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "epoch": 0}, path
    )


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# "meta" stands for an accelerator on CPU (any device that is not the CPU); "cuda" is its GPU twin.
@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_a_device_map_location_moves_only_the_model_state(tmp_path: Path, device: str) -> None:
    from lightning_sharded.mixin import _model_state_to

    _full_file(tmp_path / "full.ckpt")
    checkpoint = _model_state_to(tmp_path / "full.ckpt", device, weights_only=True)
    assert {t.device.type for t in checkpoint["state_dict"].values()} == {device}
    states = checkpoint["optimizer_states"][0]["state"]
    assert {t.device.type for s in states.values() for t in s.values()} == {"cpu"}
    assert checkpoint["epoch"] == 0


# ------------------------------------------------------------------------------------------ GPU twins


@pytest.mark.gpu
@CUDA
def test_staging_cuda_values_takes_no_device_memory(process_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (1,))
    table = distribute_tensor(torch.randn(1024, 1024, device="cuda"), mesh, [Shard(0)], src_data_rank=None)
    state = {"table": table, "plain": torch.randn(256, device="cuda")}
    buffers = StagingBuffers()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    staged = buffers.stage(state)
    assert torch.cuda.memory_allocated() == before
    assert isinstance(staged["table"], DTensor) and staged["table"]._spec is table._spec
    local = staged["table"]._local_tensor
    assert local.device.type == "cpu" and local.is_pinned()
    assert torch.equal(local, table.to_local().cpu())
    assert staged["plain"].is_pinned() and torch.equal(staged["plain"], state["plain"].cpu())


@pytest.mark.gpu
@CUDA
def test_staging_a_cuda_sharded_tensor(process_group: None) -> None:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cuda:0"])
    value = sharded_tensor.rand(spec, 8, 4)
    staged = StagingBuffers().stage({"v": value})["v"]
    shard = staged.local_shards()[0]
    assert shard.tensor.device.type == "cpu" and shard.tensor.is_pinned()
    assert torch.equal(shard.tensor, value.local_shards()[0].tensor.cpu())
    assert str(staged.metadata().shards_metadata[0].placement) == "rank:0/cpu"


# ------------------------------------------------------------------------- the GPU scripts, on CPU

GPU_SCRIPTS = Path(__file__).with_name("gpu")


def test_gpu_figures_script_runs_on_cpu(tmp_path: Path) -> None:
    """``tests/gpu/figures.py`` (what ``tests/gpu/run.sh`` measures) on CPU, tiny: it runs, restores
    what it saved, and reports every figure. Its numbers here mean nothing and are not checked."""
    import subprocess
    import sys

    from tests.distributed.launch import shell_env

    cmd = [sys.executable, str(GPU_SCRIPTS / "figures.py"), "--device", "cpu", "--out", str(tmp_path)]
    cmd += ["--size-gb", "0.004", "--hidden", "128"]
    proc = subprocess.run(cmd, env=shell_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "figures.json").read_text())
    for name in ("mp", "fsdp"):
        assert report[name]["restored_equal"], report[name]
        assert report[name]["staged_gb"] > 0.003  # weights and both Adam states were staged
        assert {"stall_vs_sync", "staging_vs_pinned_copy"} <= set(report[name])


def test_gpu_shared_device_script_runs_on_cpu(tmp_path: Path) -> None:
    """``tests/gpu/shared_gpu.py`` at 2 ranks on CPU: the async save and the load it checks work."""
    run_ranks(GPU_SCRIPTS / "shared_gpu.py", 2, str(tmp_path), "--device", "cpu", timeout=180)
    report = json.loads((tmp_path / "shared_gpu.json").read_text())
    assert [r["worked"] for r in report["ranks"]] == [True, True], report
