"""The one registry of rank cases, by name; run as a module, the process that forks the ranks.

``benchmarks.ranks.run_rank_cases`` starts ``python -m benchmarks.cases CASES... OPTIONS``; this
module's ``__main__`` hands :data:`CASES` to :func:`benchmarks.ranks.serve`. A new case is a function
``(name, options) -> figures`` in its module's ``CASES``, merged here.
"""

from __future__ import annotations

from benchmarks import async_stall, phases, save_load, training, writers
from benchmarks.ranks import Case, serve

CASES: dict[str, Case] = {
    **save_load.CASES,
    **async_stall.CASES,
    **training.CASES,
    **writers.CASES,
    **phases.CASES,
}

if __name__ == "__main__":
    serve(CASES)
