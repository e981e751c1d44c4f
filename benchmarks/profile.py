"""What ``benchmarks.phases`` times, each phase in a group, and the resume's profile made of them.

:data:`PHASES` is the one table of timed functions (the rank case installs it with
``benchmarks.timing.PhaseTimers``); this module imports nothing of torch or Lightning, so the report of
``benchmarks.run`` builds the profile section (:func:`section`) in the driver process.

The resume's profile is exclusive: each phase's own seconds, less those of the timed phases it calls,
on the rank's main thread, inside Lightning's two restore calls (:data:`ROOTS`). So the phases of a
resume add up to its wall time, and a profile whose sum misses the wall by more than
:data:`TOLERANCE` says its timers are wrong (a problem of the section). What the reader's threads do
(reading, CRC-32, dropping the page cache, faulting in new memory) overlaps the main thread's wait for
them; it is shown beside the profile, not in its sum.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from benchmarks import names

#: The groups of the resume's profile, in the order shown.
READING = "reading bytes (waiting for the read threads)"
TORCH_READS = "torch's reader for the small items (while the read threads read the large ones)"
LOCATING = "the reads set up: targets resolved, threads started (ours)"
CHECKSUMS = "checksums after the reads"
COPY = "copy into the sharded tensors"
TEMPLATES = "state dicts to read into (the model's, optimizer templates)"
OPTIMIZER = "optimizer set (load_state_dict)"
PLANNING = "DCP: planning and its own work"
COLLECTIVES = "collectives (waiting for the other ranks)"
METADATA = "metadata, layout and checks (ours)"
RANK_STATE = "per-rank state (RNG, dataloader)"
STRATEGY = "the strategy's load_checkpoint, beside the above"
LIGHTNING = "Lightning's own restore"
SAVE = "state dicts and writes (a save's)"
GROUPS = (
    READING,
    TORCH_READS,
    LOCATING,
    CHECKSUMS,
    COPY,
    TEMPLATES,
    OPTIMIZER,
    PLANNING,
    COLLECTIVES,
    METADATA,
    RANK_STATE,
    STRATEGY,
    LIGHTNING,
    SAVE,
)
#: Functions that run on the reader's threads: inclusive seconds, overlapping the main thread's wait.
THREADS = "in the read threads (overlapping the wait)"
#: The most the sum of a resume's phases may fall short of its wall time (a fraction of it).
TOLERANCE = 0.01

_CONNECTOR = "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector"
_SHARDED = "lightning_sharded.checkpoint.load.sharded"
_READER = "lightning_sharded.checkpoint.backends.dcp_reader"
_DIST = "torch.distributed.checkpoint.utils._DistWrapper"
_STATE_DICT = "torch.distributed.checkpoint.state_dict"
_READINTO = "read threads: readinto (incl. CRC-32 and drops)"
_CRC = "read threads: CRC-32"
_DROP = "read threads: page cache dropped behind"
#: Derived: the read threads' ``readinto`` seconds less their CRC-32 and page-cache drops.
_READ_CALLS = "read threads: the read calls themselves (readinto less CRC-32 and drops)"


class Phase(NamedTuple):
    """A timed function: its owner (a dotted name; ``STRATEGY``: the case's strategy class, inherited
    methods included), its attribute, its label, its group in the resume's profile."""

    owner: str
    attr: str
    label: str
    group: str


#: Lightning's two calls of ``fit(ckpt_path=...)`` that restore a checkpoint: the profile's roots.
ROOTS = (
    "load: Lightning _restore_modules_and_callbacks (incl. load_checkpoint)",
    "load: Lightning restore_training_state",
)

PHASES: list[Phase] = [
    # Lightning
    Phase(_CONNECTOR, "dump_checkpoint", "save: Lightning dump_checkpoint (state dicts + loops)", SAVE),
    Phase(_CONNECTOR, "_restore_modules_and_callbacks", ROOTS[0], LIGHTNING),
    Phase(_CONNECTOR, "restore_training_state", ROOTS[1], LIGHTNING),
    Phase(_CONNECTOR, "resume_start", "load: Lightning resume_start (calls load_checkpoint)", LIGHTNING),
    Phase(_CONNECTOR, "restore_callbacks", "load: Lightning restore_callbacks", LIGHTNING),
    Phase(_CONNECTOR, "restore_loops", "load: Lightning restore_loops", LIGHTNING),
    Phase(
        _CONNECTOR,
        "restore_optimizers_and_schedulers",
        "load: Lightning restore_optimizers_and_schedulers",
        LIGHTNING,
    ),
    Phase(
        "lightning.pytorch.trainer.connectors.checkpoint_connector",
        "_pl_migrate_checkpoint",
        "load: Lightning checkpoint migration",
        LIGHTNING,
    ),
    # the strategy
    Phase("STRATEGY", "lightning_module_state_dict", "save: model state dict", SAVE),
    Phase("STRATEGY", "optimizer_state", "save: optimizer state dict", SAVE),
    Phase("STRATEGY", "save_checkpoint", "save: strategy.save_checkpoint (write + commit)", SAVE),
    Phase("STRATEGY", "load_checkpoint", "load: strategy.load_checkpoint", STRATEGY),
    Phase("STRATEGY", "load_model_state_dict", "load: strategy.load_model_state_dict", COPY),
    Phase("STRATEGY", "load_optimizer_state_dict", "load: strategy.load_optimizer_state_dict", OPTIMIZER),
    Phase("STRATEGY", "broadcast", "strategy.broadcast", COLLECTIVES),
    Phase("STRATEGY", "barrier", "strategy.barrier", COLLECTIVES),
    # DCP, both directions
    Phase(
        "torch.distributed.checkpoint.default_planner.DefaultSavePlanner",
        "create_local_plan",
        "dcp: save local plan",
        SAVE,
    ),
    Phase(
        "torch.distributed.checkpoint.default_planner.DefaultSavePlanner",
        "create_global_plan",
        "dcp: save global plan",
        SAVE,
    ),
    Phase("torch.distributed.checkpoint.filesystem.FileSystemWriter", "write_data", "dcp: write_data", SAVE),
    Phase("torch.distributed.checkpoint.filesystem.FileSystemWriter", "finish", "dcp: write .metadata", SAVE),
    Phase(
        "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner",
        "set_up_planner",
        "dcp: load set_up_planner",
        PLANNING,
    ),
    Phase(
        "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner",
        "create_local_plan",
        "dcp: load local plan",
        PLANNING,
    ),
    Phase(
        "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner",
        "create_global_plan",
        "dcp: load global plan",
        PLANNING,
    ),
    Phase(
        "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner",
        "finish_plan",
        "dcp: load finish_plan",
        PLANNING,
    ),
    Phase(
        "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner",
        "commit_tensor",
        "dcp: load commit_tensor",
        COPY,
    ),
    Phase(
        "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner",
        "load_bytes",
        "dcp: load load_bytes (unpickled values)",
        TORCH_READS,
    ),
    Phase(
        "torch.distributed.checkpoint.filesystem.FileSystemReader",
        "read_metadata",
        "dcp: read .metadata",
        METADATA,
    ),
    Phase(
        "torch.distributed.checkpoint.filesystem.FileSystemReader",
        "read_data",
        "dcp: FileSystemReader.read_data (torch's path: read, unpickle, copy)",
        TORCH_READS,
    ),
    Phase("torch.distributed.checkpoint.state_dict_loader", "load", "dcp: load (whole call)", PLANNING),
    Phase(
        "torch.distributed.checkpoint.state_dict_loader",
        "_load_state_dict",
        "dcp: _load_state_dict",
        PLANNING,
    ),
    Phase("torch.distributed.checkpoint.state_dict_saver", "save", "dcp: save (whole call)", SAVE),
    Phase(_DIST, "reduce_scatter", "dcp: reduce_scatter (plans)", COLLECTIVES),
    Phase(_DIST, "all_gather", "dcp: all_gather", COLLECTIVES),
    Phase(_DIST, "broadcast_object", "dcp: broadcast_object", COLLECTIVES),
    Phase(_DIST, "all_reduce", "dcp: all_reduce", COLLECTIVES),
    # torch's state-dict helpers (stock strategies)
    Phase(
        "torch.distributed.fsdp.FullyShardedDataParallel",
        "optim_state_dict",
        "fsdp1: FSDP.optim_state_dict",
        TEMPLATES,
    ),
    Phase(
        "torch.distributed.fsdp.FullyShardedDataParallel",
        "optim_state_dict_to_load",
        "fsdp1: FSDP.optim_state_dict_to_load",
        COPY,
    ),
    Phase(_STATE_DICT, "_init_optim_state", "torch: _init_optim_state (fake step)", TEMPLATES),
    Phase(_STATE_DICT, "get_model_state_dict", "torch: get_model_state_dict", TEMPLATES),
    Phase(_STATE_DICT, "get_optimizer_state_dict", "torch: get_optimizer_state_dict", TEMPLATES),
    Phase(_STATE_DICT, "set_model_state_dict", "torch: set_model_state_dict", COPY),
    Phase(_STATE_DICT, "set_optimizer_state_dict", "torch: set_optimizer_state_dict", OPTIMIZER),
    Phase("torch.optim.Optimizer", "load_state_dict", "torch: Optimizer.load_state_dict", OPTIMIZER),
    Phase(
        "torch.distributed.checkpoint.optimizer",
        "load_sharded_optimizer_state_dict",
        "stock: load_sharded_optimizer_state_dict",
        TEMPLATES,
    ),
    # ours: the load
    Phase("lightning_sharded.checkpoint.load", "restore_checkpoint", "ours: restore_checkpoint", METADATA),
    Phase("lightning_sharded.checkpoint.load", "detect", "ours: detect", METADATA),
    Phase("lightning_sharded.checkpoint.load", "check_found", "ours: check_found (sizes/manifest)", METADATA),
    Phase("lightning_sharded.checkpoint.load", "restore_sharded", "ours: restore_sharded", METADATA),
    Phase(
        "lightning_sharded.checkpoint.integrity.ReadVerification",
        "check_sizes",
        "ours: file sizes against the manifest",
        METADATA,
    ),
    Phase(
        "lightning_sharded.checkpoint.integrity",
        "_checksum_problems",
        "ours: verify checksums (a read)",
        CHECKSUMS,
    ),
    Phase(
        "lightning_sharded.checkpoint.integrity.ReadVerification",
        "check",
        "ours: verify checksums (after the reads)",
        CHECKSUMS,
    ),
    Phase(_SHARDED, "read_sharded_layout", "ours: read layout (.metadata)", METADATA),
    Phase(_SHARDED, "model_state_dict", "ours: load target model state dict", METADATA),
    Phase("lightning_sharded.checkpoint.load.checks", "fit_model", "ours: key and shape check", METADATA),
    Phase(_SHARDED, "check_shapes", "ours: shape check (optimizer)", METADATA),
    Phase(_SHARDED, "read_meta", "ours: meta.pt", METADATA),
    Phase(_SHARDED, "_prepare_optimizer", "ours: optimizer template and checks", TEMPLATES),
    Phase(_SHARDED, "template_like", "ours: optimizer template from the index", TEMPLATES),
    Phase(
        "lightning_sharded.checkpoint.fsdp1",
        "optimizer_template",
        "ours: FSDP1 optimizer template",
        TEMPLATES,
    ),
    Phase(_SHARDED, "torch_optimizer_template", "ours: optimizer template (torch's fake step)", TEMPLATES),
    Phase(_SHARDED, "_dcp_load", "ours: dcp load call, beside DCP", PLANNING),
    Phase(_SHARDED, "_copy_into", "ours: copy the checked values into the model", COPY),
    Phase(_SHARDED, "set_model_state", "ours: set_model_state", COPY),
    Phase(_SHARDED, "set_optimizer_state", "ours: set_optimizer_state", OPTIMIZER),
    Phase(_SHARDED, "key_by_index", "ours: optimizer state keyed by index", OPTIMIZER),
    Phase(
        "lightning_sharded.checkpoint.shard_pieces",
        "unwrap_state",
        "ours: optimizer state off its shard views (FSDP1, TorchRec)",
        OPTIMIZER,
    ),
    Phase("lightning_sharded.checkpoint.collective", "decide", "ours: collective.decide", COLLECTIVES),
    Phase("lightning_sharded.checkpoint.collective", "agree", "ours: collective.agree", COLLECTIVES),
    Phase("lightning_sharded.checkpoint.collective", "gather", "ours: collective.gather", COLLECTIVES),
    Phase("lightning_sharded.checkpoint.collective", "broadcast", "ours: collective.broadcast", COLLECTIVES),
    Phase("lightning_sharded.checkpoint.rank_state", "restore", "ours: per-rank state", RANK_STATE),
    Phase(f"{_READER}.DirectReader", "read_data", "ours: DirectReader.read_data (set-up)", LOCATING),
    Phase(f"{_READER}.DirectReader", "_read_jobs", "ours: DirectReader reads (waiting)", READING),
    Phase(f"{_READER}.DirectReader", "prepare_global_plan", "ours: shared reads counted", PLANNING),
    Phase(_READER, "_readinto", "read threads: readinto (incl. CRC-32 and drops)", THREADS),
    Phase(_READER, "crc32", "read threads: CRC-32", THREADS),
    Phase(_READER, "_drop_behind", "read threads: page cache dropped behind", THREADS),
    Phase(_READER, "_prefault", "prefault thread: new memory faulted in", THREADS),
    # ours: the save
    Phase(
        "lightning_sharded.checkpoint.backends.dcp_writer.ChecksummingWriter",
        "write_data",
        "ours: writer write_data",
        SAVE,
    ),
    Phase(
        "lightning_sharded.checkpoint.save", "commit_directory", "ours: commit_directory (incl. write)", SAVE
    ),
]

_GROUP = {phase.label: phase.group for phase in PHASES}


def resume_profile(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rank's profile of one resume (``records``: each rank's figures of a ``phases-*`` case): its
    own seconds by group of :data:`GROUPS` and by phase, the read threads' seconds, their sum and the
    wall time of the restore."""
    profiles = []
    for record in records:
        own: dict[str, float] = record["load own"]
        groups = dict.fromkeys(GROUPS, 0.0)
        for label, seconds in own.items():
            groups[_GROUP.get(label, LIGHTNING)] += seconds
        threads = dict(record["load threads"])
        if _READINTO in threads:  # what is left of the read threads' time for the reads themselves
            threads[_READ_CALLS] = threads[_READINTO] - threads.get(_CRC, 0.0) - threads.get(_DROP, 0.0)
        profiles.append(
            {
                "groups": groups,
                "phases": own,
                "threads": threads,
                "sum s": sum(own.values()),
                "wall s": record["load s"],
            }
        )
    return profiles


def case_label(case: str) -> str:
    """A ``phases-*`` case's name in the tables: ``phases-ours-mp+verify``:
    ``"ShardedModelParallelStrategy (verify=True)"``."""
    base, _, option = case.removeprefix("phases-").partition("+")
    return names.label(base) + (f" ({option}=True)" if option else "")


def section(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's profile section from every ``phases-*`` case of the run: ``rows`` (each case's
    :func:`resume_profile`), ``ratios`` (each rank's sum of the phases / wall time) and ``problems``
    (a sum that misses the wall by more than :data:`TOLERANCE`, or exceeds it)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    ratios: dict[str, float] = {}
    problems: list[str] = []
    for case, figures in per_rank[0].items():
        if not case.startswith("phases-") or "error" in figures:
            continue
        label = case_label(case)
        rows[label] = resume_profile([r[case] for r in per_rank])
        for rank, profile in enumerate(rows[label]):
            ratio = profile["sum s"] / profile["wall s"]
            ratios[f"{label}: rank {rank} sum of the phases / wall"] = ratio
            if not 1.0 - TOLERANCE <= ratio <= 1.0 + 1e-6:
                problems.append(
                    f"{label}, rank {rank}: the phases add up to {profile['sum s']:.3f} s of a"
                    f" {profile['wall s']:.3f} s resume"
                )
    return {"rows": rows, "ratios": ratios, "problems": problems}


def profile_lines(label: str, profiles: list[dict[str, Any]]) -> list[str]:
    """One case's resume profile as text: each group's own seconds per rank, the phases inside it, the
    sum against the wall, then the read threads' seconds."""
    ranks = range(len(profiles))
    head = "".join(f"{f'rank {r}':>9}" for r in ranks)
    lines = [f"\n{label}: the resume by phase (own seconds, each rank){'':<8}{head}"]

    def line(name: str, values: list[float], indent: int) -> str:
        return f"{' ' * indent}{name:<{76 - indent}}" + "".join(f"{v:>9.3f}" for v in values)

    for group in GROUPS:
        values = [p["groups"][group] for p in profiles]
        if not any(values):
            continue
        lines.append(line(group, values, 2))
        labels = sorted(
            {label for p in profiles for label in p["phases"] if _GROUP.get(label, LIGHTNING) == group},
            key=lambda label: -max(p["phases"].get(label, 0.0) for p in profiles),
        )
        lines += [line(label, [p["phases"].get(label, 0.0) for p in profiles], 6) for label in labels]
    lines.append(line("sum of the phases", [p["sum s"] for p in profiles], 2))
    lines.append(line("wall time of the restore", [p["wall s"] for p in profiles], 2))
    threaded = sorted({label for p in profiles for label in p["threads"]})
    if threaded:
        lines.append(f"  {THREADS} (inclusive, summed over the threads):")
        lines += [line(label, [p["threads"].get(label, 0.0) for p in profiles], 6) for label in threaded]
    return lines
