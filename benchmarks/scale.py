"""What one rank's save and load cost our layer in a world of N ranks, simulated in one process.

Usage: ``python benchmarks/scale.py [--quick] [--sizes 8,64,...] [--no-s3] [--no-times] [--out DIR]``
(default N = 8, 64, 512, 4096; ``--quick``: 8 and 64). Writes ``scale.json``, ``scale.md`` and
``scale.png`` into ``--out`` (default ``benchmarks/results``).

For each N, a fake process group (``backend="fake"``) puts this process at rank 0, then at rank
N-1, of a world of N; the few collective results that matter are served by
:class:`benchmarks._counting.SimWorld` (rank 0's broadcasts recorded and replayed to the other rank;
what rank 0 gathers made up as the other ranks would send it; their shard files copied from rank 0's).
The model is tiny: two parameters and one sharded attribute, ``DTensor`` rows sharded along dim 0
(``ROWS`` rows per rank), plus Adam's state, so the shard bytes are negligible and what is left is
the work of the layers around them. Each rank's run is counted (:class:`benchmarks._counting.Tally`)
and, in a second pass without counting, timed (CPU and wall, without the simulation's own work):

- ``ours``: ``write_sharded_checkpoint`` then ``restore_checkpoint`` (manifest, commit, checks,
  decisions, DCP underneath);
- ``stock``: what stock Lightning does: ``dcp.save`` plus ``meta.pt`` from rank 0; ``dcp.load`` of the
  model and the optimizer and ``torch.load`` of ``meta.pt`` on every rank.

Local directories always; with S3 (the moto server of ``tests/s3_server.py``, unless ``--no-s3``) the
same runs against ``s3://``, requests counted where s3fs issues them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._counting import SimWorld, Tally, copy_local, instrument  # noqa: E402

ROWS, COLS = 2, 4
SIZES = (8, 64, 512, 4096)
QUICK_SIZES = (8, 64)
SHARED = (".metadata", "meta.pt", "manifest", "directory")


# ------------------------------------------------------------------------------------------- world


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[Any]:
    """A fake process group of ``world_size`` with this process at ``rank``, and a 1-D device mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def build(mesh: Any, seed: int, *, step: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The tiny model (two sharded parameters, one sharded attribute) and Adam, stepped once if ``step``."""
    from torch.distributed.tensor import DTensor, Shard

    from lightning_sharded import register_sharded_state_hooks

    gen = torch.Generator().manual_seed(seed)

    def sharded(requires_grad: bool = False) -> Any:
        value = DTensor.from_local(torch.randn(ROWS, COLS, generator=gen), mesh, [Shard(0)], run_check=False)
        return nn.Parameter(value) if requires_grad else value

    model = nn.Module()
    model.w1 = sharded(True)
    model.w2 = sharded(True)
    model.table = sharded()  # a sharded attribute: saved and loaded by our hooks
    register_sharded_state_hooks(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    if step:
        for p in model.parameters():
            p.grad = DTensor.from_local(torch.ones(ROWS, COLS), mesh, [Shard(0)], run_check=False)
        optimizer.step()
    return model, optimizer


LIGHTNING_REST = {"epoch": 0, "global_step": 3, "loops": {"fit_loop": {"epoch_progress": {"current": 1}}}}


# ------------------------------------------------------------------------------------------ storage


class Local:
    name = "local"

    def __init__(self, root: Path) -> None:
        self.root = root

    def target(self, label: str) -> Any:
        return self.root / label

    def replicate(self, staging: Any) -> Callable[[str, str], tuple[int, str]]:
        return copy_local(Path(staging))

    def cleanup_strays(self, target: Any) -> None:
        from lightning_sharded.checkpoint.backends.local import leftovers

        for stray in [*leftovers(target), *Path(target).parent.glob(f"{Path(target).name}-rank*")]:
            shutil.rmtree(stray, ignore_errors=True)

    def size(self, loc: Any) -> int:
        return os.path.getsize(loc) if os.path.exists(loc) else 0

    def manifest(self, target: Any) -> Any:
        return Path(target) / "lightning_sharded.json"

    def index(self, target: Any) -> Any:
        return Path(target) / ".metadata"


class S3:
    name = "s3"

    def __init__(self, base: str) -> None:
        self.base = base
        self.prefix = base.removeprefix("s3://")

    def target(self, label: str) -> Any:
        return f"{self.base}/{label}"

    def _fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem()

    def replicate(self, staging: Any) -> Callable[[str, str], tuple[int, str]]:
        fs = self._fs()
        root = str(staging).removeprefix("s3://")

        figures: dict[str, tuple[int, str]] = {}
        pending: list[tuple[str, str]] = []

        def copy(mine: str, other: str) -> tuple[int, str]:
            pending.append((f"{root}/{mine}", f"{root}/{other}"))
            if mine not in figures:
                data = fs.cat_file(f"{root}/{mine}")
                figures[mine] = len(data), f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
            return figures[mine]

        def flush() -> None:  # server-side copies, many at a time
            if pending:
                fs.copy([a for a, _ in pending], [b for _, b in pending])
                pending.clear()

        copy.flush = flush  # type: ignore[attr-defined]
        return copy

    def cleanup_strays(self, target: Any) -> None:
        return None  # a replayed rank's writes go beside the published version (data-<token>-rank<r>)

    def size(self, loc: Any) -> int:
        fs = self._fs()
        fs.invalidate_cache()
        path = str(loc).removeprefix("s3://")
        return int(fs.info(path)["size"]) if fs.exists(path) else 0

    def manifest(self, target: Any) -> Any:
        return f"{target}/lightning_sharded.json"

    def index(self, target: Any) -> Any:
        """Where the ``.metadata`` of the checkpoint at ``target`` is (ours: in the published version)."""
        fs = self._fs()
        path = str(self.manifest(target)).removeprefix("s3://")
        if fs.exists(path):
            data_dir = json.loads(fs.cat_file(path)).get("data_dir")
            if data_dir:
                return f"{target}/{data_dir}/.metadata"
        return f"{target}/.metadata"


# ------------------------------------------------------------------------------------------- runs


def _spy_writers(world: SimWorld, store: Any) -> Callable[[], None]:
    """Tell ``world`` where rank 0's shard files go, so the other ranks' can be put beside them."""
    from lightning_sharded.checkpoint.backends.local import LocalBackend
    from lightning_sharded.checkpoint.backends.objstore import ObjectStoreBackend

    saved = [(cls, cls.dcp_writer) for cls in (LocalBackend, ObjectStoreBackend)]

    def spy(real: Any) -> Any:
        def dcp_writer(self: Any, staging: Any, **kwargs: Any) -> Any:
            if world.rank == 0:
                world.replicate = store.replicate(staging)
            elif isinstance(staging, str):  # on S3 the staged version is the published one: not over it
                staging = f"{staging}-rank{world.rank}"
            return real(self, staging, **kwargs)

        return dcp_writer

    for cls, real in saved:
        cls.dcp_writer = spy(real)  # type: ignore[method-assign]

    def undo() -> None:
        for cls, real in saved:
            cls.dcp_writer = real  # type: ignore[method-assign]

    return undo


def save_ours(target: Any, mesh: Any, rank: int, world: SimWorld, store: Any) -> None:
    from lightning_sharded.checkpoint.save import write_sharded_checkpoint
    from lightning_sharded.checkpoint.state_dicts import model_state_dict, optimizer_state_dict

    model, optimizer = build(mesh, 0, step=True)
    state = {
        "model": model_state_dict(model, full=False),
        "optimizer_0": optimizer_state_dict(model, optimizer, full=False),
    }
    write_sharded_checkpoint(target, state, dict(LIGHTNING_REST), rank=rank)


def load_ours(target: Any, mesh: Any, rank: int, world: SimWorld, store: Any) -> None:
    from lightning_sharded.checkpoint.load import restore_checkpoint

    model, optimizer = build(mesh, 1, step=False)
    restored = restore_checkpoint(str(target), model, [optimizer], weights_only=False)
    assert restored.metadata["global_step"] == 3, restored.metadata


def save_stock(target: Any, mesh: Any, rank: int, world: SimWorld, store: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, optimizer = build(mesh, 0, step=True)
    state = {"model": get_model_state_dict(model), "optimizer_0": get_optimizer_state_dict(model, optimizer)}
    if rank == 0:
        world.replicate = store.replicate(target)
    else:  # the replayed rank writes beside the checkpoint rank 0 completed, not over its copies
        target = f"{target}-rank{rank}"
    dcp.save(state, checkpoint_id=str(target))
    if rank == 0:
        import fsspec

        with fsspec.open(f"{target}/meta.pt", "wb") as f:
            torch.save(dict(LIGHTNING_REST), f)


def load_stock(target: Any, mesh: Any, rank: int, world: SimWorld, store: Any) -> None:
    import fsspec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, optimizer = build(mesh, 1, step=False)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(target))
    set_model_state_dict(model, state["model"])
    optim = {"optimizer_0": get_optimizer_state_dict(model, optimizer)}
    dcp.load(optim, checkpoint_id=str(target))
    set_optimizer_state_dict(model, optimizer, optim["optimizer_0"])
    with fsspec.open(f"{target}/meta.pt", "rb") as f:
        meta = torch.load(f, weights_only=False)
    assert meta["global_step"] == 3


RUNS: dict[tuple[str, str], Callable[..., None]] = {
    ("ours", "save"): save_ours,
    ("ours", "load"): load_ours,
    ("stock", "save"): save_stock,
    ("stock", "load"): load_stock,
}


def one_rank(
    store: Any,
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
    undo = _spy_writers(world, store)
    fn = RUNS[(impl, phase)]
    result: dict[str, Any] = {}
    try:
        with fake_world(rank, world_size) as mesh:
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
    finally:
        undo()
    return result


def run_size(
    store: Any, world_size: int, *, times: bool, impls: tuple[str, ...] = ("ours", "stock")
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
    return out


# ------------------------------------------------------------------------------------------ report


def total(
    figures: dict[str, Any], section: str, *, who: str = "ours", classes: tuple[str, ...] = SHARED
) -> int:
    """Operations of ``who`` on files of ``classes`` in one rank's run (``section``: files or s3)."""
    return sum(
        n
        for kinds in figures.get(section, {}).get(who, {}).values()
        for cls, n in kinds.items()
        if cls in classes
    )


def by_kind(
    figures: dict[str, Any], section: str, who: str, classes: tuple[str, ...] = SHARED
) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, per_class in figures.get(section, {}).get(who, {}).items():
        n = sum(v for cls, v in per_class.items() if cls in classes)
        if n:
            out[kind] = n
    return out


def collectives(figures: dict[str, Any], who: str = "ours") -> tuple[int, int]:
    entries = figures.get("collectives", {}).get(who, {}).values()
    return sum(n for n, _ in entries), sum(b for _, b in entries)


def growth(sizes: list[int], values: list[float]) -> str:
    """The fitted growth of ``values`` against N: the log-log slope, named."""
    points = [(math.log(n), math.log(v)) for n, v in zip(sizes, values, strict=True) if v > 0]
    if len(points) < 2 or all(v == values[0] for v in values):
        return "constant"
    xs, ys = zip(*points, strict=True)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0
    name = (
        "constant"
        if slope < 0.15
        else "sublinear"
        if slope < 0.8
        else "linear"
        if slope < 1.25
        else "superlinear"
    )
    return f"{name} (N^{slope:.2f})"


def rows(report: dict[str, Any], backend: str) -> list[tuple[str, list[float]]]:
    """The table's rows for one backend: (label, value at each N)."""
    per_n = report[backend]
    sizes = sorted(int(n) for n in per_n)
    out: list[tuple[str, list[float]]] = []

    def add(label: str, fn: Callable[[dict[str, Any]], float]) -> None:
        with contextlib.suppress(KeyError):
            out.append((label, [float(fn(per_n[str(n)])) for n in sizes]))

    section = "s3" if backend == "s3" else "files"
    for phase in ("save", "load"):
        for rank_label, pick in (("rank 0", lambda n: "0"), ("rank N-1", None)):

            def fig(d: dict[str, Any], impl: str, phase: str = phase, pick: Any = pick) -> dict[str, Any]:
                ranks = d[impl][phase]
                key = "0" if pick is not None else max(ranks, key=int)
                return ranks[key]

            add(f"{phase} {rank_label}: ours, shared-file ops", lambda d, f=fig: total(f(d, "ours"), section))
            add(
                f"{phase} {rank_label}: DCP, shared-file ops",
                lambda d, f=fig: total(f(d, "ours"), section, who="dcp"),
            )
            add(
                f"{phase} {rank_label}: stock, shared-file ops",
                lambda d, f=fig: (
                    total(f(d, "stock"), section, who="dcp") + total(f(d, "stock"), section, who="other")
                ),
            )
            add(
                f"{phase} {rank_label}: ours, all ops",
                lambda d, f=fig: total(f(d, "ours"), section, classes=(*SHARED, "own shard", "other shards")),
            )
            add(f"{phase} {rank_label}: ours, collectives", lambda d, f=fig: collectives(f(d, "ours"))[0])
            add(
                f"{phase} {rank_label}: ours, collective bytes", lambda d, f=fig: collectives(f(d, "ours"))[1]
            )
            add(
                f"{phase} {rank_label}: DCP, collective bytes",
                lambda d, f=fig: collectives(f(d, "ours"), "dcp")[1],
            )
            add(
                f"{phase} {rank_label}: ours, Python peak bytes",
                lambda d, f=fig: f(d, "ours")["peak_python_bytes"],
            )
            add(f"{phase} {rank_label}: ours, CPU s", lambda d, f=fig: f(d, "ours")["cpu_s"])
            add(f"{phase} {rank_label}: stock, CPU s", lambda d, f=fig: f(d, "stock")["cpu_s"])
    add("manifest bytes", lambda d: d["ours"]["manifest_bytes"])
    add(".metadata bytes", lambda d: d["ours"]["metadata_bytes"])
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = []
    for backend in ("local", "s3"):
        if backend not in report:
            continue
        sizes = sorted(int(n) for n in report[backend])
        unit = "requests" if backend == "s3" else "operations"
        lines += [
            f"### {backend}: {unit} per rank",
            "",
            "| per rank | " + " | ".join(f"N={n}" for n in sizes) + " | growth |",
            "|---|" + "---:|" * len(sizes) + "---|",
        ]
        for label, values in rows(report, backend):
            if label.endswith("bytes") and not any(values):
                continue  # not measured there
            shown = [
                f"{v:.3f}" if isinstance(v, float) and not v.is_integer() else f"{int(v)}" for v in values
            ]
            lines.append(f"| {label} | " + " | ".join(shown) + f" | {growth(sizes, values)} |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    sizes = sorted(int(n) for n in report["local"])
    table = dict(rows(report, "local"))
    # (panel title, the series drawn, the least value drawn: a log scale cannot show 0)
    panels: list[tuple[str, tuple[str, ...], float]] = [
        (
            "file-system operations per rank (0 drawn at 0.5)",
            (
                "load rank N-1: ours, shared-file ops",
                "load rank 0: ours, shared-file ops",
                "save rank N-1: ours, shared-file ops",
                "save rank 0: ours, shared-file ops",
                "load rank N-1: stock, shared-file ops",
                "load rank 0: ours, all ops",
                "load rank N-1: ours, all ops",
            ),
            0.5,
        ),
        (
            "CPU seconds of one rank's save / load",
            (
                "save rank 0: ours, CPU s",
                "load rank 0: ours, CPU s",
                "save rank N-1: ours, CPU s",
                "load rank N-1: ours, CPU s",
                "save rank 0: stock, CPU s",
            ),
            -math.inf,
        ),
        (
            "bytes",
            (
                "save rank 0: ours, collective bytes",
                "load rank N-1: ours, collective bytes",
                "load rank N-1: DCP, collective bytes",
                "manifest bytes",
                ".metadata bytes",
            ),
            1,
        ),
    ]
    for ax, (title, labels, least) in zip(axes, panels, strict=True):
        for label in labels:
            if label in table:
                ax.plot(sizes, [max(v, least) for v in table[label]], marker="o", label=label)
        ax.set_title(title)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size N")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(report: dict[str, Any], out: Path) -> None:
    """The figures so far (after each N: a long run stopped early keeps what it measured)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N up to 64")
    parser.add_argument("--sizes", help="comma-separated world sizes")
    parser.add_argument("--no-s3", action="store_true", help="local directories only")
    parser.add_argument("--s3-sizes", help="world sizes on S3 (default: those of --sizes)")
    parser.add_argument("--no-times", action="store_true", help="counts only (no timing pass, no plot)")
    parser.add_argument("--no-stock", action="store_true", help="our layer only, without stock DCP's runs")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (a temp dir)")
    args = parser.parse_args(argv)
    sizes = (
        [int(n) for n in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else SIZES)
    )
    times = not args.no_times
    impls = ("ours",) if args.no_stock else ("ours", "stock")
    report: dict[str, Any] = {"sizes": sizes, "rows_per_rank": ROWS}
    with tempfile.TemporaryDirectory(prefix="scale-", dir=args.dir) as tmp:
        store: Any = Local(Path(tmp))
        if times:  # imports and first calls, not measured (they would count in the first peak memory)
            run_size(Local(Path(tmp) / "warm-up"), 2, times=False, impls=impls)
        report["local"] = {}
        for n in sizes:
            started = time.perf_counter()
            report["local"][str(n)] = run_size(store, n, times=times, impls=impls)
            print(f"local N={n}: {time.perf_counter() - started:.1f}s", flush=True)
            save(report, args.out)
        if not args.no_s3:
            from tests.s3_server import S3Server

            with S3Server() as server:
                store = S3(server.url("scale"))
                report["s3"] = {}
                s3_sizes = [int(n) for n in args.s3_sizes.split(",")] if args.s3_sizes else sizes
                for n in s3_sizes:
                    started = time.perf_counter()
                    report["s3"][str(n)] = run_size(store, n, times=times, impls=impls)
                    print(f"s3 N={n}: {time.perf_counter() - started:.1f}s", flush=True)
                    save(report, args.out)
    save(report, args.out)
    if times:
        (args.out / "scale.md").write_text(markdown(report) + "\n")
        plot(report, args.out / "scale.png")
        print(markdown(report))
    return report


def render(out: Path) -> None:
    """Write ``scale.md`` and ``scale.png`` from a saved ``scale.json`` (``--render``)."""
    report = json.loads((out / "scale.json").read_text())
    (out / "scale.md").write_text(markdown(report) + "\n")
    plot(report, out / "scale.png")
    print(markdown(report))


if __name__ == "__main__":
    if "--render" in sys.argv:
        render(Path(sys.argv[sys.argv.index("--render") + 1]))
    else:
        main()
