"""Warm starts, parts left out of a resume, trainable-only checkpoints and compiled models' full files,
for both strategies, sharded and full, in real 2-process runs (``scenario_partial.py``, one launch).

Every comparison is exact: a restored value equals the saved one only if it was really restored (the
resumed models start from another seed, and their frozen base is never loaded by the model itself).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharded import (
    CheckpointError,
    ShardedFSDPStrategy,
    ShardedModelParallelStrategy,
    inspect_checkpoint,
)
from lightning_sharded.checkpoint.names import FROZEN_KEY, MANIFEST_NAME
from tests.distributed.launch import Results, run_ranks

SCENARIO = Path(__file__).parents[1] / "distributed" / "scenario_partial.py"
COMBOS = [(s, t) for s in ("fsdp", "mp") for t in ("sharded", "full")]
BASE_KEYS = ["base.0.bias", "base.0.weight", "base.1.bias", "base.1.weight"]
LORA = {"save_trainable_only": True, "frozen_prefix": "base."}


def make_base(directory: Path) -> None:
    """The pretrained base, as a Hugging Face directory: values no model starts with."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    tensors = {
        "0.weight": torch.arange(64.0).reshape(8, 8) / 100,
        "0.bias": torch.full((8,), 0.5),
        "1.weight": -torch.arange(64.0).reshape(8, 8) / 50,
        "1.bias": torch.full((8,), -0.25),
    }
    save_file(tensors, str(directory / "model.safetensors"))


class Run:
    """Every job of this file, run once at 2 processes; results by job name, ranks' output."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = root / "base"
        make_base(self.base)
        shutil.copytree(self.base, root / "base-copy")
        torch.save({"state_dict": {"other.weight": torch.ones(2)}}, root / "other.ckpt")
        self.jobs: list[dict[str, Any]] = []
        self.outs: dict[str, Path] = {}
        base = str(self.base)
        for strategy, sdt in COMBOS:
            c = f"{strategy}-{sdt}"
            full, lora = self.ckpt(f"full-{c}", sdt), self.ckpt(f"lora-{c}", sdt)
            common = {"strategy": strategy, "sdt": sdt}
            self.add(f"fit-full-{c}", "fit", ckpt=full, model={"base_dir": base}, **common)
            self.add(
                f"fit-lora-{c}", "fit", ckpt=lora, model={"base_dir": base}, options=self.lora(), **common
            )
            self.add(f"resume-lora-{c}", "resume", ckpt=lora, model={"seed": 7}, **common)
            self.add(f"warm-{c}", "warm", model={"seed": 7}, options={"warm_start": full}, **common)
        fs, mf, ms = self.ckpt("full-fsdp-sharded", "sharded"), self.ckpt("full-mp-full", "full"), None
        ms = self.ckpt("full-mp-sharded", "sharded")
        fresh = {"exclude_from_loading": ["optimizer_states", "lr_schedulers", "callbacks.Counter"]}
        self.add("exclude-fsdp-sharded", "resume", ckpt=fs, strategy="fsdp", sdt="sharded", options=fresh)
        self.add("exclude-mp-full", "resume", ckpt=mf, strategy="mp", sdt="full", options=fresh)
        restart = {"exclude_from_loading": ["loops", "rank_state", "callbacks"]}
        self.add("restart-mp-sharded", "resume", ckpt=ms, strategy="mp", sdt="sharded", options=restart)
        warm_lora = {"warm_start": self.ckpt("lora-fsdp-full", "full")}
        self.add(
            "warm-lora-fsdp-full", "warm", strategy="fsdp", sdt="full", model={"seed": 7}, options=warm_lora
        )
        for strategy in ("fsdp", "mp"):
            ckpt = self.ckpt(f"compiled-{strategy}", "full")
            compiled = {"strategy": strategy, "sdt": "full"}
            self.add(
                f"fit-compiled-{strategy}",
                "fit",
                ckpt=ckpt,
                model={"base_dir": base, "compile": True},
                **compiled,
            )
            self.add(
                f"resume-compiled-{strategy}",
                "resume",
                ckpt=ckpt,
                model={"compile": True, "seed": 7},
                **compiled,
            )
        # Errors, each as a user meets it.
        err = {"strategy": "fsdp", "sdt": "sharded"}
        self.add(
            "error-callback", "error", ckpt=fs, options={"exclude_from_loading": ["callbacks.Nope"]}, **err
        )
        self.add(
            "error-warm-other",
            "error",
            model={"strict": False},
            options={"warm_start": str(root / "other.ckpt")},
            **err,
        )
        moved = self.ckpt("lora-moved", "sharded")
        options = {**LORA, "frozen_source": str(root / "base-copy")}
        self.add("fit-lora-moved", "fit", ckpt=moved, model={"base_dir": base}, options=options, **err)
        self.add("remove-base-copy", "remove", path=str(root / "base-copy"), **err)
        self.add("error-moved-source", "error", ckpt=moved, model={"seed": 7}, **err)
        bad = {**LORA, "frozen_source": base, "frozen_prefix": "nope."}
        self.add("error-bad-prefix", "error", save=True, model={"base_dir": base}, options=bad, **err)
        jobs_file = root / "jobs.pt"
        torch.save(self.jobs, jobs_file)
        self.outputs = run_ranks(SCENARIO, 2, "batch", str(jobs_file), timeout=400)
        self.results = Results(self.outs)

    def lora(self) -> dict[str, Any]:
        return {**LORA, "frozen_source": str(self.base)}

    def ckpt(self, name: str, sdt: str) -> str:
        return str(self.root / (name if sdt == "sharded" else f"{name}.ckpt"))

    def add(self, name: str, kind: str, **job: Any) -> None:
        out = self.root / f"{name}.result.pt"
        self.outs[name] = out
        self.jobs.append({"name": name, "kind": kind, "out": str(out), **job})


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return Run(Path(tmp_path_factory.mktemp("partial")))


def model_values(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k.startswith("model.")}


def assert_equal(saved: dict[str, Any], restored: dict[str, Any], keys: list[str]) -> None:
    assert keys, "nothing to compare"
    differ = [
        k
        for k in keys
        if k not in restored or not torch.equal(torch.as_tensor(saved[k]), torch.as_tensor(restored[k]))
    ]
    assert not differ, f"restored values differ from the saved ones for {differ}"


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "sdt"), COMBOS)
def test_a_trainable_only_checkpoint_resumes_both_parts_exactly(run: Run, strategy: str, sdt: str) -> None:
    c = f"{strategy}-{sdt}"
    saved, restored = run.results[f"fit-lora-{c}"], run.results[f"resume-lora-{c}"]
    # The saved run loaded its base from the Hugging Face directory; the resumed model started from
    # another seed and never loaded it: the base can only be equal if the load read it from the source.
    base = torch.load(run.root / "fit-lora-fsdp-sharded.result.pt", weights_only=False)
    assert torch.equal(base["model.base.0.weight"], torch.arange(64.0).reshape(8, 8) / 100)
    keys = sorted(saved)
    assert {"model.base.0.weight", "model.lora_a.weight", "model.table", "opt.head.weight.exp_avg"} <= set(
        keys
    )
    assert_equal(saved, restored, [k for k in keys if k.startswith(("model.", "opt."))])
    assert (restored["global_step"], restored["lr"], restored["counter"]) == (3, saved["lr"], 3)
    said = f"{run.ckpt(f'lora-{c}', sdt)!r} holds the trainable weights only: read its 4 frozen parameter(s)"
    assert f"{said} from {str(run.base)!r}" in run.outputs[0]
    # What the checkpoint holds: everything but the frozen base, which it names as its source.
    info = inspect_checkpoint(run.ckpt(f"lora-{c}", sdt))
    stored = {e.key for e in info.entries}
    assert not any("base." in key for key in stored)
    assert any(key.endswith("lora_a.weight") for key in stored) and any(
        key.endswith("table") for key in stored
    )
    if sdt == "sharded":
        manifest = json.loads((Path(run.ckpt(f"lora-{c}", sdt)) / MANIFEST_NAME).read_text())
        assert manifest["format_version"] == 3
        assert manifest["frozen"] == {"source": str(run.base), "keys": BASE_KEYS, "prefix": "base."}
        complete = json.loads((Path(run.ckpt(f"full-{c}", sdt)) / MANIFEST_NAME).read_text())
        assert complete["format_version"] == 1 and "frozen" not in complete
    else:
        frozen = torch.load(run.ckpt(f"lora-{c}", sdt), weights_only=True)[FROZEN_KEY]
        assert frozen == {"source": str(run.base), "keys": BASE_KEYS, "prefix": "base."}


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "sdt"), COMBOS)
def test_a_warm_start_loads_the_model_only_and_starts_everything_else_fresh(
    run: Run, strategy: str, sdt: str
) -> None:
    c = f"{strategy}-{sdt}"
    saved, warm = run.results[f"fit-full-{c}"], run.results[f"warm-{c}"]
    assert_equal(saved, warm, sorted(model_values(saved)))  # weights, frozen base and DTensor table
    assert warm["opt_states"] == 0  # Adam has no state yet
    assert (warm["global_step"], warm["lr"], warm["counter"]) == (0, 0.01, 0)
    assert saved["global_step"] == 3 and saved["lr"] == 0.01 * 0.5**3
    said = f"Warm start: loaded the model state from {run.ckpt(f'full-{c}', sdt)!r} in"
    assert said in run.outputs[0]


@pytest.mark.slow
def test_a_warm_start_from_a_trainable_only_checkpoint_reads_the_frozen_part_from_its_source(
    run: Run,
) -> None:
    saved, warm = run.results["fit-lora-fsdp-full"], run.results["warm-lora-fsdp-full"]
    assert_equal(saved, warm, sorted(model_values(saved)))
    assert warm["global_step"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["exclude-fsdp-sharded", "exclude-mp-full"])
def test_excluded_parts_start_fresh_and_the_rest_is_restored(run: Run, name: str) -> None:
    strategy, sdt = name.split("-")[1:]
    saved, restored = run.results[f"fit-full-{strategy}-{sdt}"], run.results[name]
    assert_equal(saved, restored, sorted(model_values(saved)))
    assert restored["global_step"] == 3  # the loops were restored
    assert restored["opt_states"] == 0  # optimizer_states: fresh
    assert restored["lr"] == 0.01  # lr_schedulers (and the optimizer's groups): fresh
    assert restored["counter"] == 0  # callbacks.Counter: not restored
    ckpt = run.ckpt(f"full-{strategy}-{sdt}", sdt)
    line = f"Not loaded from '{ckpt}' (`exclude_from_loading`): the optimizer states (the optimizers start"
    assert line in run.outputs[0]


@pytest.mark.slow
def test_excluding_loops_rank_state_and_callbacks_restarts_the_counts_only(run: Run) -> None:
    saved, restored = run.results["fit-full-mp-sharded"], run.results["restart-mp-sharded"]
    assert_equal(saved, restored, sorted(k for k in saved if k.startswith(("model.", "opt."))))
    assert (restored["global_step"], restored["counter"], restored["lr"]) == (0, 0, saved["lr"])
    assert "the loops' progress (epoch, global step and dataloader position start at 0)" in run.outputs[0]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "mp"])
def test_a_compiled_models_full_file_has_clean_names_and_loads_both_ways(run: Run, strategy: str) -> None:
    from tests.distributed.scenario_partial import LoraModel

    saved = run.results[f"fit-compiled-{strategy}"]
    checkpoint = torch.load(run.ckpt(f"compiled-{strategy}", "full"), weights_only=True)
    assert not [k for k in checkpoint["state_dict"] if "_orig_mod" in k]
    plain = LoraModel()  # uncompiled, one plain process
    plain.configure_model()
    plain.load_state_dict(checkpoint["state_dict"])  # strict
    for key, value in plain.state_dict().items():
        assert torch.equal(value, saved[f"model.{key}"]), key
    # ... and back into a compiled model, under the strategy: every value.
    restored = run.results[f"resume-compiled-{strategy}"]
    assert_equal(saved, restored, sorted(k for k in saved if k.startswith(("model.", "opt."))))


# case -> (exception type, fragments of its message)
ERRORS = {
    "error-callback": (
        "CheckpointError",
        ["callback 'Nope'", "callback states: ['Counter']", "remove 'callbacks.Nope'"],
    ),
    "error-warm-other": ("CheckpointError", ["other.ckpt", "holds none of the model's", '"other.weight"']),
    "error-moved-source": (
        "FileNotFoundError",
        ["base-copy", "holds only the trainable weights", "frozen_source="],
    ),
    "error-bad-prefix": ("CheckpointError", ["do not start with `frozen_prefix='nope.'`", '"base.0.bias"']),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(ERRORS))
def test_a_bad_combination_names_the_value_and_the_fix(run: Run, case: str) -> None:
    kind, fragments = ERRORS[case]
    result = run.results[case]
    assert result["type"] == kind, result
    for fragment in fragments:
        assert fragment in result["message"], (fragment, result["message"])


@pytest.mark.parametrize("strategy", [ShardedFSDPStrategy, ShardedModelParallelStrategy])
def test_options_are_checked_when_the_strategy_is_made(strategy: type) -> None:
    with pytest.raises(
        ValueError,
        match=r"Unknown part 'optimizer' in `exclude_from_loading`: choose from 'optimizer_states'",
    ):
        strategy(exclude_from_loading=["optimizer"])
    with pytest.raises(ValueError, match="`save_trainable_only=True` needs `frozen_source`"):
        strategy(save_trainable_only=True)
    assert strategy(exclude_from_loading="loops").exclude_from_loading == ("loops",)


def test_a_missing_checkpoint_part_is_not_an_error_and_a_named_callback_is() -> None:
    from lightning_sharded.checkpoint.load.parts import drop_parts

    checkpoint: dict[str, Any] = {
        "loops": {},
        "callbacks": {"EarlyStopping{'monitor': 'x'}": {}, "Timer": {}},
    }
    said = drop_parts(checkpoint, ("lr_schedulers", "callbacks.EarlyStopping", "rank_state"), "c.ckpt")
    assert checkpoint == {"loops": {}, "callbacks": {"Timer": {}}, "lr_schedulers": []}
    assert said == [
        "the LR scheduler states (not in the checkpoint)",
        "the state of EarlyStopping{'monitor': 'x'}",
        "the per-rank RNG and train dataloader states (not in the checkpoint)",
    ]
    with pytest.raises(
        CheckpointError, match=r"callback 'Stop', but the checkpoint 'c.ckpt' holds no state of it"
    ):
        drop_parts(checkpoint, ("callbacks.Stop",), "c.ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("sdt", ["sharded", "full"])
def test_the_offline_tools_make_a_trainable_only_checkpoint_whole_or_say_it_is_partial(
    run: Run, sdt: str, tmp_path: Path
) -> None:
    from lightning_sharded import (
        ShardedStateMixin,
        consolidate_checkpoint,
        load_checkpoint,
        verify_checkpoint,
    )
    from lightning_sharded.cli import main
    from tests.distributed.scenario_partial import LoraModel

    ckpt = run.ckpt(f"lora-fsdp-{sdt}", sdt)
    saved = run.results[f"fit-lora-fsdp-{sdt}"]
    expected = {k[len("model.") :]: v for k, v in saved.items() if k.startswith("model.")}
    # load_checkpoint: whole (the base read from its source), or what the checkpoint holds.
    whole = load_checkpoint(ckpt)["state_dict"]
    assert sorted(whole) == sorted(expected)
    assert all(torch.equal(whole[k], v) for k, v in expected.items())
    alone = load_checkpoint(ckpt, merge_frozen=False)
    assert not [k for k in alone["state_dict"] if k.startswith("base.")]
    assert alone[FROZEN_KEY]["keys"] == BASE_KEYS
    # The mixin's load_from_checkpoint: the complete model, strictly.

    class Loaded(ShardedStateMixin, LoraModel):
        pass

    model = Loaded.load_from_checkpoint(ckpt)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    # inspect says it is partial and where the rest is.
    info = inspect_checkpoint(ckpt)
    assert info.frozen == {"source": str(run.base), "keys": BASE_KEYS, "prefix": "base."}
    capture = tmp_path / "inspect.txt"
    with open(capture, "w") as out, pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.stdout", out)
        assert main(["inspect", ckpt]) == 0
    line = "partial:     trainable only: 4 frozen parameter(s) not in it, read from"
    line += f" {run.base} (keys less 'base.')"
    assert line in capture.read_text()
    if sdt == "full":
        return
    notes = verify_checkpoint(ckpt).notes
    assert (
        f"trainable only: 4 frozen parameter(s) are not in this checkpoint; a load reads them from {run.base}"
        in " ".join(notes)
    )
    # consolidate merges the frozen part: a complete file that plain torch and stock Lightning load.
    out = consolidate_checkpoint(ckpt, tmp_path / "whole.ckpt")
    state = torch.load(out, weights_only=True)["state_dict"]
    plain = LoraModel()
    plain.configure_model()
    plain.load_state_dict(state)  # strict
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in expected.items())
    hf = consolidate_checkpoint(ckpt, tmp_path / "hf", format="safetensors", prefix="base.")
    from safetensors.torch import load_file

    assert sorted(load_file(str(Path(hf) / "model.safetensors"))) == [
        "0.bias",
        "0.weight",
        "1.bias",
        "1.weight",
    ]
