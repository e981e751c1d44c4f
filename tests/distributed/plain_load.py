"""``WrapModel.load_from_checkpoint(DIR)`` in one plain process (no process group), as for inference.

    plain_load.py CHECKPOINT_DIR OUT_FILE [CHECKPOINT_DIR OUT_FILE ...]

For each checkpoint, writes the loaded model's values (parameters by name, each sharded attribute by
place), the keys of the checkpoint dict handed to Lightning, and the top-level keys of every tensor
entry read from the directory.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_sharded.checkpoint import tools  # noqa: E402
from lightning_sharded.checkpoint.tools.reader import OfflineReader  # noqa: E402
from tests.distributed.wrap_models import WrapModel  # noqa: E402

read: list[Any] = []  # top-level keys of every tensor entry read from a directory
handed: list[str] = []  # the keys of the checkpoint dict handed to Lightning


def spy() -> None:
    """Record what the mixin's load reads (tensor entries) and hands on (checkpoint keys)."""
    reader_cls = OfflineReader
    original_read, original_load = reader_cls.read_tensors, tools.load_checkpoint

    def read_tensors(self: Any, targets: dict[str, torch.Tensor], on_tensor: Any) -> None:
        read.extend(self.path_of(key)[0] for key in targets)
        original_read(self, targets, on_tensor)

    def load_checkpoint(*args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = original_load(*args, **kwargs)
        handed.extend(sorted(checkpoint))
        return checkpoint

    reader_cls.read_tensors = read_tensors  # type: ignore[method-assign]
    tools.load_checkpoint = load_checkpoint  # type: ignore[assignment]  # what the mixin imports


def main(ckpt: str, out: str) -> None:
    read.clear()
    handed.clear()
    model = WrapModel.load_from_checkpoint(ckpt)
    assert not dist.is_initialized()
    values = {f"model.{k}": v for k, v in model.state_dict().items()}
    for place, holder in model.holders().items():
        for name in ("table", "cache"):
            value = getattr(holder, name)
            values[f"attr.{place}.{name}"] = value
            values[f"type.{place}.{name}"] = type(value).__name__
    result = {"values": values, "read": sorted(set(read)), "handed": list(handed)}
    torch.save({**result, "wrapping": model.hparams.wrapping}, out)


if __name__ == "__main__":
    spy()
    pairs = sys.argv[1:]
    for index in range(0, len(pairs), 2):
        main(pairs[index], pairs[index + 1])
