"""Peak memory of the Hugging Face export and of ``load_pretrained``, against model size and largest tensor.

Usage: ``python -m benchmarks.hf_memory [--dir DIR] [--sizes 256,1024] [--largest 32] [--json OUT]``
(sizes and largest tensor in MiB; ``--quick``: sizes 16,64 and largest 4).

For each model size, a sharded checkpoint (DCP, two ``float32`` tensors per "layer", the largest one
``--largest`` MiB) is written, then each operation runs in a fresh process that reports how much its
memory grew over what it held before (imports done; for a load, the module's own weights already
resident):

- ``export``: ``consolidate_checkpoint(format="safetensors", dtype=bfloat16)`` of the checkpoint;
- ``export-naive``: what one writes without the tool: ``load_checkpoint`` (the whole model in memory),
  cast, ``safetensors.torch.save_file`` of the dict;
- ``load``: ``load_pretrained`` of the export into a plain module (one process: it reads every slice);
- ``load-naive``: ``safetensors.torch.load_file`` of the whole directory, then ``load_state_dict``.

Two figures per run: ``VmHWM`` (the kernel's peak resident set, which also counts pages of
memory-mapped files that were read, such as safetensors files ``safe_open`` maps) and the peak of
``RssAnon`` (anonymous memory only: what the process itself allocated), sampled every millisecond.
Ratios are printed against the model size and the largest tensor, from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import ROOT

MIB = 1 << 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _Sampler:
    """The peak of ``RssAnon`` while it runs, sampled in a thread."""

    def __init__(self) -> None:
        self.peak = _status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status("RssAnon"))
            time.sleep(0.001)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def _module(layers: int, largest: int) -> Any:
    import torch

    module = torch.nn.Module()
    for i in range(layers):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.zeros(largest // 4 // 1024, 1024))
        layer.bias = torch.nn.Parameter(torch.zeros(largest // 16 // 1024, 1024))
        module.add_module(f"layer{i}", layer)
    return module


def make_checkpoint(path: Path, mib: int, largest_mib: int) -> tuple[int, int, int]:
    """A sharded checkpoint of about ``mib`` MiB; returns (model bytes, largest tensor bytes, layers)."""
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    largest = largest_mib * MIB
    layers = max(1, round(mib * MIB / (largest * 1.25)))
    module = _module(layers, largest)
    state = {k: torch.randn(v.shape) for k, v in module.state_dict().items()}
    path.mkdir(parents=True)
    _save_state_dict({"state_dict": state}, FileSystemWriter(path), no_dist=True)
    torch.save({"epoch": 0, "global_step": 0, "layers": layers}, path / "meta.pt")
    return sum(v.numel() * 4 for v in state.values()), largest, layers


def child(op: str, src: str, dst: str, layers: int, largest: int) -> dict[str, float]:
    """Runs in a fresh process: one operation, with its memory growth."""
    # Everything each operation imports is imported before the baseline: only its data counts.
    import safetensors.torch  # noqa: F401
    import torch
    import torch.distributed.checkpoint.default_planner
    import torch.distributed.checkpoint.state_dict_loader

    import lightning_sharded.checkpoint.tools.hf_export  # noqa: F401
    from lightning_sharded import consolidate_checkpoint, load_checkpoint, load_pretrained

    module = _module(layers, largest) if op.startswith("load") else None
    base_anon, base_rss = _status("RssAnon"), _status("VmRSS")
    started = time.perf_counter()
    with _Sampler() as sampler:
        if op == "export":
            consolidate_checkpoint(src, dst, format="safetensors", dtype=torch.bfloat16, progress=False)
        elif op == "export-naive":
            from safetensors.torch import save_file

            state = load_checkpoint(src, optimizer_states=False)["state_dict"]
            state = {k: v.to(torch.bfloat16) for k, v in state.items()}
            os.makedirs(dst)
            save_file(state, os.path.join(dst, "model.safetensors"))
            del state
        elif op == "load":
            assert module is not None
            load_pretrained(module, src)
        elif op == "load-naive":
            from safetensors.torch import load_file

            assert module is not None
            state = {}
            for name in sorted(os.listdir(src)):
                if name.endswith(".safetensors"):
                    state.update(load_file(os.path.join(src, name)))
            module.load_state_dict(state)
            del state
    return {
        "seconds": time.perf_counter() - started,
        "anon_peak": float(sampler.peak - base_anon),
        "hwm_peak": float(_status("VmHWM") - base_rss),
    }


def run_child(op: str, src: Path, dst: Path, layers: int, largest: int) -> dict[str, float]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.hf_memory",
            "--child",
            op,
            str(src),
            str(dst),
            str(layers),
            str(largest),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{op} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    figures: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.hf_memory", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--sizes", default="256,1024", help="model sizes in MiB")
    parser.add_argument("--largest", type=int, default=32, help="largest tensor in MiB")
    parser.add_argument("--quick", action="store_true", help="sizes 16,64, largest 4 MiB")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        op, src, dst, layers, largest = args.child
        print(json.dumps(child(op, src, dst, int(layers), int(largest))))
        return
    sizes = [16, 64] if args.quick else [int(s) for s in args.sizes.split(",")]
    largest_mib = 4 if args.quick else args.largest
    folder = args.dir or Path(tempfile.mkdtemp(prefix="hf-memory-"))
    rows = []
    print(f"{'model':>9} {'largest':>8}  {'operation':<13} {'RssAnon peak':>12} {'VmHWM peak':>11}"
          f"  {'/ model':>7} {'/ largest':>9} {'seconds':>8}")  # fmt: skip
    for mib in sizes:
        ckpt = folder / f"ckpt-{mib}"
        total, largest, layers = make_checkpoint(ckpt, mib, largest_mib)
        for op in ("export", "export-naive", "load", "load-naive"):
            dst = folder / f"{op}-{mib}"
            src = {"export": ckpt, "export-naive": ckpt, "load": folder / f"export-{mib}"}.get(
                op, folder / f"export-{mib}"
            )
            figures = run_child(op, src, dst, layers, largest)
            row = {"model_bytes": total, "largest_bytes": largest, "operation": op, **figures}
            rows.append(row)
            print(
                f"{total / MIB:7.0f}Mi {largest / MIB:6.0f}Mi  {op:<13} {figures['anon_peak'] / MIB:10.1f}Mi"
                f" {figures['hwm_peak'] / MIB:9.1f}Mi  {figures['anon_peak'] / total:7.2f}"
                f" {figures['anon_peak'] / largest:9.2f} {figures['seconds']:8.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
