"""Sharded state wherever real models keep it, through every wrapping: the matrix, a real transformer,
and the load hooks' agreement when one rank fails.

One session run (``WrappingRuns``), three launches of ``tests/distributed/scenario_wrapping.py``:
4 processes (the Llama fit on a 2 x 2 mesh), 2 (the matrix fits, every resume at 2, the Llama resumes
into 1 x 2 and FSDP1, the agreement cases), then 1 (every resume at 1, the Llama resume into 1 x 1).
The model (``tests/distributed/wrap_models.py``) holds a DTensor and a ShardedTensor at the root, in
the wrapped block ``enc.block`` and in the block inside it ``enc.block.sub``. Values are compared
exactly: parameters and optimizer state by clean FQN, sharded attributes read from their modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import Results, launcher_env, run_batch
from tests.distributed.wrap_models import WRAPPINGS

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "distributed" / "scenario_wrapping.py"

#: (checkpoint's wrapping, resuming wrapping, resumed at): every wrapping resumes into itself at 2 and
#: 1 processes; these move a checkpoint between wrappings and between FSDP1 and FSDP2.
CROSS = [
    ("fsdp-wrap", "mp-compile", 2),
    ("mp-compile", "fsdp-ac", 2),
    ("mp-nested", "fsdp", 2),
    ("fsdp-ac", "mp-nested", 2),
    ("fsdp-ac", "mp-ac", 1),
    ("mp-ac", "fsdp-wrap", 1),
    ("fsdp", "mp-nested", 1),
    ("mp", "fsdp-ac", 1),
]
RESUMES = [(w, w, n) for w in WRAPPINGS for n in (2, 1)] + CROSS
LLAMA_LAYOUTS = {"1x2": 2, "fsdp1": 2, "1x1": 1}

#: The model's keys in every checkpoint and in get_model_state_dict, whatever the wrapping.
MODEL_KEYS = sorted(
    [
        "table",
        "cache",
        *(f"{place}{name}" for place in ("enc.block.", "enc.block.sub.") for name in ("table", "cache")),
        *(f"{place}lin.{name}" for place in ("enc.block.", "enc.block.sub.") for name in ("weight", "bias")),
        *("enc.proj.bias", "enc.proj.weight", "head.bias", "head.weight"),
    ]
)
WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "_flat_param")


def resume_name(ckpt: str, wrapping: str, world: int) -> str:
    return f"{ckpt}>{wrapping}@{world}"


class WrappingRuns:
    def __init__(self, root: Path) -> None:
        self.root = root
        jobs: dict[int, list[dict[str, Any]]] = {4: [], 2: [], 1: []}
        outs: dict[str, Path] = {}

        def add(name: str, world: int, **job: Any) -> None:
            outs[name] = root / f"{name.replace('>', '_to_').replace('@', '_at_')}.pt"
            jobs[world].append({**job, "out": str(outs[name])})

        add("llama", 4, kind="llama-fit", layout="2x2", ckpt=str(root / "llama"))
        for wrapping in WRAPPINGS:
            add(wrapping, 2, kind="fit", wrapping=wrapping, ckpt=str(root / wrapping))
        for ckpt, wrapping, world in RESUMES:
            add(
                resume_name(ckpt, wrapping, world),
                world,
                kind="resume",
                wrapping=wrapping,
                ckpt=str(root / ckpt),
            )
        for layout, world in LLAMA_LAYOUTS.items():
            add(f"llama>{layout}", world, kind="llama-resume", layout=layout, ckpt=str(root / "llama"))
        add("agree", 2, kind="agree")
        for world in (4, 2, 1):
            jobs_file = root / f"jobs-{world}.pt"
            torch.save(jobs[world], jobs_file)
            run_batch(SCRIPT, world, jobs_file, timeout=420)
        self.results = Results(outs)

    def __getitem__(self, name: str) -> Any:
        return self.results[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> WrappingRuns:
    return WrappingRuns(tmp_path_factory.mktemp("wrapping"))


def compared(values: dict[str, Any]) -> list[str]:
    return sorted(k for k in values if k.startswith(("model.", "attr.", "opt")))


def assert_restored(saved: dict[str, Any], restored: dict[str, Any]) -> None:
    keys = compared(saved)
    assert keys == compared(restored), "the restored model has other parameters or state"
    differ = [k for k in keys if not torch.equal(saved[k], restored[k])]
    assert not differ, f"restored values differ from the saved ones for {differ}"
    assert restored["global_step"] == saved["global_step"] == 2


def checkpoint_keys(path: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


@pytest.mark.parametrize(("ckpt", "wrapping", "world"), RESUMES, ids=[resume_name(*r) for r in RESUMES])
def test_resume_restores_every_value_exactly(
    runs: WrappingRuns, ckpt: str, wrapping: str, world: int
) -> None:
    assert_restored(runs[ckpt], runs[resume_name(ckpt, wrapping, world)])


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_keys_are_clean_fqns_in_the_checkpoint_and_in_torch_helpers(
    runs: WrappingRuns, wrapping: str
) -> None:
    saved = runs[wrapping]
    assert saved["keys"] == sorted(MODEL_KEYS)  # get_model_state_dict on the wrapped model
    stored = checkpoint_keys(runs.root / wrapping)
    model_key = "model" if wrapping.startswith("fsdp") else "state_dict"
    assert sorted(k.split(".", 1)[1] for k in stored if k.startswith(f"{model_key}.")) == sorted(MODEL_KEYS)
    assert not [k for k in stored if any(part in k for part in WRAPPER_PARTS)]
    params = sorted(k for k in MODEL_KEYS if k.endswith(("weight", "bias")))
    optimizer = sorted({k.split(".state.", 1)[1].rsplit(".", 1)[0] for k in stored if ".state." in k})
    assert optimizer == params  # the optimizer's state is keyed by the same clean names


def test_training_changed_every_sharded_attribute(runs: WrappingRuns) -> None:
    # Restored values can only equal the saved ones by being restored: training moved them all.
    from tests.distributed.wrap_models import _initial

    saved = runs["fsdp-wrap"]
    for place in ("root", "block", "sub"):
        assert not torch.equal(saved[f"attr.{place}.table"], _initial(place, 4, 8))
        assert saved[f"attr.{place}.cache"].abs().sum() > 0


def test_every_wrapping_trains_the_same_model(runs: WrappingRuns) -> None:
    # One model, seven wrappings: the same clean names everywhere (the values differ by world and wrapping).
    names = {w: [k for k in compared(runs[w]) if not k.startswith("attr.")] for w in WRAPPINGS}
    assert all(keys == names["fsdp"] for keys in names.values())


@pytest.mark.parametrize("layout", list(LLAMA_LAYOUTS))
def test_llama_2x2_resumes_into_another_layout(runs: WrappingRuns, layout: str) -> None:
    saved = runs["llama"]
    # q_proj: column-wise over the tensor-parallel ranks and sharded again by fully_shard (2-D)
    assert saved["info.q_proj_placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    restored = runs[f"llama>{layout}"]
    if layout == "fsdp1":
        assert restored["info.q_proj_placements"] == "plain"  # FSDP1 flat parameters
    else:
        assert "Shard(dim=0)" in restored["info.q_proj_placements"]
    assert_restored(saved, restored)


def test_llama_checkpoint_has_clean_keys(runs: WrappingRuns) -> None:
    stored = checkpoint_keys(runs.root / "llama")
    assert "state_dict.llm.model.layers.0.router_table" in stored
    assert "state_dict.llm.model.layers.1.tp_scale" in stored
    assert "optimizer_0.state.llm.model.layers.0.mlp.down_proj.weight.exp_avg" in stored
    assert not [k for k in stored if any(part in k for part in WRAPPER_PARTS)]


def test_a_copy_failing_on_one_rank_fails_on_every_rank(runs: WrappingRuns) -> None:
    records = [r["copy-fails"] for r in runs["agree"]]
    for rank, record in enumerate(records):
        assert record["error"] is not None, f"rank {rank} did not raise"
        assert (
            "Every rank stopped loading sharded attributes there, before any further collective"
            in record["error"]
        )
        # `a` came first; `b` and `c` were not loaded on any rank
        assert torch.equal(record["values"]["b"], torch.zeros(4, 2))
        assert torch.equal(record["values"]["c"], torch.zeros(4, 2))
        assert record["recovered"]
    assert "RuntimeError('injected failure')" in records[1]["error"]
    assert 'Copying the sharded attribute "a" failed on rank(s) [1] (see their error).' in records[0]["error"]


def test_an_invalid_value_on_one_rank_is_an_error_on_every_rank(runs: WrappingRuns) -> None:
    records = [r["invalid"] for r in runs["agree"]]
    assert "size mismatch for a: copying a param with shape torch.Size([5, 2])" in records[1]["error"]
    assert (
        'The sharded attribute "a" could not be loaded on rank(s) [1] (see their error); no rank loaded it.'
        in (records[0]["error"])
    )
    for record in records:
        assert torch.equal(record["values"]["a"], torch.zeros(4, 2))  # no rank loaded it
        assert torch.equal(record["values"]["b"], torch.full((4, 2), 3.0))  # the others loaded everywhere
        assert torch.equal(record["values"]["c"], torch.full((4, 2), 4.0))
        assert record["recovered"]


def test_an_invalid_sharded_tensor_on_one_rank_is_an_error_on_every_rank(runs: WrappingRuns) -> None:
    """The same for a ``ShardedTensor`` attribute, whose ranks agree over its own process group."""
    records = [r["invalid-sharded"] for r in runs["agree"]]
    assert "size mismatch for c" in records[1]["error"], records[1]["error"]
    assert (
        'The sharded attribute "c" could not be loaded on rank(s) [1] (see their error); no rank loaded it.'
        in (records[0]["error"])
    )
    for record in records:
        assert torch.equal(record["values"]["c"], torch.zeros(4, 2))  # no rank loaded it
        assert torch.equal(record["values"]["a"], torch.full((4, 2), 5.0))
        assert torch.equal(record["values"]["b"], torch.full((4, 2), 6.0))
        assert record["recovered"]


def test_a_key_missing_on_one_rank_is_an_error_on_every_rank(runs: WrappingRuns) -> None:
    for record in [r["missing"] for r in runs["agree"]]:
        assert (
            'The state dict has the sharded attribute "b" on some ranks only (missing on rank(s) [1])'
            in (record["error"])
        )
        assert torch.equal(record["values"]["b"], torch.zeros(4, 2))
        assert torch.equal(record["values"]["a"], torch.full((4, 2), 3.0))
        assert record["recovered"]


PLAIN_LOADS = ("mp-compile", "fsdp-ac")


@pytest.fixture(scope="module")
def plain_loads(runs: WrappingRuns) -> dict[str, Any]:
    """``WrapModel.load_from_checkpoint(dir)`` of each checkpoint in one plain process (one launch)."""
    import subprocess
    import sys

    script = Path(__file__).parent / "distributed" / "plain_load.py"
    outs = {w: runs.root / f"plain-{w}.pt" for w in PLAIN_LOADS}
    pairs = [str(part) for w in PLAIN_LOADS for part in (runs.root / w, outs[w])]
    proc = subprocess.run(
        [sys.executable, str(script), *pairs], capture_output=True, text=True, timeout=300, env=launcher_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {w: torch.load(out, weights_only=False) for w, out in outs.items()}


@pytest.mark.parametrize("wrapping", PLAIN_LOADS)
def test_load_from_checkpoint_in_one_plain_process(
    runs: WrappingRuns, plain_loads: dict[str, Any], wrapping: str
) -> None:
    # No process group: configure_model leaves every sharded attribute None; each receives its full tensor,
    # under strict loading, and only the model state and meta.pt are read (no optimizer state).
    loaded = plain_loads[wrapping]
    saved = runs[wrapping]
    assert loaded["wrapping"] == wrapping  # hyperparameters from meta.pt
    assert loaded["read"] == ["model" if wrapping.startswith("fsdp") else "state_dict"]
    assert "optimizer_states" not in loaded["handed"] and "hyper_parameters" in loaded["handed"]
    values = loaded["values"]
    for place in ("root", "block", "sub"):
        for name in ("table", "cache"):
            assert values[f"type.{place}.{name}"] == "Tensor"
            assert torch.equal(values[f"attr.{place}.{name}"], saved[f"attr.{place}.{name}"])
    params = [k for k in saved if k.startswith("model.")]
    assert params and all(torch.equal(values[k], saved[k]) for k in params)
