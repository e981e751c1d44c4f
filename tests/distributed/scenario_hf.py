"""Hugging Face both ways, at 2 processes: every case of ``tests/test_huggingface.py`` in one process group.

    scenario_hf.py batch JOBS_FILE

``JOBS_FILE`` is a ``torch.save``'d list of ``{"kind": ..., "out": FILE, ...}`` dicts run in order; each
writes its result (or ``{"failed": traceback}``) to ``out`` from rank 0 (``errors`` from every rank).

- ``fit``: the tiny Llama of ``scenario_llama.py`` (two sharded attributes per decoder layer) trained
  2 steps under tensor parallelism x FSDP2 (``layout`` ``1x2`` or ``2x1``), saved sharded; its full values.
- ``load``: a fresh Llama (another seed) sharded under ``layout`` (``1x2``, ``2x1``: at the end of
  ``configure_model``; ``fsdp1``: in ``on_fit_start``, after Lightning wrapped it) loads ``source``
  with ``load_pretrained(self, source, prefix="llm.")``; its full values at ``on_train_start``, and
  what ``load_pretrained`` returned.
- ``load-sharded``: the ``scenario_llama`` model loads a sharded checkpoint (model part, sharded
  attributes included) into ``layout``, no prefix.
- ``errors``: plain modules with a process group up: each rank's error for a strict load with the
  wrong prefix, and for weights of another shape.
- ``script``: a script of the docs (``docs/huggingface.md``'s ``finetune.py``) run in ``cwd`` with
  ``DEVICES`` set to the world size.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_sharded import load_pretrained  # noqa: E402
from tests.distributed import scenario_llama  # noqa: E402
from tests.distributed.wrap_models import full_state_values  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def write(out: str, value: Any) -> None:
    if RANK == 0:
        torch.save(value, out)


def shard(llm: Any, mesh: Any) -> None:
    """The tensor-parallel plan of ``scenario_llama`` on every decoder layer, ``fully_shard`` per layer
    and at the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in llm.model.layers:
        plan = {name: styles[style]() for name, style in scenario_llama.PLAN.items()}
        parallelize_module(layer, mesh["tensor_parallel"], plan)
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(llm, mesh=mesh["data_parallel"])


class Pretrained(L.LightningModule):
    """A LightningModule that holds a Hugging Face Llama as ``self.llm`` and starts from ``source``."""

    def __init__(self, source: str, layout: str, prefix: str) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        torch.manual_seed(1)  # other weights than the source's
        self.llm = LlamaForCausalLM(scenario_llama.config())
        self.source, self.layout, self.prefix = source, layout, prefix
        self.report: Any = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        if self.layout == "fsdp1" or isinstance(self.llm, FSDPModule):
            return
        shard(self.llm, self.device_mesh)
        self.report = load_pretrained(self, self.source, prefix=self.prefix)

    def on_fit_start(self) -> None:
        if self.layout == "fsdp1":
            self.report = load_pretrained(self, self.source, prefix=self.prefix)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.llm(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        return scenario_llama.LlamaModule.train_dataloader(self)  # type: ignore[arg-type]


class FromSharded(scenario_llama.LlamaModule):
    """The ``scenario_llama`` model (sharded attributes too), loading a sharded checkpoint's model part."""

    def __init__(self, source: str) -> None:
        super().__init__()
        with torch.no_grad():
            for param in self.llm.parameters():  # other weights than the checkpoint's
                param.add_(1.0)
        self.source = source
        self.report: Any = None

    def configure_model(self) -> None:
        super().configure_model()
        self.report = load_pretrained(self, self.source)


class Capture(L.Callback):
    """The full values of the model and what ``load_pretrained`` returned, before the first step."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if isinstance(pl_module, scenario_llama.LlamaModule):
            values = scenario_llama.full_values(trainer, pl_module)
        else:
            values = full_state_values(trainer, lambda key: False)
        values["report"] = tuple(pl_module.report)
        write(self.out, values)
        trainer.should_stop = True  # what was loaded is captured: no step needed


def fit(job: dict[str, Any]) -> None:
    model = scenario_llama.LlamaModule()
    trainer = scenario_llama.trainer(job["layout"], 2, [])
    trainer.fit(model)
    trainer.save_checkpoint(job["ckpt"])
    write(job["out"], scenario_llama.full_values(trainer, model))


def load(job: dict[str, Any]) -> None:
    from lightning_sharded.checkpoint.tools import weight_sources

    reads: list[tuple[str, list[tuple[int, int]]]] = []
    kinds = (weight_sources.SafetensorsSlices, weight_sources.FullSlices)
    originals = [kind.get for kind in kinds]

    def recording(original: Any) -> Any:
        def get(self: Any, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
            reads.append((key, [(s.start, s.stop) for s in slices]))
            return original(self, key, slices)  # type: ignore[no-any-return]

        return get

    for kind, original in zip(kinds, originals, strict=True):
        kind.get = recording(original)  # type: ignore[method-assign]
    try:
        model = Pretrained(job["source"], job["layout"], job["prefix"])
        scenario_llama.trainer(job["layout"], 1, [Capture(job["out"])]).fit(model)
    finally:
        for kind, original in zip(kinds, originals, strict=True):
            kind.get = original  # type: ignore[method-assign]
    torch.save(reads, f"{job['out']}.reads{RANK}")


def load_sharded(job: dict[str, Any]) -> None:
    model = FromSharded(job["source"])
    scenario_llama.trainer(job["layout"], 1, [Capture(job["out"])]).fit(model)


def errors(job: dict[str, Any]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    found: dict[str, str] = {}
    holder = torch.nn.Module()
    holder.llm = LlamaForCausalLM(scenario_llama.config())
    cases = {
        "prefix": lambda: load_pretrained(holder, job["source"]),
        "shape": lambda: load_pretrained(
            LlamaForCausalLM(LlamaConfig(**{**scenario_llama.config().to_dict(), "intermediate_size": 48})),
            job["source"],
        ),
    }
    for name, case in cases.items():
        try:
            case()
            found[name] = "no error"
        except Exception as err:
            found[name] = f"{type(err).__name__}: {err}"
    torch.save(found, f"{job['out']}.rank{RANK}")


def script(job: dict[str, Any]) -> None:
    """A documented script, as ``DEVICES=<world> python SCRIPT`` in ``cwd`` would run it."""
    import runpy

    old = os.getcwd()
    os.chdir(job["cwd"])
    os.environ["DEVICES"] = str(
        scenario_llama.WORLD
    )  # the launch's (a Trainer's teardown may drop WORLD_SIZE)
    try:
        runpy.run_path(job["script"], run_name="__main__")
    finally:
        os.chdir(old)
    write(job["out"], {"ran": True})


JOBS = {"fit": fit, "load": load, "load-sharded": load_sharded, "errors": errors, "script": script}


def main(jobs_file: str) -> None:
    for job in torch.load(jobs_file, weights_only=False):
        started = time.perf_counter()
        try:
            JOBS[job["kind"]](job)
        except BaseException:
            print(f"rank {RANK}: job {job['kind']} failed:\n{traceback.format_exc()}", flush=True)
            write(job["out"], {"failed": traceback.format_exc()})
        if dist.is_initialized():
            dist.barrier()
        print(f"job {job['kind']} {job.get('layout', '')}: {time.perf_counter() - started:.2f}s", flush=True)


if __name__ == "__main__":
    assert sys.argv[1] == "batch"
    main(sys.argv[2])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
