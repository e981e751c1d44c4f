"""One rank of a Lightning fit whose checkpoint save or resume one rank never finishes.

Run by ``tests/test_rank_faults.py`` on 2 ranks with ``LIGHTNING_SHARDED_FAULT`` telling rank 1 to
hang (``after_write@1:hang`` for the save, ``before_read@1:hang`` for the resume):

    scenario_timeout.py save|resume --ckpt PATH --out FILE --timeout SECONDS

``save`` fits 2 steps, then saves to PATH; ``resume`` resumes from PATH (a checkpoint saved before,
without the fault). Both with ``ShardedModelParallelStrategy(checkpoint_timeout=SECONDS)``. Rank 0
writes to FILE what ``trainer.save_checkpoint`` or ``trainer.fit`` raised and how long it took.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_sharded import ShardedModelParallelStrategy  # noqa: E402
from tests.distributed.models import ShardedModel  # noqa: E402
from tests.fault_injection import install  # noqa: E402

install()  # LIGHTNING_SHARDED_FAULT, set by the test


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["prepare", "save", "resume"])
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args(argv)
    strategy = ShardedModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, checkpoint_timeout=args.timeout
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2 if args.phase != "resume" else 3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = ShardedModel()
    started = time.monotonic()
    try:
        if args.phase == "resume":
            started = time.monotonic()
            trainer.fit(model, ckpt_path=args.ckpt)
        else:
            trainer.fit(model)
            started = time.monotonic()
            trainer.save_checkpoint(args.ckpt)
    except BaseException as err:
        if trainer.global_rank == 0:
            result = {"type": type(err).__name__, "message": str(err), "elapsed": time.monotonic() - started}
            args.out.write_text(json.dumps(result))
        raise SystemExit(4) from None
    if trainer.global_rank == 0:
        args.out.write_text(json.dumps({"type": None, "elapsed": time.monotonic() - started}))


if __name__ == "__main__":
    main(sys.argv[1:])
