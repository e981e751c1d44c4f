"""One rank of a fit-and-save or a resume under torchrun, with the Trainer sized from the environment.

    scenario_multinode.py fit|resume --strategy mp,fsdp --ckpt DIR --out DIR

Each strategy of the comma-separated list runs in turn in the same ranks (one launch, several
Trainers), with its checkpoint at ``DIR/<strategy>.ckpt`` and its values in ``OUT/<strategy>.pt``.

``num_nodes`` and ``devices`` come from torchrun's environment (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``),
so the same script runs as 2 nodes x 1 process or 1 node x 2 processes. Values are gathered and
written as in ``scenario_resume.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lightning as L
import torch.distributed as dist

from tests.distributed import scenario_resume as scenario


def main(argv: list[str]) -> None:
    args = scenario.make_parser().parse_args(argv)
    for strategy in args.strategy.split(","):
        job = argparse.Namespace(**vars(args))
        job.strategy = strategy
        job.ckpt = args.ckpt / f"{strategy}.ckpt"
        job.out = args.out / f"{strategy}.pt"
        run(job)
    dist.barrier()
    dist.destroy_process_group()
    # Every result is written. Two Trainers of different strategies in one process sometimes abort
    # in a C++ destructor at interpreter exit ("terminate called without an active exception"),
    # which torchrun would report as a failed rank; skip the interpreter's teardown.
    sys.stdout.flush()
    os._exit(0)


def run(args: argparse.Namespace) -> None:
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    common = {
        "accelerator": "cpu",
        "devices": local,
        "num_nodes": world // local,
        "strategy": scenario.make_strategy(args, world),
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
    }
    model = scenario.make_model(args)
    if args.phase == "fit":
        trainer = L.Trainer(max_steps=args.steps, limit_val_batches=0, **common)
        trainer.fit(model)
        assert type(trainer.strategy.cluster_environment).__name__ == "TorchElasticEnvironment"
        assert trainer.num_nodes == world // local
        trainer.save_checkpoint(args.ckpt)
        scenario.write(args.out, scenario.full_values(trainer, model))
    else:
        capture = scenario.Capture(args.out)
        trainer = L.Trainer(max_steps=args.steps + 1, limit_val_batches=0, callbacks=[capture], **common)
        trainer.fit(model, ckpt_path=args.ckpt)


if __name__ == "__main__":
    main(sys.argv[1:])
