"""Fit, then evaluate and fit again, with the same model object in the same process (issue 47).

Usage: ``scenario_after_fit.py OUT`` on 2 ranks (``tests/distributed/launch.run_ranks``), one launch for
every case; results go to ``OUT/<case>.rank<R>.pt`` (a case that raised: ``{"failed": traceback}``).

- every variant of :data:`VARIANTS` (FSDP1 and FSDP2, sync and async, sharded and full): ``fit`` 6 steps
  with ``ModelCheckpoint(every_n_train_steps=2, save_top_k=2, monitor="step", mode="min",
  save_last=True)`` (best: step 2, kept: steps 2 and 4, ``last.ckpt``: step 6), a callback recording the
  full values (weights, sharded attributes, optimizer state, step) at every save, and each rank's torch
  RNG state at every batch start (a rank draws its own numbers there, so the ranks' states differ). Then,
  each after the model was scrambled (weights and sharded attributes changed in place, so a restore
  that does nothing fails): ``validate(ckpt_path="best")``, ``test(ckpt_path="last")``,
  ``predict(ckpt_path=<step 4>)``, each recording the values after it and the keys the checkpoint
  reader read; then a new Trainer ``fit(model, ckpt_path=<step 4>)`` to step 6, recording the values
  right after the restore, the RNG state at its first batch and the values at its end;
- ``weights-only-*``: the same with ``ModelCheckpoint(save_weights_only=True)``: validate, test and
  predict from checkpoints without optimizer state;
- ``then-fsdp2`` / ``then-fsdp1``: a model trained by one strategy (FSDP1 wrapping the root only), then
  given to a Trainer with the other: records the error; ``stock-then-fsdp2``: the same after stock
  ``FSDPStrategy``'s wrapping; ``then-other-options``: FSDP1, then FSDP1 with ``SHARD_GRAD_OP``;
- ``async-failure-*``: ``async_save=True``; the background write of the final ``last.ckpt`` (step 6) fails
  on rank 1 (a full disk, injected); records what ``fit`` raised, then what ``validate(ckpt_path="last")``
  raises (``last.ckpt`` on disk still holds step 4) and ``validate(ckpt_path="best")`` (step 2);
- ``manual-async-*``: ``async_save=True`` and no ``ModelCheckpoint``: ``fit`` 4 steps, then
  ``trainer.save_checkpoint(path)`` after ``fit`` (its background write slowed down by 1.5 s), then at
  once a new Trainer ``fit(model, ckpt_path=path)`` to step 6: records the values at the save and right
  after the restore (the path does not exist until the first Trainer's save is published).
"""

from __future__ import annotations

import functools
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402

from lightning_sharded import ShardedFSDPStrategy  # noqa: E402
from lightning_sharded.checkpoint.backends.dcp_reader import DirectReader  # noqa: E402
from tests._compare import quiet_trainer  # noqa: E402
from tests.distributed.scenario_async import fail_next_background_write_on, writer_module  # noqa: E402
from tests.distributed.scenario_resume import make_model, make_parser, make_strategy  # noqa: E402

#: case -> (strategy, state_dict_type, async_save)
VARIANTS = {
    "fsdp1-root-sharded": ("fsdp-root", "sharded", False),  # the issue's: one FSDP1 unit, the root
    "fsdp1-sharded": ("fsdp", "sharded", False),
    "fsdp1-sharded-async": ("fsdp", "sharded", True),
    "fsdp1-full": ("fsdp", "full", False),
    "fsdp2-sharded": ("mp", "sharded", False),
    "fsdp2-sharded-async": ("mp", "sharded", True),
    "fsdp2-full": ("mp", "full", False),
}
WEIGHTS_ONLY = {
    "weights-only-fsdp1-sharded": VARIANTS["fsdp1-sharded"],
    "weights-only-fsdp2-full": VARIANTS["fsdp2-full"],
}
MANUAL = {
    "manual-async-fsdp1": VARIANTS["fsdp1-sharded-async"],
    "manual-async-fsdp2": VARIANTS["fsdp2-sharded-async"],
}
FAILURES = {
    "async-failure-fsdp1": VARIANTS["fsdp1-sharded-async"],
    "async-failure-fsdp2": VARIANTS["fsdp2-sharded-async"],
}
STEPS = 6
#: Which step each evaluation's checkpoint holds: "best" (step 2), "last" (step 6), a path (step 4).
EVALUATIONS = {"validate": ("best", 2), "test": ("last", 6), "predict": ("step4", 4)}
RANK = int(os.environ.get("RANK", "0"))

#: The fully qualified names the DCP reader was asked to read, since the last reset.
READ: list[str] = []
_read_data = DirectReader.read_data


def _recording_read_data(self: Any, plan: Any, planner: Any) -> Any:
    READ.extend(item.storage_index.fqn for item in plan.items)
    return _read_data(self, plan, planner)


DirectReader.read_data = _recording_read_data  # type: ignore[method-assign]


def options(strategy: str, state_dict_type: str, async_save: bool) -> Any:
    """``scenario_resume.py``'s options; ``fsdp-root``: FSDP1 without an ``auto_wrap_policy``."""
    fsdp = strategy.startswith("fsdp")
    argv = [
        "fit",
        "--strategy",
        "fsdp" if fsdp else strategy,
        "--out",
        "-",
        "--state-dict-type",
        state_dict_type,
    ]
    argv += ["--async-save"] * async_save + ["--sharded-tensor"] * fsdp
    args = make_parser().parse_args(argv)
    args.root_only = strategy == "fsdp-root"
    return args


def strategy_for(args: Any) -> Any:
    if args.root_only:
        return ShardedFSDPStrategy(state_dict_type=args.state_dict_type, async_save=args.async_save)
    if getattr(args, "stock", False):  # stock FSDPStrategy's wrapping (root only), with a CPU device id
        from benchmarks.builders import StockCpuFSDP

        return StockCpuFSDP()
    if getattr(args, "sharding_strategy", None):
        return ShardedFSDPStrategy(auto_wrap_policy={nn.Linear}, sharding_strategy=args.sharding_strategy)
    return make_strategy(args, 2)


def _local(value: Any) -> torch.Tensor:
    """A rank's own part: a DTensor's local tensor, a ShardedTensor's local shards, a tensor itself."""
    if hasattr(value, "to_local"):
        return value.to_local()  # type: ignore[no-any-return]
    if hasattr(value, "local_shards"):
        return torch.cat([shard.tensor.flatten() for shard in value.local_shards()])
    assert isinstance(value, torch.Tensor)
    return value


def snapshot(trainer: L.Trainer, model: Any, optimizers: bool = True) -> dict[str, Any]:
    """This rank's own part of every weight (FSDP1: its flat parameters' shards; FSDP2: its DTensors'
    local tensors), of the sharded attributes and (``optimizers``) of the optimizer state, and the step.
    Read from the live objects, not through any state dict, so it can be taken at any moment (inside a
    save too)."""
    values: dict[str, Any] = {"global_step": trainer.global_step}
    root = trainer.strategy.model
    assert root is not None
    reshard(root)
    params = dict(root.named_parameters())
    for name, param in params.items():
        values[f"model.{name}"] = _local(param).detach().clone()
    for name in ("table", "cache"):
        if getattr(model, name, None) is not None:
            values[f"model.{name}"] = _local(getattr(model, name)).clone()
    names = {id(param): name for name, param in params.items()}
    for index, optimizer in enumerate(trainer.optimizers if optimizers else []):
        for key, state in optimizer.state.items():
            for entry, stored in state.items():
                values[f"opt{index}.{names[id(key)]}.{entry}"] = _local(torch.as_tensor(stored)).clone()
    return values


class Capture(L.Callback):
    """The snapshot right after the restore, before any step."""

    values: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.values = snapshot(trainer, pl_module)


class Record(L.Callback):
    """The values at every save, by step (``weights_only``: at the end of every step, where
    ``ModelCheckpoint`` saves, since Lightning calls no ``on_save_checkpoint`` for a weights-only save);
    each rank's RNG state at every batch start, by step (and a draw of this rank's own, so the ranks'
    generators differ)."""

    def __init__(self, weights_only: bool = False) -> None:
        self.weights_only = weights_only
        self.saved: dict[int, dict[str, Any]] = {}
        self.rng: dict[int, torch.Tensor] = {}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.saved[trainer.global_step] = snapshot(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if self.weights_only:  # callbacks run before the module's own hook, ModelCheckpoint last
            self.saved[trainer.global_step] = snapshot(trainer, pl_module)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.rng[trainer.global_step] = torch.get_rng_state()
        torch.rand(1 + RANK)


def trainer_for(args: Any, callbacks: list[Any], **kwargs: Any) -> L.Trainer:
    """Checkpointing only with a ``ModelCheckpoint`` among ``callbacks``."""
    return quiet_trainer(
        callbacks,
        devices=2,
        strategy=strategy_for(args),
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
        num_sanity_val_steps=0,
        **kwargs,
    )


def checkpointing(dirpath: Path, weights_only: bool = False) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=dirpath,
        every_n_train_steps=2,
        save_top_k=2,
        monitor="step",
        mode="min",
        save_last=True,
        save_weights_only=weights_only,
    )


def reshard(module: Any) -> None:
    """FSDP2 modules that are their own root keep their parameters whole after an evaluation's forward:
    shard them again (a no-op where they are sharded)."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def scramble(model: Any) -> None:
    """Change every weight and sharded attribute in place: what a restore must overwrite."""
    reshard(model)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    model.on_train_batch_end(None, None, 0)  # the table +1, the cache +0.5


def evaluate(trainer: L.Trainer, model: Any, fn: str, ckpt: Any) -> dict[str, Any]:
    """Scramble, then ``trainer.<fn>(model, ckpt_path=ckpt)``: the values after it, the keys the DCP reader
    read and each forward's input and output (computed from the weights the evaluation really used)."""
    scramble(model)
    READ.clear()
    io: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(_: Any, args: tuple[Any, ...], output: Any) -> None:
        if isinstance(args[0], torch.Tensor):  # not the call of the step itself (FSDP1 redirects it)
            io.append((args[0].clone(), output.clone()))

    hook = model.register_forward_hook(record)
    try:
        getattr(trainer, fn)(model, ckpt_path=ckpt)
    finally:
        hook.remove()
    return {"values": snapshot(trainer, model, optimizers=False), "read": sorted(set(READ)), "io": io}


def fit_then_all(out: Path, args: Any, weights_only: bool = False) -> dict[str, Any]:
    model = make_model(args)
    record = Record(weights_only)
    callback = checkpointing(out, weights_only)
    trainer = trainer_for(args, [record, callback], max_steps=STEPS)
    trainer.fit(model)
    step4 = out / "epoch=0-step=4.ckpt"
    result: dict[str, Any] = {"saved": record.saved, "rng": record.rng, "best": callback.best_model_path}
    paths = {"best": "best", "last": "last", "step4": step4}
    for fn, (which, _) in EVALUATIONS.items():
        result[fn] = evaluate(trainer, model, fn, paths[which])
    if weights_only:
        return result
    scramble(model)
    again, capture = Record(), Capture()
    trainer = trainer_for(args, [again, capture], max_steps=STEPS)
    trainer.fit(model, ckpt_path=step4)
    result["refit"] = {"restored": capture.values, "rng": again.rng, "end": snapshot(trainer, model)}
    return result


def then_other(out: Path, first: Any, second: Any) -> dict[str, Any]:
    """A model trained by ``first``'s strategy, then given to a Trainer with ``second``'s."""
    model = make_model(first)
    trainer_for(first, [], max_steps=2).fit(model)
    trainer = trainer_for(second, [], max_steps=2)
    try:
        trainer.validate(model)
    except Exception as err:
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "values": snapshot(trainer, model, optimizers=False)}


class FailLastSave(L.Callback):
    """Arms a full disk on rank 1 for the background write of the final step's save."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == STEPS:
            trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]  # step 4's: it must not fail
            fail_next_background_write_on(1)


def async_failure(out: Path, args: Any) -> dict[str, Any]:
    model = make_model(args)
    record = Record()
    trainer = trainer_for(args, [FailLastSave(), record, checkpointing(out)], max_steps=STEPS)
    result: dict[str, Any] = {"saved": record.saved}
    for name, run in (
        ("fit", lambda: trainer.fit(model)),
        ("last", lambda: trainer.validate(model, ckpt_path="last")),
        ("best", lambda: evaluate(trainer, model, "validate", "best")),
    ):
        try:
            result[name] = {"type": None, "value": run()}
        except Exception as err:
            result[name] = {"type": type(err).__name__, "message": str(err)}
    return result


def slow_next_background_write(seconds: float) -> None:
    """Make the next shard write of this process sleep ``seconds`` first (a slow disk)."""
    original = writer_module.HashingStream.write
    state = {"armed": True}

    def write(self: Any, b: Any) -> int:
        if state["armed"]:
            state["armed"] = False
            time.sleep(seconds)
        return original(self, b)

    writer_module.HashingStream.write = write  # type: ignore[method-assign]


def manual_async(out: Path, args: Any) -> dict[str, Any]:
    """``trainer.save_checkpoint`` (async) after ``fit``, then a new Trainer resumes from it at once."""
    model = make_model(args)
    trainer = trainer_for(args, [], max_steps=4)
    trainer.fit(model)
    saved = snapshot(trainer, model)
    path = out / "manual.ckpt"
    slow_next_background_write(1.5)
    trainer.save_checkpoint(path)
    capture = Capture()
    made = groups()
    trainer = trainer_for(args, [capture], max_steps=STEPS)
    trainer.fit(model, ckpt_path=path)
    trainer.save_checkpoint(out / "again.ckpt")  # async too: the second Trainer's saver
    trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
    made_by_resume = groups() - made
    made = groups()
    trainer_for(args, [], max_steps=2).fit(model)  # neither loads nor saves
    return {
        "saved": saved,
        "restored": capture.values,
        "groups": {"resume and save": made_by_resume, "plain fit": groups() - made},
    }


def groups() -> int:
    """How many process groups this process has made (Lightning's own included: a device mesh each)."""
    from torch.distributed.distributed_c10d import _world

    return len(_world.pg_map)


def run(out: Path, case: str, body: Callable[[Path], dict[str, Any]]) -> None:
    folder = out / case
    folder.mkdir(parents=True, exist_ok=True)
    try:
        result = body(folder)
    except BaseException:
        result = {"failed": traceback.format_exc()}
    torch.save(result, out / f"{case}.rank{RANK}.pt")
    dist.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(100 + RANK)
    for case, variant in VARIANTS.items():
        run(out, case, functools.partial(fit_then_all, args=options(*variant)))
    for case, variant in WEIGHTS_ONLY.items():
        run(out, case, functools.partial(fit_then_all, args=options(*variant), weights_only=True))
    fsdp1, fsdp2 = options(*VARIANTS["fsdp1-sharded"]), options(*VARIANTS["fsdp2-sharded"])
    root_only = options(*VARIANTS["fsdp1-root-sharded"])  # no FSDP1 unit inside the module
    run(out, "then-fsdp2", functools.partial(then_other, first=root_only, second=fsdp2))
    run(out, "then-fsdp1", functools.partial(then_other, first=fsdp2, second=fsdp1))
    stock = options(*VARIANTS["fsdp1-root-sharded"])
    stock.root_only, stock.stock = False, True
    run(out, "stock-then-fsdp2", functools.partial(then_other, first=stock, second=fsdp2))
    grad_op = options(*VARIANTS["fsdp1-sharded"])
    grad_op.sharding_strategy = "SHARD_GRAD_OP"
    run(out, "then-other-options", functools.partial(then_other, first=fsdp1, second=grad_op))
    for case, variant in MANUAL.items():
        run(out, case, functools.partial(manual_async, args=options(*variant)))
    for case, variant in FAILURES.items():
        run(out, case, functools.partial(async_failure, args=options(*variant)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
