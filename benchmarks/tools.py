"""The offline tools' figures of ``benchmarks.run``: the CLI on the kept 2-rank checkpoint, against the disk.

``inspect`` and ``verify`` (a fresh process each, its start and torch's import counted, cold cache)
against ``cat`` of the checkpoint's files to ``/dev/null``, and against the floor of every CLI command
(:data:`START`: a process that only imports what they need); ``consolidate`` (one read of the source,
checksummed as it is read; ``--no-verify`` without the checksums; through torch, as a checkpoint of
objects only torch reads is done) against the disk's copy of the same bytes; the safetensors export
likewise. Peak RSS and peak anonymous memory of each command.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.disk import evict_tree, read_all, write_fsync
from benchmarks.faithful import copy_like

_MEASURE = """
import resource, subprocess, sys, time
def anon(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
start = time.perf_counter()
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
peak_anon = 0
while child.poll() is None:
    peak_anon = max(peak_anon, anon(child.pid))
    time.sleep(0.005)
elapsed = time.perf_counter() - start
child.stderr.read()
print(elapsed, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, child.returncode, peak_anon)
"""


#: The floor of ``consolidate`` (and of ``inspect`` or ``verify`` of a checkpoint whose pickles need
#: torch): a process that imports torch, the package and ``torch.distributed.checkpoint``, then exits.
START = "CLI start (imports only)"
#: ``consolidate`` through torch (``consolidate_mapped``): what a checkpoint gets whose objects only torch
#: reads; the CLI with ``consolidate_direct.plan`` declining.
THROUGH_TORCH = "consolidate through torch"
_THROUGH_TORCH = (
    "import sys; from lightning_sharded.checkpoint.tools import consolidate_direct as direct;"
    " direct.plan = lambda found, out: 'the benchmark asks for the torch path';"
    " from lightning_sharded.cli import main; sys.exit(main())"
)
#: ``consolidate --format safetensors`` (the model's weights, uncast): without torch (``export_direct``),
#: ``--no-verify``, and through torch (``hf_export_torch``, what a cast or a full file gets).
EXPORT, EXPORT_NO_VERIFY, EXPORT_THROUGH_TORCH = (
    "export safetensors",
    "export safetensors --no-verify",
    "export safetensors through torch",
)
_EXPORT_THROUGH_TORCH = (
    "import sys; from lightning_sharded.checkpoint.tools import export_direct as direct;"
    " direct.plan = lambda *a: 'the benchmark asks for the torch path';"
    " from lightning_sharded.cli import main; sys.exit(main())"
)
#: The export's bar: the source read cold (every byte: a verified export checksums every file) and
#: written into one file of the weights' size, as a copy must at best.
EXPORT_COPY = "disk copy of the export's bytes"
#: The floor of ``inspect`` and ``verify`` of a checkpoint of tensors and plain data, which import no
#: torch (``lightning_sharded.checkpoint.unpickling.without_torch``): the command line's own imports.
START_WITHOUT_TORCH = "CLI start without torch"


def measure(command: list[str]) -> tuple[float, int, int]:
    """(seconds, peak RSS bytes, peak anonymous memory bytes) of ``command`` run in a fresh process
    (whose start is counted).

    RSS counts the pages of files the process maps (``consolidate`` maps its output, which the page
    cache holds); anonymous memory (``RssAnon``, sampled every 5 ms) is what the process allocates.
    """
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *command], capture_output=True, text=True, check=True
    ).stdout.split()
    if out[2] != "0":
        raise RuntimeError(f"{command} failed with exit code {out[2]}")
    return float(out[0]), int(out[1]) * 1024, int(out[3]) * 1024


def tools_section(ckpt: Path, scratch: Path, repeats: int, quick: bool = False) -> dict[str, Any]:
    """The offline tools on the kept 2-rank checkpoint, each against the disk doing the same bytes.

    ``inspect`` and ``verify`` (CLI, a fresh process each, cold cache) against ``cat`` of its files to
    ``/dev/null``; ``consolidate`` (one read of the source, checksummed as it is read; ``--no-verify``
    without the checksums) against the disk's copy of the source into a file of the output's size as
    a copy must at best (``benchmarks.faithful.copy_like``: cold reads dropped behind, write-behind,
    fsync, rename publish). Also timed: the bar before issue 34, a cold read of the source plus a plain
    write+fsync of as many random bytes (``consolidate`` beat it: it writes behind). The safetensors
    export (verified, ``--no-verify``, through torch) against the same copy into a file of the weights'
    size (:data:`EXPORT_COPY`). Medians. ``quick`` runs ``inspect`` and ``consolidate --no-verify`` only
    (a smoke test).
    """
    files = sorted(str(p) for p in ckpt.rglob("*") if p.is_file())
    nbytes = sum(Path(f).stat().st_size for f in files)
    cli = [sys.executable, "-c", "import sys; from lightning_sharded.cli import main; sys.exit(main())"]
    # The same command with the torch path taken (what a checkpoint of objects only torch reads gets).
    through_torch = [sys.executable, "-c", _THROUGH_TORCH]
    dst = scratch / "consolidated.ckpt"
    exported = scratch / "exported"
    raw_file = scratch / "raw-consolidate.bin"
    series: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}
    anon: dict[str, int] = {}

    out_bytes = export_bytes = 0

    def run(name: str, command: list[str]) -> None:
        nonlocal out_bytes, export_bytes
        os.sync()
        evict_tree(ckpt)
        seconds, peak, peak_anon = measure(command)
        series.setdefault(name, []).append(seconds)
        peaks[name] = max(peaks.get(name, 0), peak)
        anon[name] = max(anon.get(name, 0), peak_anon)
        if dst.exists():
            out_bytes = out_bytes or dst.stat().st_size
            dst.unlink()
        if exported.exists():
            export_bytes = export_bytes or sum(p.stat().st_size for p in exported.glob("*.safetensors"))
            shutil.rmtree(exported)

    for _ in range(repeats):
        run("cat", ["sh", "-c", "cat " + " ".join(f"'{f}'" for f in files) + " > /dev/null"])
        run(START, [sys.executable, "-c", "import lightning_sharded.cli, torch.distributed.checkpoint"])
        run(START_WITHOUT_TORCH, [sys.executable, "-c", "import lightning_sharded.cli"])
        run("inspect", [*cli, "inspect", str(ckpt)])
        if not quick:
            run("verify", [*cli, "verify", str(ckpt)])
        run(
            "consolidate --no-verify",
            [*cli, "consolidate", "--no-verify", "--no-progress", str(ckpt), str(dst)],
        )
        if not quick:
            run("consolidate", [*cli, "consolidate", "--no-progress", str(ckpt), str(dst)])
            run(THROUGH_TORCH, [*through_torch, "consolidate", "--no-progress", str(ckpt), str(dst)])
            export = ["consolidate", "--format", "safetensors", "--no-progress"]
            run(EXPORT, [*cli, *export, str(ckpt), str(exported)])
            run(EXPORT_NO_VERIFY, [*cli, *export, "--no-verify", str(ckpt), str(exported)])
            export_torch = [sys.executable, "-c", _EXPORT_THROUGH_TORCH]
            run(EXPORT_THROUGH_TORCH, [*export_torch, *export, str(ckpt), str(exported)])
        os.sync()
        evict_tree(ckpt)
        start = time.perf_counter()
        copy_like([Path(f) for f in files], raw_file, out_bytes)
        series.setdefault("disk copy", []).append(time.perf_counter() - start)
        raw_file.unlink()
        if not quick:
            os.sync()
            evict_tree(ckpt)
            start = time.perf_counter()
            copy_like([Path(f) for f in files], raw_file, export_bytes)
            series.setdefault(EXPORT_COPY, []).append(time.perf_counter() - start)
            raw_file.unlink()
        os.sync()
        evict_tree(ckpt)
        start = time.perf_counter()
        for f in files:
            read_all(Path(f))
        write_fsync(raw_file, nbytes)
        series.setdefault("whole-file read + write (before issue 34)", []).append(time.perf_counter() - start)
        raw_file.unlink()
    med = {name: statistics.median(values) for name, values in series.items()}
    rows = {
        name: {
            "seconds": med[name],
            "GB/s": nbytes / med[name] / 1e9,
            "peak rss bytes": peaks.get(name, 0),
            "peak anon bytes": anon.get(name, 0),
        }
        for name in med
    }
    ratios = {
        "inspect / cat": med["inspect"] / med["cat"],
        "CLI start / cat": med[START] / med["cat"],
        "CLI start without torch / cat": med[START_WITHOUT_TORCH] / med["cat"],
        "consolidate --no-verify GB/s / disk copy": med["disk copy"] / med["consolidate --no-verify"],
        "consolidate peak anonymous memory / checkpoint": anon["consolidate --no-verify"] / nbytes,
    }
    if not quick:
        ratios["verify / cat"] = med["verify"] / med["cat"]
        ratios["consolidate GB/s / disk copy"] = med["disk copy"] / med["consolidate"]
        ratios[f"{THROUGH_TORCH} GB/s / disk copy"] = med["disk copy"] / med[THROUGH_TORCH]
        for name in (EXPORT, EXPORT_NO_VERIFY, EXPORT_THROUGH_TORCH):
            ratios[f"{name} GB/s / disk copy"] = med[EXPORT_COPY] / med[name]
    above = [f"{name} {value:.2f}" for name, value in ratios.items() if "disk copy" in name and value > 1.0]
    return {
        "rows": rows,
        "ratios": ratios,
        "bytes": nbytes,
        "output bytes": out_bytes,
        "export bytes": export_bytes,
        "series": series,
        "above the bars": above,
    }
