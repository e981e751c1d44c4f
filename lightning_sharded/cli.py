"""``lightning-sharded``: inspect, verify and consolidate checkpoints; run the demo.

Every command works in one plain process, with no process group. Exit status: 0 when all went
well, 1 when a checkpoint is missing, invalid or damaged or a destination is refused (one line on
stderr says what and where; ``--debug`` shows the traceback), 2 for usage errors. ``-v`` and
``--debug`` may come before or after the command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator, Sequence

from lightning_sharded.checkpoint.progress import format_files, format_size

__all__ = ["main"]

EXIT_OK = 0
EXIT_BAD_CHECKPOINT = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

_PROG = "lightning-sharded"


def _inspect(args: argparse.Namespace) -> int:
    from lightning_sharded.checkpoint.tools import inspect_checkpoint

    info = inspect_checkpoint(args.path, weights_only=not args.unsafe_unpickle)
    if args.json:
        print(json.dumps(info.to_dict(), indent=1))
        return EXIT_OK
    rows = [
        (
            e.key,
            "-" if e.shape is None else "(" + ", ".join(map(str, e.shape)) + ")",
            e.dtype,
            "-" if e.value is not None else format_size(e.size),
            e.shards,
            e.value or "",
        )
        for e in info.entries
    ]
    headers = ("key", "shape", "dtype", "size", "shards", "value")
    widths = [max([len(h)] + [len(str(r[i])) for r in rows]) for i, h in enumerate(headers)]
    align = ("<", "<", "<", ">", ">", "<")
    line = "  ".join(f"{{:{a}{w}}}" for a, w in zip(align, widths, strict=True))
    for row in [headers, *rows]:
        print(line.format(*map(str, row)).rstrip())
    print()
    print(f"path:        {info.path}")
    manifest = " (manifest)" if info.has_manifest else " (no manifest)" if info.kind == "sharded" else ""
    print(f"kind:        {info.kind}{manifest}")
    tensors = sum(e.value is None for e in info.entries)
    print(
        f"entries:     {len(info.entries)}: {tensors} tensors, {format_size(info.total_size)};"
        f" {len(info.entries) - tensors} values"
    )
    print(f"files:       {info.files}, {format_size(info.disk_size)}")
    print(f"world size:  {info.world_size if info.world_size is not None else '-'}")
    print(f"epoch:       {info.epoch if info.epoch is not None else '-'}")
    print(f"global step: {info.global_step if info.global_step is not None else '-'}")
    if info.rank_state_ranks is not None:
        print(f"rank state:  {info.rank_state_ranks} rank(s): RNG and train dataloader state, per rank")
    if info.frozen is not None:
        prefix = f" (keys less {info.frozen['prefix']!r})" if info.frozen["prefix"] else ""
        print(
            f"partial:     trainable only: {len(info.frozen['keys'])} frozen parameter(s) not in it,"
            f" read from {info.frozen['source']}{prefix}"
        )
    if info.not_unpickled:
        from lightning_sharded.checkpoint.unpickling import UNSAFE_FLAG

        print()
        for key, name in sorted(info.not_unpickled.items()):
            print(f"not unpickled: {key} holds {name}")
        print(
            "These entries hold types that a safe load refuses (unpickling them could run code from the"
            f" file); nothing of them was unpickled. If you trust the file, use {UNSAFE_FLAG}."
        )
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from lightning_sharded.checkpoint.verify import verify_checkpoint

    report = verify_checkpoint(
        args.path, progress=False if args.no_progress else None, weights_only=not args.unsafe_unpickle
    )
    what = "checksums" if report.has_manifest or report.kind == "full" else "sizes"
    files = f"{report.files} file" + ("s" if report.files != 1 else "")
    print(f"OK: {report.path} ({report.kind.value}, {files}, {format_size(report.bytes)}; {what} match)")
    for note in report.notes:
        print(f"note: {note}")
    return EXIT_OK


def _consolidate(args: argparse.Namespace) -> int:
    from lightning_sharded.checkpoint.detect import checkpoint_files, detect
    from lightning_sharded.checkpoint.tools import consolidate_checkpoint

    hf_only = ("dtype", "prefix", "max_shard_size", "config")
    given = ["--" + name.replace("_", "-") for name in hf_only if getattr(args, name) is not None]
    if args.format != "safetensors" and given:
        print(
            f"{_PROG} consolidate: error: {', '.join(given)} apply to --format safetensors only (the"
            " lightning format keeps every key in its own dtype).",
            file=sys.stderr,
        )
        return EXIT_USAGE
    out = consolidate_checkpoint(  # for lightning, the safetensors options are None (checked above)
        args.src,
        args.dst,
        format=args.format,
        overwrite=args.force,
        verify=not args.no_verify,
        progress=False if args.no_progress else None,
        weights_only=not args.unsafe_unpickle,
        dtype=args.dtype,
        prefix=args.prefix,
        max_shard_size=args.max_shard_size or "5GB",
        config=args.config,
    )
    files = checkpoint_files(detect(out, safetensors=True))  # what was written, counted as everywhere
    if args.format == "safetensors":
        weights = sum(name.endswith(".safetensors") for name in files)
        print(
            f"Wrote {out} ({weights} safetensors file{'s' if weights != 1 else ''}; {format_files(files)}):"
            " load it with transformers' from_pretrained, or into a sharded model with"
            " lightning_sharded.load_pretrained."
        )
    else:
        print(
            f"Wrote {out} ({format_size(sum(files.values()))}): load it with torch.load, or resume from it"
            " with Lightning."
        )
    return EXIT_OK


def _demo(argv: list[str]) -> int:
    import importlib

    try:
        return int(importlib.import_module("lightning_sharded.demo").main(argv) or 0)
    except SystemExit as exit_:  # the demo's own argument parser: --help, or a usage error
        return int(exit_.code or 0)


def _common_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """``-v`` and ``--debug``, before and after the command (the subcommands' defaults are suppressed,
    so one given before the command is not reset by the subcommand's parser)."""
    default: object = False if top else argparse.SUPPRESS
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=default, help="log what is done, with timings"
    )
    parser.add_argument(
        "--debug", action="store_true", default=default, help="on an error, show the traceback too"
    )


#: The subcommands that read a checkpoint: (one-line summary, description), in the order of ``--help``.
_CHECKPOINT_COMMANDS = {
    "inspect": (
        "list the entries of a checkpoint, its size, epoch and step",
        "List the entries of a checkpoint (tensors with shape, dtype and size; other values as they"
        " are), its files, world size, epoch and step, after checking that every file is there with its"
        " size. Reads .metadata, the manifest, meta.pt and the non-tensor entries (the optimizers' param"
        " groups: a few KB of the shard files): no tensor's bytes, no checksum (that is verify).",
    ),
    "verify": (
        "check every file of a checkpoint (presence, size, checksum)",
        "Check every file of a checkpoint: presence, size and checksum (reads every byte once, a large"
        " file in two streams at once, and leaves none of it in the page cache).",
    ),
    "consolidate": (
        "convert a sharded directory into one full file or safetensors",
        "Convert a sharded checkpoint directory into one full checkpoint file that plain torch.load and"
        " stock Lightning read, or (--format safetensors) a checkpoint's weights into a Hugging Face"
        " directory that from_pretrained loads. Verifies the source's checksums first, and never replaces"
        " anything without --force.",
    ),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Inspect, verify and consolidate Lightning checkpoints (sharded directories or full"
        " files).",
    )
    _common_options(parser, top=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    path_help = "a sharded checkpoint directory or a full checkpoint file"
    for name, (summary, description) in _CHECKPOINT_COMMANDS.items():
        command = commands.add_parser(name, help=summary, description=description)
        command.add_argument(
            "--unsafe-unpickle",
            action="store_true",
            help="unpickle whatever the checkpoint holds, running its code: only for a file you trust (by"
            " default only tensors, plain data and what Lightning writes are unpickled)",
        )
        _common_options(command, top=False)
    inspect, verify, consolidate = (commands.choices[name] for name in _CHECKPOINT_COMMANDS)
    inspect.add_argument("path", metavar="PATH", help=path_help)
    inspect.add_argument("--json", action="store_true", help="print JSON for scripts")
    verify.add_argument("path", metavar="PATH", help=path_help)
    verify.add_argument("--no-progress", action="store_true", help="no progress bar")
    consolidate.add_argument(
        "src",
        metavar="SRC",
        help="the sharded checkpoint directory (--format safetensors: or a full checkpoint file)",
    )
    consolidate.add_argument(
        "dst",
        metavar="DST",
        help="the full checkpoint file to write (--format safetensors: the directory); ending with a slash"
        " (runs/): inside that directory, named as SRC",
    )
    consolidate.add_argument(
        "--force",
        action="store_true",
        help="replace a file, an empty directory or a sharded checkpoint at DST (never SRC itself, never a"
        " directory that is not a checkpoint)",
    )
    consolidate.add_argument(
        "--no-verify", action="store_true", help="do not compare the source's checksums first"
    )
    consolidate.add_argument("--no-progress", action="store_true", help="no progress bar")
    consolidate.add_argument(
        "--format",
        choices=("lightning", "safetensors"),
        default="lightning",
        help="lightning: one full checkpoint file (default); safetensors: a Hugging Face directory DST"
        " (model.safetensors, or files and model.safetensors.index.json) of the model's weights",
    )
    consolidate.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="safetensors: cast floating tensors to this dtype (default: keep each tensor's)",
    )
    consolidate.add_argument(
        "--prefix",
        metavar="PREFIX",
        help="safetensors: export the keys that start with PREFIX, without it (llm. for self.llm)",
    )
    consolidate.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="safetensors: the largest file (default 5GB; 500MB, 2GiB, or bytes); above it, several files"
        " and an index",
    )
    consolidate.add_argument(
        "--config", metavar="CONFIG_JSON", help="safetensors: a config.json to copy beside the weights"
    )
    commands.add_parser(
        "demo", help="train, save and resume a sharded model on CPU (options: demo --help)", add_help=False
    )
    return parser


def _split_demo(args: list[str]) -> tuple[list[str], list[str]] | None:
    """``[-v] [--debug] demo ARGS...``: the options before ``demo`` and ARGS; ``None`` for other commands."""
    for i, arg in enumerate(args):
        if not arg.startswith("-"):
            return (args[:i], args[i + 1 :]) if arg == "demo" else None
    return None


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is logged (tests replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # under the handler's lock
        super().emit(record)


@contextlib.contextmanager
def _logging(verbose: bool) -> Iterator[None]:
    """The library's log messages on stderr while a command runs: info with ``-v``, else warnings only.

    Set on the ``lightning_sharded`` logger, and undone afterwards (``main`` may run inside a program).
    """
    logger = logging.getLogger("lightning_sharded")
    saved = logger.level, logger.propagate
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lightning-sharded`` command line.

    Args:
        argv: The arguments, without the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        The exit status: 0 on success; 1 for a missing, invalid or damaged checkpoint, a refused
        destination or a failed write (one line on stderr; the traceback with ``--debug``); 2 for usage
        errors.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    demo = _split_demo(args_list)
    try:
        args = _parser().parse_args(args_list if demo is None else [*demo[0], "demo"])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if demo is not None:
        with _logging(args.verbose):
            return _demo(demo[1])
    verbose, debug = getattr(args, "verbose", False), getattr(args, "debug", False)
    handler = {"inspect": _inspect, "verify": _verify, "consolidate": _consolidate}[args.command]
    where = f"{_PROG} {args.command}"
    try:
        with _logging(verbose):
            return handler(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{where}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:
        if debug:
            raise
        # CheckpointError is a ValueError; refused destinations and failed writes are OSErrors.
        if isinstance(err, (ValueError, OSError)):
            print(f"{where}: error: {_one_line(err)}", file=sys.stderr)
        else:
            print(
                f"{where}: unexpected error: {type(err).__name__}: {_one_line(err)} (this is a bug in"
                " lightning_sharded: run again with --debug for the traceback, and report it)",
                file=sys.stderr,
            )
        return EXIT_BAD_CHECKPOINT


if __name__ == "__main__":
    sys.exit(main())
