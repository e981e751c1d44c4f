"""What a model-only load reads, and what a trainable-only save writes, against the whole checkpoint.

Usage, from the repository root as every benchmark: ``python -m benchmarks.partial_load [--hidden 1024]
[--layers 8] [--rank 8] [--out DIR]``. Self-contained (imports only torch, Lightning and
``lightning_sharded``); counts bytes, so a shared machine gives the same figures as an idle one.

1. **Bytes read.** A model of ``--layers`` ``Linear(hidden, hidden)`` and its Adam state (one step) are
   saved as a sharded directory and as a full file, as the strategies write them. Each is then loaded
   into a fresh model twice with :func:`lightning_sharded.checkpoint.load.restore_checkpoint`, the
   function both strategies' resume and warm start call: with the optimizer (a resume), and without it
   and without ``meta.pt`` (a model-only load: ``warm_start=`` or ``exclude_from_loading=
   ['optimizer_states']``). Before each load the checkpoint's pages are dropped from the page cache
   (``posix_fadvise(DONTNEED)``, after the files were fsynced), and ``/proc/self/io`` counts what the
   load made storage deliver (``read_bytes``, read-ahead included) and what it read through system
   calls (``rchar``; a memory-mapped full file is read by page faults, which ``rchar`` does not see).
2. **Trainable-only size.** A frozen base of the same layers with a LoRA adapter of ``--rank`` on each
   layer trains one step under ``ShardedModelParallelStrategy`` (one process) and saves sharded, once
   complete and once with ``save_trainable_only=True``; the table gives both directories' sizes.

It prints both tables (Markdown) and, with ``--out``, writes their figures as ``partial_load.json``
(``--out benchmarks/results``: the file the tables of docs/benchmarks.md are tested against).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

MIB = 1 << 20


def io_counters() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (Linux)."""
    counters = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            counters[key] = int(value)
    return counters


def files(path: Path) -> Iterator[Path]:
    yield from ([path] if path.is_file() else (p for p in path.rglob("*") if p.is_file()))


def drop_cache(path: Path) -> None:
    """Drop every file of ``path`` from the page cache (they were fsynced by the commit)."""
    for file in files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_ahead_kb() -> str:
    """The read-ahead of the device under the temporary folder, as the kernel reports it (or "?")."""
    dev = os.stat(tempfile.gettempdir()).st_dev
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (block / "queue", block / ".." / "queue"):  # a disk, or a partition of one
        try:
            return (queue / "read_ahead_kb").read_text().strip()
        except OSError:
            continue
    return "?"


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in files(path))


def layers(hidden: int, count: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(hidden, hidden) for _ in range(count)))


def adam_after_one_step(model: nn.Sequential) -> torch.optim.Adam:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    first = model[0]
    assert isinstance(first, nn.Linear)
    model(torch.randn(2, first.in_features)).sum().backward()
    optimizer.step()
    return optimizer


def save_both(root: Path, hidden: int, count: int) -> dict[str, Path]:
    """The same model and Adam state as a sharded directory and a full file, as the strategies write."""
    from lightning_sharded.checkpoint import save, state_dicts

    torch.manual_seed(0)
    model = layers(hidden, count)
    optimizer = adam_after_one_step(model)
    sharded, full = root / "sharded.ckpt", root / "full.ckpt"
    checkpoint: dict[str, Any] = {
        "state_dict": state_dicts.model_state_dict(model, full=False),
        "optimizer_states": [state_dicts.optimizer_state_dict(model, optimizer, full=False)],
        "epoch": 0,
        "global_step": 1,
    }
    save.save_checkpoint(sharded, checkpoint, sharded=True, model_key="state_dict", rank=0)
    checkpoint = {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "epoch": 0,
        "global_step": 1,
    }
    save.save_checkpoint(full, checkpoint, sharded=False, model_key="state_dict", rank=0)
    return {"sharded": sharded, "full": full}


def measure_load(path: Path, hidden: int, count: int, *, with_optimizer: bool) -> dict[str, int]:
    from lightning_sharded.checkpoint.load import restore_checkpoint

    torch.manual_seed(1)
    model = layers(hidden, count)
    optimizers = [torch.optim.Adam(model.parameters(), lr=1e-3)] if with_optimizer else []
    drop_cache(path)
    before = io_counters()
    restore_checkpoint(path, model, optimizers, read_metadata=with_optimizer)
    after = io_counters()
    return {key: after[key] - before[key] for key in ("read_bytes", "rchar")}


def bytes_read(root: Path, hidden: int, count: int) -> list[dict[str, Any]]:
    rows = []
    model_bytes = count * (hidden * hidden + hidden) * 4
    saved = save_both(root, hidden, count)
    for path in saved.values():  # once unmeasured: the first load imports DCP's modules, reading them
        measure_load(path, hidden, count, with_optimizer=True)
    for kind, path in saved.items():
        total = size(path)
        for what, with_optimizer in (("model + Adam (resume)", True), ("model only (warm start)", False)):
            read = measure_load(path, hidden, count, with_optimizer=with_optimizer)
            rows.append(
                {
                    "checkpoint": kind,
                    "load": what,
                    "checkpoint_bytes": total,
                    "model_bytes": model_bytes,
                    **read,
                    "fraction_read": read["read_bytes"] / total,
                }
            )
    return rows


class Lora(nn.Module):
    """A frozen ``Linear`` and a trainable low-rank adapter beside it."""

    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(hidden, hidden)
        self.base.requires_grad_(False)
        self.a = nn.Linear(hidden, rank, bias=False)
        self.b = nn.Linear(rank, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + self.b(self.a(x))
        return out


def trainable_only(root: Path, hidden: int, count: int, rank: int) -> list[dict[str, Any]]:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sharded import ShardedModelParallelStrategy

    class LoraModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.Sequential(*(Lora(hidden, rank) for _ in range(count)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.blocks(batch[0]).pow(2).mean()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    # The frozen source: the base weights the run started from (here saved by the benchmark itself).
    source = root / "base.pt"
    base = {k: v for k, v in LoraModel().state_dict().items() if ".base." in k}
    torch.save(base, source)
    rows: list[dict[str, Any]] = []
    for what, trainable in (("complete", False), ("trainable only", True)):
        strategy = (
            ShardedModelParallelStrategy(
                fully_shard_policy={Lora}, save_trainable_only=True, frozen_source=source
            )
            if trainable
            else ShardedModelParallelStrategy(fully_shard_policy={Lora})
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy,
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        data = DataLoader(TensorDataset(torch.randn(4, hidden)), batch_size=2)
        trainer.fit(LoraModel(), data)
        path = root / f"lora-{what.replace(' ', '-')}.ckpt"
        trainer.save_checkpoint(path)
        rows.append({"checkpoint": what, "bytes": size(path)})
    for row in rows:
        row["fraction"] = row["bytes"] / rows[0]["bytes"]
    frozen = count * (hidden * hidden + hidden) * 4
    adapter = count * 2 * rank * hidden * 4
    for row in rows:
        row["frozen_base_bytes"], row["adapter_bytes"] = frozen, adapter
    return rows


def tables(reads: list[dict[str, Any]], sizes: list[dict[str, Any]], read_ahead: str | None = None) -> str:
    """Both tables in Markdown, as docs/benchmarks.md shows them (``read_ahead``: KiB; None: here)."""
    lines = [
        "| checkpoint | load | checkpoint size | read from storage | read by syscalls | read / size |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in reads:
        lines.append(
            f"| {r['checkpoint']} | {r['load']} | {r['checkpoint_bytes'] / MIB:.1f} MiB |"
            f" {r['read_bytes'] / MIB:.1f} MiB | {r['rchar'] / MIB:.1f} MiB | {r['fraction_read']:.2f} |"
        )
    lines.append(
        f"\nThe model alone is {reads[0]['model_bytes'] / MIB:.1f} MiB of float32; the storage's read-ahead"
        f" here is {read_ahead_kb() if read_ahead is None else read_ahead} KiB.\n"
    )
    lines += ["| LoRA checkpoint (sharded) | size | of the complete one |", "|---|---:|---:|"]
    for r in sizes:
        lines.append(f"| {r['checkpoint']} | {r['bytes'] / MIB:.2f} MiB | {r['fraction']:.3f} |")
    r = sizes[0]
    lines.append(
        f"\nFrozen base {r['frozen_base_bytes'] / MIB:.1f} MiB, adapter {r['adapter_bytes'] / MIB:.2f} MiB"
        " (its Adam state twice that)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8, help="the LoRA adapter's rank")
    parser.add_argument("--out", type=Path, help="also write partial_load.json here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="partial-load-"))
    try:
        reads = bytes_read(root, args.hidden, args.layers)
        sizes = trainable_only(root, args.hidden, args.layers, args.rank)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(tables(reads, sizes))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"reads": reads, "sizes": sizes, "read_ahead_kb": read_ahead_kb()}
        (args.out / "partial_load.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
