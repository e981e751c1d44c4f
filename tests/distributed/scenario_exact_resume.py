"""Exact resume as a user runs it (issue 30), one process per rank (``test_exact_resume_everywhere.py``).

The user's run: 2 ranks, a shuffled ``StatefulDataLoader`` per rank seeded as the torch docs show
(``generator=torch.Generator().manual_seed(1000 + rank)``, 12 batches an epoch), dropout, a random
augmentation (torch, ``random`` and NumPy draws), a ``DTensor`` attribute updated with random numbers,
``ModelCheckpoint(every_n_train_steps=7)`` (and ``every_n_epochs=1``), stopped and resumed to step 20.

Usage: ``scenario_exact_resume.py PHASE OUT`` on 2 ranks (``tests/distributed/launch.run_ranks``):

- ``unbroken``: every case of :data:`VARIANTS` (FSDP1 and FSDP2, sync and async, sharded and full) and
  ``registered`` (objects of its own registered with ``register_rank_state``) trains 20 steps unbroken,
  saving at steps 7 and 14 and at the end of epoch 0 (step 12);
- ``resume`` (new processes, other RNG states): every case resumes from step 7 and from the end of
  epoch 0, recording the same;
- ``property``: the property test: for random stop points (hypothesis, derandomized, so both ranks
  draw the same examples; each example's verdict is gathered from both ranks, so they fail, shrink and
  stop together) and the named ones (first batch, mid-epoch, last batch of an epoch, first of the next,
  epoch end, with 1 and 3 epochs, by steps and by epochs), a resume from that point trains the same
  steps as the unbroken run. Loaders: the ``StatefulDataLoader`` above; a plain ``DataLoader`` with the
  ``DistributedSampler`` Lightning adds; a plain shuffled ``DataLoader`` with its own generator
  (whose interrupted epoch starts over: from mid-epoch, the epochs after it must draw the same batches).

Results: ``OUT/<case>.<phase>.rank<R>.pt``; a failure writes ``OUT/<phase>.failed.rank<R>.txt``.
"""

from __future__ import annotations

import os
import random
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import lightning as L  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from lightning_sharded import register_rank_state  # noqa: E402
from tests._compare import quiet_trainer  # noqa: E402
from tests.distributed.scenario_rank_state import Augmented, ExactModel, local_values, strategy_for  # noqa: E402

#: case -> (strategy, state_dict_type, async_save)
VARIANTS = {
    "fsdp2-sharded": ("mp", "sharded", False),
    "fsdp2-sharded-async": ("mp", "sharded", True),
    "fsdp2-full": ("mp", "full", False),
    "fsdp1-sharded": ("fsdp", "sharded", False),
    "fsdp1-sharded-async": ("fsdp", "sharded", True),
    "fsdp1-full": ("fsdp", "full", False),
}
CASES = {**VARIANTS, "registered": ("mp", "sharded", False)}
STEPS = 20
SAVED_AT = 7
EPOCH_END = 12  # the global step at the end of epoch 0 (12 batches an epoch)
#: The property test's runs: 6 batches an epoch, 3 epochs at most; its loaders and their strategies.
BATCHES = 6
EPOCHS = 3
KINDS = {
    "stateful": ("mp", "sharded"),
    "distributed": ("fsdp", "full"),
    "plain": ("fsdp", "sharded"),
    "validated": ("mp", "full"),  # the stateful loader, and a validation every half epoch
}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def step_checkpoint(out: Path, case: str, step: int, epoch: int = 0) -> Path:
    return out / case / "steps" / f"epoch={epoch}-step={step}.ckpt"


def epoch_checkpoint(out: Path, case: str, epoch: int, step: int) -> Path:
    return out / case / "epochs" / f"epoch={epoch}-step={step}.ckpt"


class Indexed(Augmented):
    """``Augmented`` with ``n`` samples, each returned with its index; a NumPy generator of its own may
    replace the global one in the augmentation (the ``registered`` case)."""

    def __init__(self, n: int, seed: int, rng: np.random.Generator | None = None) -> None:
        g = torch.Generator().manual_seed(10 + seed)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)
        self.rng = rng

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y = super().__getitem__(i)
        if self.rng is not None:
            x = x + float(self.rng.normal()) * 0.05
        return x, y, i


class Schedule:
    """A data-mixing schedule of the user's own: a weight that moves at every step (``registered``)."""

    def __init__(self) -> None:
        self.weight, self.steps = 0.5, 0

    def step(self) -> None:
        self.steps += 1
        self.weight = 0.5 + 0.4 * ((self.steps * 7919) % 13) / 13

    def state_dict(self) -> dict[str, Any]:
        return {"weight": self.weight, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight, self.steps = state["weight"], state["steps"]


class UserModel(ExactModel):
    """The user's model; records each global step's (epoch, batch index, sample indices, loss)."""

    def __init__(self, kind: str = "stateful", samples: int = 24, registered: bool = False) -> None:
        super().__init__()
        self.kind, self.samples, self.registered = kind, samples, registered
        self.record: dict[int, tuple[int, int, tuple[int, ...], float]] = {}
        if registered:
            self.schedule = Schedule()
            self.noise_gen = torch.Generator().manual_seed(99)
            register_rank_state(self, "schedule", self.schedule)
            register_rank_state(self, "noise_gen", self.noise_gen)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        loss = super().training_step((x, y), batch_idx)
        if self.registered:
            loss = loss * self.schedule.weight + torch.randn(1, generator=self.noise_gen).abs().sum() * 1e-3
            self.schedule.step()
        self.record[self.global_step + 1] = (
            self.current_epoch,
            batch_idx,
            tuple(index.tolist()),
            float(loss.detach()),
            self.trainer.fit_loop.epoch_loop._batches_that_stepped,  # the loggers' step
        )
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def val_dataloader(self) -> Any:  # augmented too: the validation draws random numbers
        return DataLoader(Indexed(4, 50 + dist.get_rank()), batch_size=2) if self.kind == "validated" else []

    def train_dataloader(self) -> Any:
        r = dist.get_rank() if dist.is_initialized() else 0
        if self.kind == "distributed":  # Lightning puts a DistributedSampler in (use_distributed_sampler)
            return DataLoader(Indexed(self.samples * dist.get_world_size(), 0), batch_size=2, shuffle=True)
        rng = np.random.default_rng(500 + r) if self.registered else None
        if rng is not None:  # created with the loader, registered where the loader is made
            register_rank_state(self, "augment_rng", rng, replace=True)
        data = Indexed(self.samples, r, rng)
        generator = torch.Generator().manual_seed(1000 + r)
        if self.kind == "plain":
            return DataLoader(data, batch_size=2, shuffle=True, generator=generator)
        return StatefulDataLoader(data, batch_size=2, shuffle=True, generator=generator)


def trainer(strategy: Any, callbacks: list[Any], **limits: Any) -> L.Trainer:
    if limits.pop("validated", False):
        limits.update(val_check_interval=0.5)
    else:
        limits.update(limit_val_batches=0)
    distributed = limits.pop("distributed", False)
    return quiet_trainer(
        callbacks,
        strategy=strategy,
        devices=2,
        use_distributed_sampler=distributed,
        num_sanity_val_steps=0,
        **limits,
    )


def result(out: Path, case: str, phase: str, value: dict[str, Any]) -> None:
    torch.save(value, out / f"{case}.{phase}.rank{rank()}.pt")


def seed_globals(seed: int) -> None:
    """Seed torch's, ``random``'s and NumPy's global generators with ``seed``, on each rank its own."""
    torch.manual_seed(seed + rank())
    random.seed(seed + rank())
    np.random.seed(seed + rank())


def other_rng_states() -> None:
    """Move every global generator elsewhere: what a resume continues with must come from the file."""
    seed_globals(7)


def unbroken(out: Path, case: str) -> None:
    name, kind, async_save = CASES[case]
    L.seed_everything(100 + rank(), verbose=False)
    model = UserModel(registered=case == "registered")
    savers = [
        ModelCheckpoint(dirpath=out / case / "steps", every_n_train_steps=SAVED_AT, save_top_k=-1),
        ModelCheckpoint(dirpath=out / case / "epochs", every_n_epochs=1, save_top_k=-1),
    ]
    t = trainer(strategy_for(name, kind, async_save), savers, max_steps=STEPS)
    t.fit(model)
    result(out, case, "unbroken", {"record": model.record, "values": local_values(t)})


def resume(out: Path, case: str) -> None:
    name, kind, _ = CASES[case]
    for label, path in (
        ("resume", step_checkpoint(out, case, SAVED_AT)),
        ("resume-epoch-end", epoch_checkpoint(out, case, 0, EPOCH_END)),
    ):
        L.seed_everything(100 + rank(), verbose=False)
        other_rng_states()
        model = UserModel(registered=case == "registered")
        t = trainer(strategy_for(name, kind), [], max_steps=STEPS)
        t.fit(model, ckpt_path=path)
        result(out, case, label, {"record": model.record, "values": local_values(t)})


# --------------------------------------------------------------------------------- the property test


def reference(out: Path, kind: str) -> dict[int, Any]:
    """The unbroken run of ``kind`` (3 epochs of 6 batches), saving at every step and every epoch end
    (``validated``: also at the end of every validation, twice an epoch)."""
    name, sd_type = KINDS[kind]
    L.seed_everything(100, verbose=False)  # the DistributedSampler's seed is Lightning's global seed
    seed_globals(100)  # every rank its own dropout and augmentation
    model = UserModel(kind, samples=2 * BATCHES)
    savers = [
        ModelCheckpoint(dirpath=out / kind / "steps", every_n_train_steps=1, save_top_k=-1),
        ModelCheckpoint(
            dirpath=out / kind / "epochs", every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True
        ),
    ]
    if kind == "validated":
        savers.append(
            ModelCheckpoint(
                dirpath=out / kind / "validations",
                monitor="val_loss",
                save_top_k=-1,
                save_on_train_epoch_end=False,
            )
        )
    t = trainer(strategy_for(name, sd_type), savers, max_steps=BATCHES * EPOCHS, **_data(kind))
    t.fit(model)
    return model.record


def _data(kind: str) -> dict[str, bool]:
    return {"distributed": kind == "distributed", "validated": kind == "validated"}


def saved_step(example: dict[str, Any]) -> int:
    """The global step of ``example``'s checkpoint."""
    stop = example["stop"]
    if example["trigger"] == "epoch end":
        return stop * BATCHES
    if example["trigger"] == "validation":  # the ``stop``-th validation (twice an epoch)
        return stop * BATCHES // 2
    return stop  # type: ignore[no-any-return]


def run_example(out: Path, example: dict[str, Any], unbroken: dict[int, Any]) -> str | None:
    """Resume ``example``'s checkpoint; ``None`` if it trains the unbroken run's steps, else what differs."""
    kind, epochs = example["kind"], example["epochs"]
    name, sd_type = KINDS[kind]
    saved_at = saved_step(example)
    epoch = (saved_at - 1) // BATCHES
    folder = {"batch": "steps", "epoch end": "epochs", "validation": "validations"}[example["trigger"]]
    path = out / kind / folder / f"epoch={epoch}-step={saved_at}.ckpt"
    by_steps = example["by"] == "steps"
    limits: dict[str, Any] = {"max_steps": BATCHES * epochs} if by_steps else {"max_epochs": epochs}
    L.seed_everything(100, verbose=False)
    other_rng_states()
    model = UserModel(kind, samples=2 * BATCHES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = trainer(strategy_for(name, sd_type), [], **_data(kind), **limits)
        t.fit(model, ckpt_path=path)
    want = {s: v for s, v in unbroken.items() if saved_at < s <= BATCHES * epochs}
    got = model.record
    if kind == "plain" and saved_at % BATCHES:  # its interrupted epoch starts over: the epochs after it
        want = {s: v[:3] for s, v in want.items() if v[0] > epoch}
        got = {s: v[:3] for s, v in got.items() if v[0] > epoch}
    if got == want:
        return None
    wrong = sorted(s for s in want.keys() | got.keys() if got.get(s) != want.get(s))
    first = wrong[0]
    return (
        f"rank {rank()}: {len(wrong)} of {len(want)} steps differ, first {first}:"
        f" {want.get(first)} != {got.get(first)}"
    )


#: The named stop points: (kind, by, epochs, trigger, stop)
NAMED = [
    ("stateful", "steps", 3, "batch", 1),  # the first batch
    ("stateful", "steps", 3, "batch", 4),  # mid-epoch
    ("stateful", "steps", 3, "batch", 6),  # the last batch of an epoch
    ("stateful", "epochs", 3, "batch", 12),
    ("stateful", "epochs", 3, "batch", 7),  # the first batch of the next
    ("stateful", "steps", 3, "epoch end", 1),  # every_n_epochs=1
    ("stateful", "epochs", 3, "epoch end", 2),
    ("stateful", "epochs", 1, "batch", 6),  # 1 epoch
    ("stateful", "steps", 1, "epoch end", 1),
    ("distributed", "steps", 3, "batch", 4),
    ("distributed", "epochs", 3, "batch", 6),
    ("distributed", "steps", 3, "batch", 7),
    ("distributed", "epochs", 3, "epoch end", 1),
    ("distributed", "epochs", 1, "batch", 3),
    ("plain", "steps", 3, "batch", 6),
    ("plain", "epochs", 3, "epoch end", 1),
    ("plain", "steps", 3, "batch", 9),
    ("validated", "steps", 3, "epoch end", 1),  # at the epoch's end, after its last validation
    ("validated", "epochs", 3, "epoch end", 2),
    ("validated", "steps", 3, "validation", 2),  # at the end of the validation after the last batch
    ("validated", "epochs", 3, "validation", 4),
    ("validated", "steps", 3, "validation", 3),  # ... of a validation within an epoch
    ("validated", "epochs", 1, "validation", 1),
    ("validated", "steps", 3, "batch", 7),
]


def property_phase(out: Path) -> None:
    from hypothesis import HealthCheck, assume, example, given, settings
    from hypothesis import strategies as st

    references = {kind: reference(out, kind) for kind in KINDS}
    log: list[dict[str, Any]] = []

    @st.composite
    def examples(draw: Any) -> dict[str, Any]:
        kind = draw(st.sampled_from(sorted(KINDS)))
        epochs = draw(st.sampled_from([1, 3]))
        triggers = ["batch", "epoch end", "validation"] if kind == "validated" else ["batch", "epoch end"]
        trigger = draw(st.sampled_from(triggers))
        stop = draw(
            st.integers(
                1, {"batch": BATCHES * epochs, "epoch end": epochs, "validation": 2 * epochs}[trigger]
            )
        )
        # A save right before a validation resumes without it: Lightning counts it as run.
        assume(not (kind == "validated" and trigger == "batch" and stop % (BATCHES // 2) == 0))
        return {
            "kind": kind,
            "by": draw(st.sampled_from(["steps", "epochs"])),
            "epochs": epochs,
            "trigger": trigger,
            "stop": stop,
        }

    def check(case: dict[str, Any]) -> None:
        verdict = run_example(out, case, references[case["kind"]])
        verdicts: list[Any] = [None, None]
        dist.all_gather_object(verdicts, verdict)
        log.append({**case, "verdicts": verdicts})
        failed = [v for v in verdicts if v is not None]
        assert not failed, f"{case}: {'; '.join(failed)}"

    prop = given(examples())(check)
    for kind, by, epochs, trigger, stop in NAMED:
        prop = example({"kind": kind, "by": by, "epochs": epochs, "trigger": trigger, "stop": stop})(prop)
    settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )(prop)()
    result(out, "property", "log", {"log": log})


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    torch.set_num_threads(1)
    try:
        if phase == "unbroken":
            for case in CASES:
                unbroken(out, case)
        elif phase == "resume":
            for case in CASES:
                resume(out, case)
        elif phase == "property":
            property_phase(out)
        else:
            raise SystemExit(f"unknown phase {phase!r}")
    except BaseException:
        (out / f"{phase}.failed.rank{rank()}.txt").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
