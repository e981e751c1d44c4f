"""Every multi-process job the strategy tests need, run in four launches for the whole session.

Checkpoints (fits) first, 2 processes then 1; then resumes, evaluations and error cases, 2 then 1.
Names: a fit is named after its checkpoint (``fsdp2``: ShardedFSDPStrategy, 2 processes); a resume is
``CHECKPOINT>STRATEGY@WORLD``.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import torch

from tests.distributed.launch import Batch, Results
from tests.walks import WALKS_ENV

FSDP = ("--strategy", "fsdp", "--sharded-tensor")
MP = ("--strategy", "mp", "--sharded-tensor")
MP_POLICY = (*MP, "--policy")
STOCK_FSDP = ("--strategy", "stock-fsdp", "--sharded-tensor")
STOCK_MP = ("--strategy", "stock-mp", "--sharded-tensor")
SINGLE = ("--strategy", "single", "--sharded-tensor")  # a plain single-device Trainer, no process group
# Our resumes check the checksums from their own reads: at every world size and across strategies, a
# whole checkpoint must pass and load the same values, read straight into the model (verify="during")
# or beside it and copied in (verify=True: FSDP1's views of its flat shards, FSDP2's DTensors).
RESUMERS = {
    "fsdp": (*FSDP, "--verify", "before"),
    "mp": (*MP, "--verify", "during"),
    "mp-policy": (*MP_POLICY, "--verify", "before"),
    "stock-fsdp": STOCK_FSDP,
    "stock-mp": STOCK_MP,
}

# name -> (world size, flags). Jobs run in this order within a world size; "single" jobs come first
# among the 1-process jobs, before any process group exists in that process.
FITS: dict[str, tuple[int, tuple[str, ...]]] = {
    "fsdp2": (2, (*FSDP, "--top-k", "{root}/fsdp2-topk", "--overwrite")),
    "mp2": (2, (*MP, "--overwrite")),
    "stock-fsdp2": (2, STOCK_FSDP),
    "stock-mp2": (2, STOCK_MP),
    "fsdp2-full": (2, (*FSDP, "--state-dict-type", "full", "--overwrite")),
    "mp2-full": (2, (*MP, "--state-dict-type", "full")),
    "single": (1, SINGLE),
    "fsdp1": (1, FSDP),
    "mp1": (1, MP_POLICY),  # a plain model sharded by the strategy's fully_shard policy
}

RESUMES: list[tuple[str, str, int]] = [
    # (checkpoint, strategy, world)
    ("fsdp2-full", "single", 1),  # stock single-device Trainer resumes our "full" file
    ("fsdp2", "fsdp", 2),
    ("fsdp2", "fsdp", 1),
    ("fsdp1", "fsdp", 2),
    ("mp2", "mp", 2),
    ("mp2", "mp", 1),
    ("mp1", "mp", 2),
    ("mp1", "mp-policy", 2),
    # FSDP1 <-> FSDP2
    ("fsdp2", "mp", 1),
    ("fsdp1", "mp", 2),
    ("mp2", "fsdp", 2),
    ("mp2", "fsdp", 1),
    ("mp1", "fsdp", 2),
    # stock checkpoints in, our checkpoints out to stock strategies
    ("stock-fsdp2", "fsdp", 1),
    ("stock-mp2", "fsdp", 2),
    ("stock-mp2", "mp", 1),
    ("fsdp2", "stock-fsdp", 2),
    ("mp2", "stock-mp", 2),
    # full files
    ("single", "fsdp", 2),
    ("mp2-full", "mp", 1),
]


def resume_name(ckpt: str, strategy: str, world: int) -> str:
    return f"{ckpt}>{strategy}@{world}"


def error_cases(root: Path) -> list[dict[str, Any]]:
    """Broken paths and checkpoints that do not fit, each with the model flags that load it."""
    good, full = root / "fsdp2", root / "single"
    broken = root / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "empty").mkdir(exist_ok=True)
    (broken / "not-a-checkpoint").mkdir(exist_ok=True)
    (broken / "not-a-checkpoint" / "notes.txt").write_text("hello")
    for name, drop in (("no-meta", "meta.pt"), ("no-index", ".metadata")):
        shutil.copytree(good, broken / name, dirs_exist_ok=True)
        (broken / name / drop).unlink()
    shutil.copytree(good, broken / "truncated-shard", dirs_exist_ok=True)
    shard = broken / "truncated-shard" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:64])
    corrupt_bytes(good, broken / "corrupt-entry", "optimizer_0.param_groups.0.lr")
    (broken / "garbage.ckpt").write_bytes(b"\x00not a checkpoint" * 8)
    torch.save({"weights": torch.zeros(2)}, broken / "not-lightning.ckpt")
    return [
        {"name": "missing", "ckpt": str(root / "does-not-exist"), "args": {}},
        {"name": "empty", "ckpt": str(broken / "empty"), "args": {}},
        {"name": "not-a-checkpoint", "ckpt": str(broken / "not-a-checkpoint"), "args": {}},
        {"name": "no-meta", "ckpt": str(broken / "no-meta"), "args": {}},
        {"name": "no-index", "ckpt": str(broken / "no-index"), "args": {}},
        {"name": "truncated-shard", "ckpt": str(broken / "truncated-shard"), "args": {}},
        {"name": "corrupt-entry", "ckpt": str(broken / "corrupt-entry"), "args": {}},
        {"name": "garbage-file", "ckpt": str(broken / "garbage.ckpt"), "args": {}},
        {"name": "not-lightning-file", "ckpt": str(broken / "not-lightning.ckpt"), "args": {}},
        # keys and shapes: without the "cache" attribute the checkpoints have, or with an "extra" buffer
        {"name": "unexpected-strict", "ckpt": str(good), "args": {"sharded_tensor": False}},
        {"name": "missing-strict", "ckpt": str(good), "args": {"extra": True}},
        {"name": "missing-strict-full", "ckpt": str(full), "args": {"extra": True}},
        {
            "name": "unexpected-strict-full",
            "ckpt": str(root / "fsdp2-full"),
            "args": {"sharded_tensor": False},
        },
        {"name": "size-mismatch", "ckpt": str(good), "args": {"hidden": 32}},
        {"name": "size-mismatch-full", "ckpt": str(full), "args": {"hidden": 32}},
        {"name": "optimizer-count", "ckpt": str(good), "args": {"model": "two-optimizers"}},
        {"name": "optimizer-count-full", "ckpt": str(full), "args": {"model": "two-optimizers"}},
        # non-strict: the overlap loads, the rest stays as it was
        {
            "name": "non-strict-unexpected",
            "ckpt": str(good),
            "args": {"sharded_tensor": False, "non_strict": True},
        },
        {"name": "non-strict-missing", "ckpt": str(good), "args": {"extra": True, "non_strict": True}},
    ]


def corrupt_bytes(src: Path, dst: Path, key: str) -> None:
    """Copy the checkpoint ``src`` to ``dst`` and overwrite the bytes of one entry (sizes unchanged)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    shutil.copytree(src, dst, dirs_exist_ok=True)
    storage = FileSystemReader(str(dst)).read_metadata().storage_data
    info = next(info for index, info in storage.items() if index.fqn == key)
    with open(dst / info.relative_path, "r+b") as file:
        file.seek(info.offset)
        file.write(b"\xff" * info.length)


def fingerprint(path: Path) -> dict[str, str]:
    """Name -> sha256 of every file under ``path`` (or of ``path`` itself)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


class Session:
    """Runs the whole plan once; holds the results and the checkpoints' fingerprints."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.walks = root / "walks"
        self.walks.mkdir()
        batch = Batch(root, env={WALKS_ENV: str(self.walks)})
        for name, (world, flags) in FITS.items():
            batch.add(name, world, "fit", "--ckpt", str(root / name), *(f.format(root=root) for f in flags))
        batch.run()
        self.before = {name: fingerprint(root / name) for name in ("fsdp2", "single", "fsdp2-full")}
        torch.save(error_cases(root), root / "cases.pt")
        for ckpt, strategy, world in RESUMES:
            name = resume_name(ckpt, strategy, world)
            flags = SINGLE if strategy == "single" else RESUMERS[strategy]
            batch.add(name, world, "resume", "--ckpt", str(root / ckpt), *flags)
        batch.add("evaluate", 2, "evaluate", "--ckpt", str(root / "fsdp2"), *FSDP)
        batch.add("errors", 2, "errors", "--cases", str(root / "cases.pt"), *FSDP)
        batch.run()
        self.after = {name: fingerprint(root / name) for name in self.before}
        self.results = Results(batch.outs)

    def __getitem__(self, name: str) -> Any:
        return self.results[name]
