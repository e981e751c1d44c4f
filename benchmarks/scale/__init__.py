"""``python -m benchmarks.scale``: one rank's save and load in a simulated world of N ranks.

Modules: ``__main__`` (the runs at each N, the command line), ``runs`` (the tiny model; each
implementation's save and load), ``stores`` (local directory, S3), ``simworld`` (the other ranks),
``counting`` (what a run does to storage and the other ranks), ``report`` (tables and plot).
"""
