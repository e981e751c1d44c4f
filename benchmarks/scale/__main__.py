"""What one rank's save and load cost our layer in a world of N ranks, simulated in one process.

Usage: ``python -m benchmarks.scale [--quick] [--sizes 8,64,...] [--no-s3] [--no-times] [--out DIR]``
(default N = 8, 64, 512, 4096; ``--quick``: 8 and 64; ``--render DIR``: the tables and plot again from
``DIR/scale.json``). Writes ``scale.json``, ``scale.md`` and ``scale.png`` into ``--out`` (default
``benchmarks/results``).

For each N, a fake process group (``backend="fake"``) puts this process at rank 0, then at rank
N-1, of a world of N; the few collective results that matter are served by
:class:`benchmarks.scale.simworld.SimWorld` (rank 0's broadcasts recorded and replayed to the other
rank; what rank 0 gathers made up as the other ranks would send it; their shard files put beside rank
0's). The model is tiny (``benchmarks.scale.runs``): two parameters and one sharded attribute,
``DTensor`` rows sharded along dim 0, plus Adam's state, so the shard bytes are negligible and what is
left is the work of the layers around them. Each rank's run is counted
(:class:`benchmarks.scale.counting.Tally`) and, in a second pass without counting, timed (CPU and
wall, without the simulation's own work), for each implementation of :data:`~benchmarks.scale.runs.RUNS`
(``ours``, ``stock``).

Local directories always; with S3 (the moto server of ``benchmarks.s3_server``, unless ``--no-s3``)
the same runs against ``s3://``, requests counted where s3fs issues them (``benchmarks.scale.stores``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

from benchmarks import RESULTS
from benchmarks.s3_server import S3Server
from benchmarks.scale.counting import Tally, instrument
from benchmarks.scale.report import markdown, plot
from benchmarks.scale.runs import ROWS, RUNS, fake_world, spy_writers
from benchmarks.scale.simworld import SimWorld
from benchmarks.scale.stores import S3, Local, Store
from lightning_sharded.checkpoint import names

SIZES = (8, 64, 512, 4096)
QUICK_SIZES = (8, 64)


def one_rank(
    store: Store,
    impl: str,
    phase: str,
    target: Any,
    rank: int,
    world_size: int,
    tape: list[bytes],
    *,
    count: bool,
) -> dict[str, Any]:
    """Run one rank's ``phase`` (save or load); counts when ``count``, else times."""
    root = str(getattr(store, "root", tempfile.gettempdir()))
    tally = Tally(rank, os.path.abspath(root), getattr(store, "prefix", None))
    world = SimWorld(rank, world_size, tape)
    fn = RUNS[(impl, phase)]
    result: dict[str, Any] = {}
    with spy_writers(world, store), fake_world(rank, world_size) as mesh:
        gc.collect()
        if count:
            tracemalloc.start()
            with instrument(tally, world, files=True):
                fn(target, mesh, rank, world, store)
            result["peak_python_bytes"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            result.update(tally.summary())
        else:
            with instrument(tally, world, files=False):
                cpu, wall = time.process_time(), time.perf_counter()
                fn(target, mesh, rank, world, store)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            result["cpu_s"] = max(cpu - world.cpu, 0.0)
            result["wall_s"] = max(wall - world.wall, 0.0)
    return result


def run_size(
    store: Store, world_size: int, *, times: bool, impls: tuple[str, ...] = ("ours", "stock")
) -> dict[str, Any]:
    """Every run at one N: for each implementation, save then load, rank 0 then rank N-1."""
    other = world_size - 1
    out: dict[str, Any] = {}
    passes = [True, False] if times else [True]
    for impl in impls:
        for count in passes:
            target = store.target(f"{impl}-{world_size}-{'count' if count else 'time'}")
            for phase in ("save", "load"):
                tape: list[bytes] = []
                for rank in (0, other):
                    figures = one_rank(store, impl, phase, target, rank, world_size, tape, count=count)
                    out.setdefault(impl, {}).setdefault(phase, {}).setdefault(str(rank), {}).update(figures)
                    if phase == "save":
                        store.cleanup_strays(target)
            if count:
                out[impl]["manifest_bytes"] = store.size(store.manifest(target)) if impl == "ours" else 0
                out[impl]["metadata_bytes"] = store.size(store.index(target))
                if impl == "ours":  # the per-rank index: what rank N-1 reads of it
                    out[impl]["layout_bytes"] = store.size(store.index(target, names.INDEX_LAYOUT))
                    last = names.rank_index_file(other)
                    out[impl]["rank_index_bytes"] = store.size(store.index(target, last))
    return out


def save(report: dict[str, Any], out: Path) -> None:
    """The figures so far (after each N: a long run stopped early keeps what it measured)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N up to 64")
    parser.add_argument("--sizes", help="comma-separated world sizes")
    parser.add_argument("--no-s3", action="store_true", help="local directories only")
    parser.add_argument("--s3-sizes", help="world sizes on S3 (default: those of --sizes)")
    parser.add_argument("--no-times", action="store_true", help="counts only (no timing pass, no plot)")
    parser.add_argument("--no-stock", action="store_true", help="our layer only, without stock DCP's runs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--render", type=Path, default=None, help="only write scale.md/.png from DIR/scale.json"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (a temp dir)")
    args = parser.parse_args(argv)
    if args.render is not None:
        return render(args.render)
    warnings.filterwarnings("ignore")
    sizes = (
        [int(n) for n in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else SIZES)
    )
    times = not args.no_times
    impls = ("ours",) if args.no_stock else ("ours", "ours-whole", "stock")
    s3_impls = tuple(i for i in impls if i != "ours-whole")  # without the index: local runs only
    report: dict[str, Any] = {"sizes": sizes, "rows_per_rank": ROWS}
    with tempfile.TemporaryDirectory(prefix="scale-", dir=args.dir) as tmp:
        store: Store = Local(Path(tmp))
        if times:  # imports and first calls, not measured (they would count in the first peak memory)
            run_size(Local(Path(tmp) / "warm-up"), 2, times=False, impls=impls)
        report["local"] = {}
        for n in sizes:
            started = time.perf_counter()
            report["local"][str(n)] = run_size(store, n, times=times, impls=impls)
            print(f"local N={n}: {time.perf_counter() - started:.1f}s", flush=True)
            save(report, args.out)
        if not args.no_s3:
            with S3Server() as server:
                store = S3(server.url("scale"))
                report["s3"] = {}
                s3_sizes = [int(n) for n in args.s3_sizes.split(",")] if args.s3_sizes else sizes
                for n in s3_sizes:
                    started = time.perf_counter()
                    report["s3"][str(n)] = run_size(store, n, times=times, impls=s3_impls)
                    print(f"s3 N={n}: {time.perf_counter() - started:.1f}s", flush=True)
                    save(report, args.out)
    save(report, args.out)
    if times:
        (args.out / "scale.md").write_text(markdown(report) + "\n")
        plot(report, args.out / "scale.png")
        print(markdown(report))
    return report


def render(out: Path) -> dict[str, Any]:
    """Write ``scale.md`` and ``scale.png`` from a saved ``scale.json`` (``--render``)."""
    report: dict[str, Any] = json.loads((out / "scale.json").read_text())
    (out / "scale.md").write_text(markdown(report) + "\n")
    plot(report, out / "scale.png")
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
