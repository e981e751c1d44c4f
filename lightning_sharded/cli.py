"""``lightning-sharded``: inspect, verify and consolidate checkpoints; run the demo.

Every command works in one plain process, with no process group. Exit status: 0 when all went
well, 1 when a checkpoint is damaged or invalid (the message names each bad file), 2 for usage
errors and for a missing demo.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]

EXIT_OK = 0
EXIT_BAD_CHECKPOINT = 1
EXIT_USAGE = 2


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _inspect(args: argparse.Namespace) -> int:
    from lightning_sharded.checkpoint.tools import inspect_checkpoint

    info = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(info.to_dict(), indent=1))
        return EXIT_OK
    rows = [
        (
            e.key,
            "-" if e.shape is None else "(" + ", ".join(map(str, e.shape)) + ")",
            e.dtype,
            _size(e.size),
            e.shards,
        )
        for e in info.entries
    ]
    headers = ("key", "shape", "dtype", "size", "shards")
    widths = [max([len(h)] + [len(str(r[i])) for r in rows]) for i, h in enumerate(headers)]
    line = "  ".join(f"{{:<{w}}}" if i < 3 else f"{{:>{w}}}" for i, w in enumerate(widths))
    print(line.format(*headers))
    for row in rows:
        print(line.format(*map(str, row)))
    print()
    print(f"path:        {info.path}")
    print(
        f"kind:        {info.kind}"
        + ("" if info.kind == "full" else " (manifest)" if info.has_manifest else " (no manifest)")
    )
    print(f"entries:     {len(info.entries)}, {_size(info.total_size)}")
    print(f"files:       {info.files}, {_size(info.disk_size)} on disk")
    print(f"world size:  {info.world_size if info.world_size is not None else '-'}")
    print(f"epoch:       {info.epoch if info.epoch is not None else '-'}")
    print(f"global step: {info.global_step if info.global_step is not None else '-'}")
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from lightning_sharded.checkpoint.verify import verify_checkpoint

    report = verify_checkpoint(args.path)
    what = "checksums" if report.has_manifest or report.kind == "full" else "sizes"
    files = f"{report.files} file" + ("s" if report.files != 1 else "")
    print(f"OK: {report.path} ({report.kind.value}, {files}, {_size(report.bytes)}; {what} match)")
    for note in report.notes:
        print(f"note: {note}")
    return EXIT_OK


def _consolidate(args: argparse.Namespace) -> int:
    from lightning_sharded.checkpoint.backends import backend_for
    from lightning_sharded.checkpoint.tools import consolidate_checkpoint

    out = consolidate_checkpoint(args.src, args.dst, progress=None if not args.no_progress else False)
    print(
        f"Wrote {out} ({_size(backend_for(out).size(out))}): load it with torch.load, or resume from it with"
        " Lightning."
    )
    return EXIT_OK


def _demo(argv: list[str]) -> int:
    import importlib

    try:
        demo = importlib.import_module("lightning_sharded.demo")
    except ModuleNotFoundError as err:
        if err.name != "lightning_sharded.demo":
            raise
        print(
            "lightning-sharded demo: the demo is not part of this installation yet (no module"
            " lightning_sharded.demo). Update lightning_sharded to a version that ships it.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return int(demo.main(argv) or 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-sharded",
        description="Inspect, verify and consolidate Lightning checkpoints (sharded directories or full"
        " files).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what is done, with timings")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    inspect = commands.add_parser(
        "inspect", help="list the entries of a checkpoint, its size, epoch and step"
    )
    inspect.add_argument(
        "path", metavar="PATH", help="a sharded checkpoint directory or a full checkpoint file"
    )
    inspect.add_argument("--json", action="store_true", help="print JSON for scripts")
    verify = commands.add_parser("verify", help="check every file of a checkpoint (presence, size, checksum)")
    verify.add_argument(
        "path", metavar="PATH", help="a sharded checkpoint directory or a full checkpoint file"
    )
    consolidate = commands.add_parser("consolidate", help="convert a sharded directory into one full file")
    consolidate.add_argument("src", metavar="SRC", help="the sharded checkpoint directory")
    consolidate.add_argument("dst", metavar="DST", help="the full checkpoint file to write")
    consolidate.add_argument("--no-progress", action="store_true", help="no progress bar")
    commands.add_parser("demo", help="train, save and resume a sharded model on CPU (options: demo --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lightning-sharded`` command line.

    Args:
        argv: The arguments, without the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        The exit status: 0 on success, 1 for a missing, invalid or damaged checkpoint, 2 for usage errors.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["demo"]:
        return _demo(args_list[1:])
    parser = _parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from lightning_sharded.checkpoint.errors import CheckpointError

    handler = {"inspect": _inspect, "verify": _verify, "consolidate": _consolidate}[args.command]
    try:
        return handler(args)
    except (CheckpointError, FileNotFoundError) as err:
        print(f"lightning-sharded {args.command}: error: {err}", file=sys.stderr)
        return EXIT_BAD_CHECKPOINT


if __name__ == "__main__":
    sys.exit(main())
