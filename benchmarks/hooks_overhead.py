"""Overhead of the sharded-state hooks on ``state_dict()`` and ``load_state_dict()``.

A model of 2,000 small submodules (``Linear(8, 8)``), one object timed with its hooks and with them
taken out for the call, in turns so that drift hits both sides alike. Each time is the median of the
runs; the result, ``ratio``, is the median over the rounds of each round's hooked / plain (the two calls
of a round run back to back, so a busy moment of the machine hits both); the ratio of the two medians
is printed beside it.
Also measured, for reference: torch's own ShardedTensor state-dict hook (a plain walk of
``named_modules()`` and every ``__dict__``).

Run: ``python -m benchmarks.hooks_overhead [--modules 2000] [--repeats 41] [--json OUT]``
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_sharded import register_sharded_state_hooks


def make_model(modules: int) -> nn.Module:
    root = nn.Module()
    root.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(modules))
    return root


def add_sharded(model: nn.Module, count: int) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layers = list(model.layers)  # type: ignore[arg-type]
    step = max(1, len(layers) // count)
    for layer in layers[::step][:count]:
        layer.table = distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)])


class _HooksOff:
    """Times a call of ``model`` with its hooks taken out for that call only.

    Comparing one model object with and without its hooks (rather than two copies) keeps memory
    layout out of the ratio: two equal models built separately differ by more than the hooks cost.
    """

    _NAMES = (
        "_state_dict_pre_hooks",
        "_state_dict_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    )

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.hooks = {name: getattr(model, name) for name in self._NAMES}
        self.empty = {name: type(hooks)() for name, hooks in self.hooks.items()}

    def __enter__(self) -> None:
        for name, empty in self.empty.items():
            object.__setattr__(self.model, name, empty)

    def __exit__(self, *exc: object) -> None:
        for name, hooks in self.hooks.items():
            object.__setattr__(self.model, name, hooks)


def interleaved(cases: dict[str, tuple[Callable[[], Any], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each ``(function, context)`` in each round, taking turns ``repeats`` times."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeats + 1):
        for name, (fn, context) in cases.items():
            with context:
                start = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start
            if i:  # the first round only warms caches
                times[name].append(elapsed)
    return times


def paired(times: dict[str, list[float]], hooked: str, plain: str) -> float:
    """The median over rounds of ``hooked / plain`` within a round."""
    return statistics.median(h / p for h, p in zip(times[hooked], times[plain], strict=True))


def measure(modules: int, sharded: int, repeats: int) -> dict[str, float]:
    model = make_model(modules)
    if sharded:
        add_sharded(model, sharded)
    register_sharded_state_hooks(model)
    off = _HooksOff(model)
    naive = copy.deepcopy(model)
    _HooksOff(naive).__enter__()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from torch.distributed._shard.sharded_tensor import state_dict_hook
    naive._register_state_dict_hook(state_dict_hook)
    naive_off = _HooksOff(naive)

    with off:
        plain_sd = model.state_dict()
    hooked_sd = model.state_dict()
    on = contextlib.nullcontext()
    sd = interleaved(
        {
            "state_dict plain": (model.state_dict, off),
            "state_dict hooked": (model.state_dict, on),
            "state_dict naive plain": (naive.state_dict, naive_off),
            "state_dict naive hook": (naive.state_dict, on),
        },
        repeats,
    )
    # torch's load_state_dict is quadratic in the width of a ModuleList (each child filters all of
    # its parent's keys), so loads take far longer than state_dict(): fewer repeats suffice.
    # Without the hooks, strict=False: the plain load skips what it does not know about.
    load = interleaved(
        {
            "load plain": (lambda: model.load_state_dict(plain_sd, strict=False), off),
            "load hooked": (lambda: model.load_state_dict(hooked_sd), on),
        },
        max(3, repeats // 8),
    )
    medians = {name: statistics.median(ts) for name, ts in {**sd, **load}.items()}
    return {
        **{f"{name} (ms)": 1e3 * value for name, value in medians.items()},
        "state_dict ratio": paired(sd, "state_dict hooked", "state_dict plain"),
        "state_dict ratio of the medians": medians["state_dict hooked"] / medians["state_dict plain"],
        "state_dict ratio, torch's naive hook": paired(sd, "state_dict naive hook", "state_dict naive plain"),
        "load ratio": paired(load, "load hooked", "load plain"),
    }


def run(modules: int = 2000, repeats: int = 101) -> dict[str, dict[str, float]]:
    """Both cases (no sharded attribute, 100 sharded attributes); needs a process group."""
    return {
        f"{modules} modules, 0 sharded": measure(modules, 0, repeats),
        f"{modules} modules, 100 sharded": measure(modules, 100, repeats),
    }


def one_process_group() -> None:
    """A gloo process group of this process alone, unless one exists (the sharded attributes' mesh)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)


def section(modules: int, repeats: int) -> dict[str, Any]:
    """The hooks section of ``benchmarks.run``: :func:`run` on one intra-op thread, with every ratio."""
    one_process_group()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = run(modules, repeats)
    finally:
        torch.set_num_threads(threads)
    ratios = {f"{case}: {k}": v for case, r in rows.items() for k, v in r.items() if "ratio" in k}
    return {"rows": rows, "ratios": ratios}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.hooks_overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--modules", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=101)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    one_process_group()
    torch.set_num_threads(1)
    results = run(args.modules, args.repeats)
    for case, figures in results.items():
        print(f"\n{case}")
        for name, value in figures.items():
            print(f"  {name:<45} {value:10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
