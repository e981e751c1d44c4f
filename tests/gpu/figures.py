"""The CUDA issue's figures for async saves, one process, each against its baseline in the same run.

Usage: ``python tests/gpu/figures.py --device cuda --out DIR [--size-gb 2]``. For each strategy
(``ShardedModelParallelStrategy``, ``ShardedFSDPStrategy``) it fits a model of ``--size-gb`` of
weights and Adam state on one device (NCCL at world size 1), and after the second step saves:

1. synchronously (the baseline of the stall);
2. async once, so the pinned staging buffers exist (a steady run reuses them);
3. async again, measured: the stall (how long ``trainer.save_checkpoint`` blocked training) against
   the synchronous save (target <= 0.10); the peak device memory from the save's start to the end of
   its background write against the memory allocated before it (target <= 1.1); the staging rate
   (bytes staged / staging seconds) against a plain pinned device-to-host copy of as many bytes
   (target >= 0.8).

Then it resumes a fresh Trainer from the async checkpoint and checks that the weights are those saved.
Figures go to ``DIR/figures.json`` and are printed with their targets; a missed target is reported,
not raised (these are measurements; the tests are ``pytest -m gpu``). ``--device cpu`` runs the same
steps on CPU with gloo (no device-memory figure, a plain copy as the baseline): what the test suite
runs to keep this script working where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# The model of the benchmarks (bias-free Linear(width, width) layers, Adam) and its strategies.
from benchmarks.builders import BenchModel, make_strategy  # noqa: E402

TARGETS = {
    "stall_vs_sync": ("<=", 0.10),
    "peak_vs_before": ("<=", 1.1),
    "staging_vs_pinned_copy": (">=", 0.8),
}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def plain_copy_gbps(nbytes: int, device: str) -> float:
    """GB/s of one copy of ``nbytes`` from the device into page-locked host memory (CPU: a plain copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=device == "cuda")
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


class Measure(L.Callback):
    """After the second training step: the saves of the module docstring, and their figures."""

    def __init__(self, out: Path, device: str) -> None:
        self.out, self.device = out, device
        self.figures: dict[str, Any] = {}
        self.saved: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step != 2:
            return
        strategy: Any = trainer.strategy
        device = self.device
        strategy.async_save = False
        synchronize(device)
        start = time.perf_counter()
        trainer.save_checkpoint(self.out / "sync")
        sync_s = time.perf_counter() - start

        strategy.async_save = True
        trainer.save_checkpoint(self.out / "async")  # the staging buffers are made here
        strategy.wait_for_checkpoint()

        synchronize(device)
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer.save_checkpoint(self.out / "async")
        stall_s = time.perf_counter() - start
        saver = strategy._async_saver
        # On CUDA everything is copied before the call returns; on CPU the optimizer state after it.
        staged_bytes, staging_s = saver.buffers.copied_bytes, saver.last_stall_s
        deferred_bytes = saver.buffers.deferred_bytes
        self.saved = model_values(trainer)
        strategy.wait_for_checkpoint()
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0

        # On CPU a step's parameters are deferred too: then nothing is copied before the call returns.
        staging_gbps = staged_bytes / staging_s / 1e9 if staged_bytes else None
        copy_gbps = plain_copy_gbps(staged_bytes, device) if staged_bytes else None
        self.figures = {
            "sync_save_s": sync_s,
            "async_stall_s": stall_s,
            "stall_vs_sync": stall_s / sync_s,
            "staged_gb": (staged_bytes + deferred_bytes) / 1e9,
            "deferred_gb": deferred_bytes / 1e9,
            "staging_s": staging_s,
            "staging_gbps": staging_gbps,
            "pinned_copy_gbps": copy_gbps,
            "staging_vs_pinned_copy": staging_gbps / copy_gbps if staging_gbps and copy_gbps else None,
        }
        if device == "cuda":
            self.figures.update(
                allocated_before_gb=before / 1e9,  # model + optimizer shard (+ gradients) on the device
                peak_gb=peak / 1e9,
                peak_vs_before=peak / before,
                extra_vs_staged=(peak - before) / staged_bytes,  # a second device copy would be ~1.0
            )


def model_values(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The whole weights, gathered with torch's own helper, on CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(trainer.strategy.model, options=options)
    return {key: value.detach().cpu().clone() for key, value in state.items()}


def trainer_for(name: str, device: str, steps: int, callbacks: list[Any]) -> L.Trainer:
    return L.Trainer(
        accelerator=device,
        devices=1,
        strategy=make_strategy(f"ours-{name}", 1),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


class Restored(L.Callback):
    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.values = model_values(trainer)


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    hidden = args.hidden
    layers = max(1, round(args.size_gb * 1e9 / (hidden * hidden * 4 * 3)))  # weights + Adam's 2 states
    measure = Measure(out, args.device)
    trainer_for(name, args.device, 3, [measure]).fit(BenchModel(hidden, layers, name == "mp"))
    restored = Restored()
    trainer_for(name, args.device, 4, [restored]).fit(
        BenchModel(hidden, layers, name == "mp"), ckpt_path=out / "async"
    )
    differ = sorted(k for k in measure.saved if not torch.equal(measure.saved[k], restored.values.get(k)))
    return {
        **measure.figures,
        "layers": layers,
        "hidden": hidden,
        "restored_equal": not differ,
        "differ": differ,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--strategies", default="mp,fsdp")
    args = parser.parse_args()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    report: dict[str, Any] = {"device": device_name, "torch": torch.__version__, "size_gb": args.size_gb}
    for name in args.strategies.split(","):
        report[name] = run(name, args)
    (args.out / "figures.json").write_text(json.dumps(report, indent=1))
    print(f"device: {device_name}, torch {torch.__version__}, model + Adam {args.size_gb} GB")
    ok = True
    for name in args.strategies.split(","):
        figures = report[name]
        ok &= figures["restored_equal"]
        print(
            f"{name}: restored from the async checkpoint equal to what was saved: {figures['restored_equal']}"
        )
        for key, value in figures.items():
            if isinstance(value, float):
                op, target = TARGETS.get(key, (None, None))
                met = (
                    ""
                    if op is None
                    else (" met" if (value <= target if op == "<=" else value >= target) else " MISSED")
                )
                goal = "" if op is None else f"  (target {op} {target}{met})"
                print(f"  {key:24s} {value:10.3f}{goal}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
