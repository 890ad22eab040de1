"""The ``tdckpt`` command line: a thin shell over the public functions.

Exit codes: 0 success, 1 a checkpoint problem (one ``error: ...`` line, or the report),
2 bad usage. ``--traceback`` re-raises instead of printing one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tdckpt.errors import TdckptError

__all__ = ["main"]


def _robust(value: str) -> bool | None:
    return {"auto": None, "true": True, "false": False}[value]


def _first_line(func: Callable[..., Any]) -> str:
    return (func.__doc__ or "").strip().splitlines()[0]


class _Progress:
    """A one-line progress bar (on stderr) when stdout is a terminal; quiet in pipes."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.enabled = sys.stdout.isatty() and sys.stderr.isatty()

    def __call__(self, done: int, total: int, what: str = "") -> None:
        if not self.enabled or total <= 0:
            return
        width = 30
        filled = int(width * done / total)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what[:40]:40}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _cmd_inspect(args: argparse.Namespace) -> int:
    from tdckpt._read.inspect import inspect

    result = inspect(args.prefix, robust_key=_robust(args.robust_key))
    if args.json:
        _print_json(result.to_json())
        return 0
    print(f"checkpoint   {result.prefix} ({result.storage})")
    print(f"generation   {result.generation} (tensordict format v{result.format_version})")
    print(f"key encoding {result.key_encoding}")
    print(f"leaves       {result.leaf_count}, {result.total_bytes} bytes")
    if result.migrations:
        print(f"migrations   {', '.join(result.migrations)} (applied in memory on read)")
    if result.pickles:
        print(f"pickles      {', '.join('.'.join(k) for k in result.pickles)}")
    for lost in result.lost:
        print(f"lost         {lost}")
    print("tree")
    _print_tree(result.root, "  ")
    for p in result.problems:
        print(p)
    return 0


def _print_tree(info: Any, indent: str) -> None:
    for child in info.children:
        name = child.key[-1] if child.key else "<root>"
        if child.kind == "leaf":
            if child.class_name == "nested":
                # The recorded shape is the size table's: [elements, dims per element].
                n, ndim = child.shape or (0, 0)
                what = f"nested ({n} tensors of {ndim} dims)"
            else:
                what = str(child.shape)
            print(f"{indent}{name}: {child.dtype} {what} ({child.nbytes} B)")
        else:
            extra = f" batch={child.batch_size}" if child.batch_size is not None else ""
            pickled = " [pickled]" if child.pickled else ""
            print(f"{indent}{name}: {child.kind} {child.class_name or ''}{extra}{pickled}")
            _print_tree(child, indent + "  ")


def _cmd_validate(args: argparse.Namespace) -> int:
    from tdckpt._read.inspect import validate

    report = validate(args.prefix, robust_key=_robust(args.robust_key))
    if args.json:
        _print_json(report.to_json())
    else:
        for p in report.problems:
            print(p)
        print(f"{report.prefix}: {'ok' if report.ok else f'{len(report.errors)} error(s)'}"
              f", {len(report.warnings)} warning(s)")
    return 0 if report.ok else 1


def _cmd_upgrade(args: argparse.Namespace) -> int:
    from tdckpt._upgrade.upgrade import upgrade

    report = upgrade(
        args.prefix,
        dry_run=args.dry_run,
        backup=not args.no_backup,
        convert_pickles=args.convert_pickles,
        progress=_Progress("upgrade"),
    )
    if args.json:
        _print_json(report.to_json())
        return 0
    print(str(report))
    return 0


def _manager(root: str) -> Any:
    from tdckpt.manager import CheckpointManager

    return CheckpointManager(root)


def _cmd_ls(args: argparse.Namespace) -> int:
    rows = _manager(args.root).list_steps()
    if args.json:
        _print_json([row.to_json() for row in rows])
        return 0
    if not rows:
        print(f"{args.root}: no steps")
        return 0
    print(f"{'step':>10}  {'status':<10} {'kind':<7} {'size':>12}  {'format':<14} metadata")
    for row in rows:
        step = "-" if row.step is None else str(row.step)
        fmt = f"v{row.format_version} {row.key_encoding}" if row.format_version is not None else "-"
        meta = json.dumps(row.metadata, sort_keys=True) if row.metadata else ""
        print(f"{step:>10}  {row.status:<10} {row.kind:<7} {row.size:>12}  {fmt:<14} {meta}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    report = _manager(args.root).verify(args.step, progress=_Progress("verify"))
    if args.json:
        _print_json(report.to_json())
    else:
        print(report.summary())
    return 0 if report.ok else 1


def _cmd_gc(args: argparse.Namespace) -> int:
    with _manager(args.root) as mgr:
        removed = mgr.gc()
    if args.json:
        _print_json([str(p) for p in removed])
    else:
        for p in removed:
            print(f"removed {p}")
        print(f"{len(removed)} stale folder(s) removed")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from tdckpt._demo_run import run_demo

    return run_demo()


def _parser() -> argparse.ArgumentParser:
    from tdckpt._read.inspect import inspect, validate

    parser = argparse.ArgumentParser(
        prog="tdckpt",
        description="Inspect, validate and upgrade TensorDict checkpoints of any tensordict "
        "release; list, verify and clean a root of managed steps.",
    )
    parser.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    p = add("inspect", _first_line(inspect), _cmd_inspect)
    p.add_argument("prefix")
    p.add_argument("--robust-key", choices=["auto", "true", "false"], default="auto")
    p.add_argument("--json", action="store_true")
    p = add("validate", _first_line(validate), _cmd_validate)
    p.add_argument("prefix")
    p.add_argument("--robust-key", choices=["auto", "true", "false"], default="auto")
    p.add_argument("--json", action="store_true")
    p = add("upgrade", "Upgrade a checkpoint on disk to the current format (crash-safe, with a backup).", _cmd_upgrade)
    p.add_argument("prefix")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--no-backup", action="store_true", help="delete the old layout after the swap")
    p.add_argument("--convert-pickles", action="store_true", help="store pickled plain values as JSON (trusted data only: unpickles)")
    p.add_argument("--json", action="store_true")
    p = add("ls", "List the committed steps of a checkpoint root.", _cmd_ls)
    p.add_argument("root")
    p.add_argument("--json", action="store_true")
    p = add("verify", "Recompute every file's checksum of a step against its manifest.", _cmd_verify)
    p.add_argument("root")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p = add("gc", "Remove stale temporary folders left by crashed saves.", _cmd_gc)
    p.add_argument("root")
    p.add_argument("--json", action="store_true")
    add("demo", "Restore a bundled tensordict 0.3.2 checkpoint and run a small training loop.", _cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except TdckptError as exc:
        if args.traceback:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
