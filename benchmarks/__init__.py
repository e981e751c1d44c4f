"""The benchmarks of lightning_sharded: every figure a ratio against a baseline measured in the same run.

Run from the repository root, as modules (``python -m benchmarks.run --quick``); the figures and how
they are made are in ``docs/benchmarks.md``, the layers of this package in ``docs/architecture.md``.

Layers (each imports only those below it; nothing imports ``tests``):

- entry points: ``run`` (the suite: rank cases, tools, hooks, then the report), ``phases``, ``writers``,
  ``scale`` (a package of its own), ``hooks_overhead``, ``hf_memory``, ``checksum_throughput``,
  ``commit_overhead``;
- the report of ``run``: ``report`` (the ranks' figures into sections and ratios), ``tables``
  (console, markdown, ``docs/benchmarks.md``), ``chart`` (``results.png``), ``tools`` (the CLI timed),
  ``profile`` (the phases timed and the resume's profile made of them);
- ``cases``: the one registry of rank cases, and the rank process (``python -m benchmarks.cases``);
- rank cases: ``save_load``, ``async_stall``, ``training``, ``writers``, ``phases``;
- ``ranks``: the one rank runner (starts the ranks, forked after one import; their figures come back
  as files);
- helpers: ``builders`` (model, strategies, trainers), ``world`` (what the ranks do together),
  ``timing`` (the one undoable patch and timer), ``faithful`` (the disk's limit: the checkpoint's own
  files written and read as a save and a resume must, at best), ``disk`` (the probes' registry and
  file primitives), ``staging`` (the bare writers of the writer experiment), ``names`` (the display
  names), ``s3_server`` (moto on loopback).
"""

from __future__ import annotations

from pathlib import Path

#: The repository root: where ``python -m benchmarks...`` runs, and what the ranks put on their path.
ROOT = Path(__file__).resolve().parents[1]
#: Where the figures go by default.
RESULTS = ROOT / "benchmarks" / "results"
