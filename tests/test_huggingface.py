"""Hugging Face both ways: ``consolidate_checkpoint(format="safetensors")`` / ``consolidate --format
safetensors`` and ``load_pretrained``.

One launch of ``tests/distributed/scenario_hf.py`` at 2 processes (``HFRuns``): the tiny Llama of
``scenario_llama.py`` trained under tensor parallelism x FSDP2 and saved sharded; a reference Llama's
``save_pretrained`` weights (one file, and several with an index) and a full file loaded into TP x FSDP2
(1 x 2), FSDP2 (2 x 1) and FSDP1; the sharded checkpoint loaded back; strict errors on both ranks.
The exports then run here, in one process, from that checkpoint; ``docs/huggingface.md``'s fine-tuning
script runs in the launch too (tensor parallel over both ranks). Values are compared exactly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sharded import CheckpointError, consolidate_checkpoint, load_pretrained
from lightning_sharded.cli import main
from tests.distributed import scenario_llama
from tests.distributed.launch import Results, run_batch
from tests.test_docs import blocks

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "distributed" / "scenario_hf.py"
DOC = Path(__file__).parents[1] / "docs" / "huggingface.md"

#: name: (kind, layout, source in the root folder, prefix)
LOADS = {
    "hf-multi>1x2": ("load", "1x2", "hf-multi", "llm."),
    "full>2x1": ("load", "2x1", "full.ckpt", ""),
    "hf-one>fsdp1": ("load", "fsdp1", "hf-one", "llm."),
}


def llama(seed: int) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(scenario_llama.config())


class HFRuns:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.reference = llama(5)
        self.reference.save_pretrained(root / "hf-one")
        self.reference.save_pretrained(root / "hf-multi", max_shard_size="20KB")
        torch.save(
            {"state_dict": {f"llm.{k}": v for k, v in self.reference.state_dict().items()}},
            root / "full.ckpt",
        )
        self.config = root / "hf-one" / "config.json"
        self.outs: dict[str, Path] = {}
        jobs: list[dict[str, Any]] = []

        def add(name: str, **job: Any) -> None:
            self.outs[name] = root / f"{name.replace('>', '_to_')}.pt"
            jobs.append({**job, "out": str(self.outs[name])})

        self.ckpt = root / "tp.ckpt"
        add("fit", kind="fit", layout="1x2", ckpt=str(self.ckpt))
        for name, (kind, layout, source, prefix) in LOADS.items():
            add(name, kind=kind, layout=layout, source=str(root / source), prefix=prefix)
        add("sharded>1x2", kind="load-sharded", layout="1x2", source=str(self.ckpt))
        add("errors", kind="errors", source=str(root / "hf-one"))
        self.doc = root / "doc"  # docs/huggingface.md's finetune.py, with its stand-in weights made here
        self.doc.mkdir()
        (script,) = [text for language, text in blocks(DOC) if text.startswith("# finetune.py\n")]
        (self.doc / "finetune.py").write_text(script)
        namespace: dict[str, Any] = {}
        exec(compile(script, "finetune.py", "exec"), namespace)  # defines, runs nothing (not __main__)
        cwd = os.getcwd()
        os.chdir(self.doc)
        try:
            namespace["make_stand_in"]()  # two ranks would both write it: made once, here
        finally:
            os.chdir(cwd)
        add("doc", kind="script", script=str(self.doc / "finetune.py"), cwd=str(self.doc))
        torch.save(jobs, root / "jobs.pt")
        run_batch(SCRIPT, 2, root / "jobs.pt", timeout=420)
        self.results = Results(self.outs)

    def __getitem__(self, name: str) -> Any:
        return self.results[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> HFRuns:
    return HFRuns(tmp_path_factory.mktemp("hf"))


def safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    values: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        values.update(load_file(file))
    return values


def trained(runs: HFRuns) -> dict[str, torch.Tensor]:
    """The trained Llama's weights under Hugging Face's keys, sharded attributes included."""
    fit = runs["fit"]
    values = {k.removeprefix("model.llm."): v for k, v in fit.items() if k.startswith("model.llm.")}
    for index in range(2):
        for name in ("router_table", "tp_scale"):
            values[f"model.layers.{index}.{name}"] = fit[f"attr.{index}.{name}"]
    return values


# ------------------------------------------------------------------------------------------ import


@pytest.mark.parametrize("name", sorted(LOADS))
def test_load_pretrained_into_sharded_model_is_exact(runs: HFRuns, name: str) -> None:
    loaded = runs[name]
    assert loaded["report"] == ([], [])
    expected = runs.reference.state_dict()
    assert sorted(k for k in loaded if k.startswith("model.")) == sorted(f"model.llm.{k}" for k in expected)
    differ = [k for k in expected if not torch.equal(loaded[f"model.llm.{k}"], expected[k])]
    assert not differ, f"{name}: loaded values differ from the weights for {differ}"


@pytest.mark.parametrize("name", sorted(LOADS))
def test_each_rank_reads_only_its_slices(runs: HFRuns, name: str) -> None:
    runs[name]  # the job ran
    _, layout, _, _ = LOADS[name]
    reads = [torch.load(f"{runs.outs[name]}.reads{rank}") for rank in range(2)]
    total = sum(v.numel() for v in runs.reference.state_dict().values())
    read = [sum(_numel(box) for _, box in rank_reads) for rank_reads in reads]
    # Each rank holds (and reads) half of every sharded weight; FSDP1's uneven flat shards as well.
    assert all(n < 0.7 * total for n in read), (read, total)
    assert sum(read) == total if layout != "1x2" else sum(read) >= total
    if layout == "1x2":  # colwise q_proj: rank r reads rows [16r, 16r + 16) and every column
        q_proj = "model.layers.0.self_attn.q_proj.weight"
        for rank in range(2):
            boxes = [box for key, box in reads[rank] if key == q_proj]
            assert boxes == [[(16 * rank, 16 * rank + 16), (0, 32)]], boxes


def _numel(box: list[tuple[int, int]]) -> int:
    n = 1
    for start, stop in box:
        n *= stop - start
    return n


def test_load_sharded_checkpoint_model_part_with_sharded_attributes(runs: HFRuns) -> None:
    fit, loaded = runs["fit"], runs["sharded>1x2"]
    assert loaded["report"] == ([], [])
    keys = sorted(k for k in fit if k.startswith(("model.", "attr.")))
    assert keys == sorted(k for k in loaded if k.startswith(("model.", "attr.")))
    differ = [k for k in keys if not torch.equal(fit[k], loaded[k])]
    assert not differ, f"loaded values differ from the checkpoint's for {differ}"
    assert "_StridedShard" in loaded["info.q_proj_placements"]


def test_strict_errors_are_the_same_on_every_rank(runs: HFRuns) -> None:
    runs["fit"]
    errors = [torch.load(f"{runs.outs['errors']}.rank{rank}") for rank in range(2)]
    assert errors[0] == errors[1]
    prefix, shape = errors[0]["prefix"], errors[0]["shape"]
    assert prefix.startswith(
        f"CheckpointError: Error(s) in loading the pretrained weights {str(runs.root / 'hf-one')!r}"
    )
    assert 'Missing key(s) in the weights: "llm.lm_head.weight", "llm.model.embed_tokens.weight"' in prefix
    assert 'Unexpected key(s) in the weights: "lm_head.weight", "model.embed_tokens.weight"' in prefix
    assert "... (11 more)" in prefix and "prefix='llm.' for self.llm" in prefix
    assert (
        "size mismatch for model.layers.0.mlp.down_proj.weight: the weights have shape [32, 64], the module"
        " [32, 48]" in shape
    )


# ------------------------------------------------------------------------------------------ export


def test_cli_export_bfloat16_loads_with_from_pretrained(
    runs: HFRuns, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import LlamaForCausalLM

    dst = runs.root / "export-bf16"
    code = main(
        ["consolidate", str(runs.ckpt), str(dst), "--format", "safetensors", "--dtype", "bfloat16",
         "--prefix", "llm.", "--config", str(runs.config), "--no-progress"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"Wrote {dst} (1 safetensors file; 3 files, ")
    assert sorted(os.listdir(dst)) == ["config.json", "lightning_sharded.json", "model.safetensors"]
    assert (dst / "config.json").read_bytes() == runs.config.read_bytes()
    expected = trained(runs)
    exported = safetensors_dir(dst)
    assert sorted(exported) == sorted(expected)  # the sharded attributes too, under their keys
    differ = [
        k
        for k in expected
        if exported[k].dtype != torch.bfloat16 or not torch.equal(exported[k], expected[k].bfloat16())
    ]
    assert not differ, differ

    model = LlamaForCausalLM.from_pretrained(dst)
    state = model.state_dict()
    differ = [k for k in state if not torch.equal(state[k].bfloat16(), expected[k].bfloat16())]
    assert not differ, f"from_pretrained gave other values for {differ}"
    full = llama(0)
    full.load_state_dict({k: v for k, v in expected.items() if k in full.state_dict()})
    ids = torch.randint(
        0, scenario_llama.VOCAB, (2, scenario_llama.SEQ), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, full(input_ids=ids).logits, atol=0.05, rtol=0.05
        )


def test_export_above_max_shard_size_writes_files_and_an_index(runs: HFRuns) -> None:
    from transformers import LlamaForCausalLM

    dst = consolidate_checkpoint(
        runs.ckpt, runs.root / "export-multi", format="safetensors", prefix="llm.", max_shard_size="20KB",
        config=runs.config,
    )  # fmt: skip
    assert isinstance(dst, Path)
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    count = len(files)
    assert count > 2 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    expected = trained(runs)
    assert sorted(index["weight_map"]) == sorted(expected)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in expected.values())
    for name in files:  # at most 20 KB of tensors, or one larger tensor alone
        held = [k for k, f in index["weight_map"].items() if f == name]
        size = sum(expected[k].numel() * 4 for k in held)
        assert size <= 20_000 or len(held) == 1, (name, held, size)
    exported = safetensors_dir(dst)
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    state = LlamaForCausalLM.from_pretrained(dst).state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in state)


def test_export_refuses_what_it_must_not_replace(runs: HFRuns) -> None:
    dst = runs.root / "export-again"
    consolidate_checkpoint(runs.ckpt, dst, format="safetensors", prefix="llm.")
    with pytest.raises(
        FileExistsError, match=r"exists \(a sharded checkpoint directory\)\. To replace it, pass --force"
    ):
        consolidate_checkpoint(runs.ckpt, dst, format="safetensors", prefix="llm.")
    consolidate_checkpoint(
        runs.ckpt, dst, format="safetensors", prefix="llm.", dtype="float16", overwrite=True
    )
    assert safetensors_dir(dst)["lm_head.weight"].dtype == torch.float16
    with pytest.raises(
        IsADirectoryError, match=r"is a directory that is not a checkpoint .*it is never replaced"
    ):
        consolidate_checkpoint(runs.ckpt, runs.root / "hf-one", format="safetensors", overwrite=True)
    assert sorted(os.listdir(runs.root / "hf-one")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    with pytest.raises(ValueError, match="is the source checkpoint"):
        consolidate_checkpoint(runs.ckpt, runs.ckpt / "inside", format="safetensors")


def test_export_verifies_the_source_first(runs: HFRuns, tmp_path: Path) -> None:
    import shutil

    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(runs.ckpt, damaged)
    shard = damaged / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp"):
        consolidate_checkpoint(damaged, tmp_path / "out", format="safetensors")
    assert not (tmp_path / "out").exists()


def test_cli_safetensors_flags_need_the_format(runs: HFRuns, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["consolidate", str(runs.ckpt), str(runs.root / "x.ckpt"), "--dtype", "bfloat16"]) == 2
    assert "--dtype apply to --format safetensors only" in capsys.readouterr().err


# ------------------------------------------------------------------------------- one process


def test_export_from_full_file_with_prefix_and_dtype(tmp_path: Path) -> None:
    state = {"llm.a": torch.randn(4, 3), "llm.steps": torch.arange(5), "head.w": torch.ones(2)}
    torch.save({"state_dict": state, "epoch": 1}, tmp_path / "full.ckpt")
    dst = consolidate_checkpoint(
        tmp_path / "full.ckpt", tmp_path / "hf", format="safetensors", prefix="llm.", dtype=torch.bfloat16
    )
    exported = safetensors_dir(Path(dst))
    assert sorted(exported) == ["a", "steps"]
    assert exported["a"].dtype == torch.bfloat16 and torch.equal(exported["a"], state["llm.a"].bfloat16())
    assert exported["steps"].dtype == torch.int64 and torch.equal(exported["steps"], state["llm.steps"])
    with pytest.raises(CheckpointError, match=r"has no model tensor whose key starts with the prefix 'x\.'"):
        consolidate_checkpoint(tmp_path / "full.ckpt", tmp_path / "none", format="safetensors", prefix="x.")
    with pytest.raises(ValueError, match="max_shard_size '5 parsecs' is not a size"):
        consolidate_checkpoint(
            tmp_path / "full.ckpt", tmp_path / "bad", format="safetensors", max_shard_size="5 parsecs"
        )
    with pytest.raises(ValueError, match="Unknown dtype 'int8'"):
        consolidate_checkpoint(tmp_path / "full.ckpt", tmp_path / "bad", format="safetensors", dtype="int8")
    with pytest.raises(ValueError, match="Leave dtype, prefix and config at None"):
        consolidate_checkpoint(tmp_path / "full.ckpt", tmp_path / "bad", dtype="bfloat16")


def test_export_writes_behind(droppable: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The weights leave the page cache as they reach the disk: the export does not take the output's size
    # in fresh memory (written plainly, 0.68 GB took 4.0 s of writes here, against 1.5 s for a copy).
    from lightning_sharded.checkpoint.tools import hf_export_torch
    from lightning_sharded.checkpoint.writeback import WriteBehind
    from tests._pages import resident

    state = {f"w{i}": torch.randn(1024, 1024) for i in range(4)}  # 16 MiB
    torch.save({"state_dict": state, "epoch": 1}, droppable / "full.ckpt")
    monkeypatch.setattr(hf_export_torch, "WriteBehind", lambda fd: WriteBehind(fd, window=1 << 20))
    dst = Path(consolidate_checkpoint(droppable / "full.ckpt", droppable / "hf", format="safetensors"))
    (weights,) = dst.glob("*.safetensors")
    assert weights.stat().st_size > 16 << 20 and resident(weights) < 0.5
    exported = safetensors_dir(dst)
    assert all(torch.equal(exported[key], value) for key, value in state.items())


def test_load_pretrained_plain_module_casts_and_reports(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)).to(torch.bfloat16)
    weights = {"0.weight": torch.randn(2, 3), "0.bias": torch.randn(2), "extra": torch.ones(1)}
    save_file(weights, tmp_path / "w.safetensors")
    keys = load_pretrained(module, tmp_path / "w.safetensors", strict=False)
    assert keys.missing_keys == ["1.bias", "1.weight"] and keys.unexpected_keys == ["extra"]
    assert module[0].weight.dtype == torch.bfloat16
    assert torch.equal(module[0].weight, weights["0.weight"].bfloat16())
    with pytest.raises(
        CheckpointError,
        match=r'\(strict\): Missing key\(s\) in the weights: "1\.bias", "1\.weight"\. Unexpected key\(s\)'
        r' in the weights: "extra"\.',
    ):
        load_pretrained(module, tmp_path / "w.safetensors")


def test_load_pretrained_keeps_tied_weights_tied(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**scenario_llama.config().to_dict(), "tie_word_embeddings": True})
    torch.manual_seed(2)
    source = LlamaForCausalLM(config)
    source.save_pretrained(tmp_path / "tied")
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    assert load_pretrained(model, tmp_path / "tied") == ([], [])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, source.model.embed_tokens.weight)


def test_docs_page_runs_as_written(runs: HFRuns, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/huggingface.md: ``finetune.py`` ran in the launch (``DEVICES=2``: tensor parallel over both
    ranks); here its export command (the CLI's ``main``, in this process) and the ``from_pretrained``
    snippet, in the folder it ran in."""
    import shlex

    from tests.test_docs import printed

    assert runs["doc"] == {"ran": True}
    assert (runs.doc / "finetuned.ckpt" / ".metadata").is_file()
    doc = blocks(DOC)
    (commands,) = [text for language, text in doc if language == "bash"]
    lines = commands.splitlines()
    assert lines[0] == "python finetune.py"
    old = os.getcwd()
    os.chdir(runs.doc)
    try:
        assert main(shlex.split(lines[1])[1:]) == 0
        out = capsys.readouterr().out
        assert printed(lines[2].removeprefix("# "), out), out
        snippets = [text for language, text in doc if language == "python" and not text.startswith("# ")]
        assert len(snippets) == 1
        exec(compile(snippets[0], str(DOC), "exec"), {})
    finally:
        os.chdir(old)
