"""The commands on one checkpoint prefix: ``inspect``, ``validate``, ``upgrade``, ``diff``,
``export`` and ``import`` (a TorchRL checkpoint's report: :mod:`tdckpt._cli.torchrl_report`)."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from typing import Any

from tdckpt._cli.args import _robust, _storage_options
from tdckpt._cli.output import (
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    _clean,
    _describe,
    _exit,
    _out,
    _print_error,
    _print_json,
    _print_json_error,
    _progress,
    _verdict,
)
from tdckpt._cli.root import _manager
from tdckpt._cli.torchrl_report import _is_torchrl, _torchrl_report
from tdckpt.errors import CheckpointNotFoundError, TdckptError


def _root_hint(prefix: str) -> str:
    """For a prefix that is really a root of managed steps: how to look at it instead."""
    from tdckpt._write.atomic import parse_step_name

    try:
        with os.scandir(prefix) as scan:
            steps = sorted(
                {parsed[0] for entry in scan if (parsed := parse_step_name(entry.name)) is not None}
            )
    except (OSError, ValueError):
        return ""
    if not steps:
        return ""
    shown = ", ".join(map(str, steps[-5:]))
    return (
        f" It looks like a checkpoint root (steps {shown}): use `tdckpt ls {prefix}`, or pass "
        f"one step's folder, e.g. {os.path.join(prefix, str(steps[-1]))}."
    )


@contextlib.contextmanager
def _prefix_hints(prefix: str) -> Iterator[None]:
    """Add a hint to "not a checkpoint" when the prefix is a root of managed steps."""
    try:
        yield
    except CheckpointNotFoundError as exc:
        hint = _root_hint(prefix)
        if hint:
            exc.message += hint
            exc.args = (exc.message,)
        raise


def _cmd_inspect(args: argparse.Namespace) -> int:
    from tdckpt._read.inspect import inspect
    from tdckpt._shard.inspect import describe_sharded

    sharded = describe_sharded(args.prefix)
    if sharded is not None:
        return _print_sharded(sharded, as_json=args.json)
    if _is_torchrl(args):
        return _torchrl_report(args, inspect=True)
    with _prefix_hints(args.prefix):
        result = inspect(
            args.prefix, robust_key=_robust(args.robust_key), storage_options=_storage_options(args)
        )
    if args.json:
        _print_json(result.to_json())
        return EXIT_OK
    _out(f"checkpoint   {result.prefix} ({result.storage})")
    _out(f"generation   {result.generation} (tensordict format v{result.format_version})")
    _out(f"key encoding {result.key_encoding}")
    _out(f"leaves       {result.leaf_count}, {result.total_bytes} bytes")
    if result.migrations:
        _out(f"migrations   {', '.join(result.migrations)} (applied in memory on read)")
    if result.pickles:
        _out(f"pickles      {', '.join('.'.join(map(_clean, k)) for k in result.pickles)}")
    for lost in result.lost:
        _out(f"lost         {lost}")
    if (result.manifest or {}).get("state"):  # a training state: what each entry was
        from tdckpt._state.describe import describe_state

        for line in describe_state(result.manifest["state"], result.root):  # type: ignore[index]
            _out(line)
    _out("tree")
    _print_tree(result.root, "  ")
    for p in result.problems:
        _out(str(p))
    return EXIT_OK


def _print_sharded(info: dict[str, Any], *, as_json: bool) -> int:
    if as_json:
        _print_json(info)
        return EXIT_OK
    _out(f"sharded step {info['step_folder']} (step {info['step']}, {info['attempt']})")
    _out(f"world size   {info['world_size']}")
    if info.get("layout", "memmap") != "memmap":  # one data file per shard
        _out(f"layout       {info['layout']}")
    _out(f"batch size   {info['batch_size']} ({info['root_type']})")
    _out(f"size         {info['bytes']} bytes")
    _out(f"{'rank':>6}  {'rows':<20} {'files':>6} {'bytes':>12}  prefix")
    for shard in info["shards"]:
        rows = f"{shard['rows'][0]}..{shard['rows'][1]}"
        _out(
            f"{shard['rank']:>6}  {rows:<20} {shard['files']:>6} {shard['bytes']:>12}  "
            f"{_clean(shard['prefix'])}"
        )
    if info["replicated"] is not None:
        keys = ", ".join(".".join(map(_clean, k)) for k in info["replicated"]["keys"])
        _out(f"replicated   {keys} (written once, in {_clean(info['replicated']['prefix'])})")
    _out(f"each shard is a plain prefix: `tdckpt inspect {info['step_folder']}/<prefix>`")
    return EXIT_OK


def _print_tree(info: Any, indent: str) -> None:
    for child in info.children:
        name = _clean(child.key[-1]) if child.key else "<root>"
        if child.kind == "leaf":
            if child.class_name == "nested":
                # The recorded shape is the size table's: [elements, dims per element].
                n, ndim = child.shape or (0, 0)
                what = f"nested ({n} tensors of {ndim} dims)"
            else:
                what = str(child.shape)
            _out(f"{indent}{name}: {child.dtype} {what} ({child.nbytes} B)")
        else:
            extra = f" batch={child.batch_size}" if child.batch_size is not None else ""
            pickled = " [pickled]" if child.pickled else ""
            _out(f"{indent}{name}: {child.kind} {child.class_name or ''}{extra}{pickled}")
            _print_tree(child, indent + "  ")


def _cmd_validate(args: argparse.Namespace) -> int:
    from tdckpt._read.inspect import validate

    if _is_torchrl(args):
        return _torchrl_report(args, inspect=False)
    report = validate(
        args.prefix, robust_key=_robust(args.robust_key), storage_options=_storage_options(args)
    )
    if args.json:
        _print_json(report.to_json())
    else:
        hint = _root_hint(args.prefix) if any(p.code == "not-found" for p in report.errors) else ""
        for p in report.problems:
            _out(str(p) + (hint if p.code == "not-found" else ""))
        _out(_verdict(report.prefix, report))
    return _exit(
        report.ok,
        f"{report.prefix}: cannot be restored: {len(report.errors)} error(s), listed in the "
        "report on stdout (each names the file and what to do).",
    )


def _cmd_upgrade(args: argparse.Namespace) -> int:
    from tdckpt._upgrade.upgrade import upgrade

    with _prefix_hints(args.prefix), _progress("upgrade", unit="op") as bar:
        report = upgrade(
            args.prefix,
            dry_run=args.dry_run,
            backup=not args.no_backup,
            convert_pickles=args.convert_pickles,
            progress=bar,
            storage_options=_storage_options(args),
        )
    if args.json:
        _print_json(report.to_json())
    else:
        _out(str(report))
    # An upgrade with an error raises; this only guards a report that carries one anyway.
    return EXIT_PROBLEM if any(p.severity == "error" for p in report.problems) else EXIT_OK


def _cmd_diff(args: argparse.Namespace) -> int:
    """Exit 0 when equal, 1 when they differ, 2 when either side cannot be read (as diff(1))."""
    from tdckpt._read.diff import diff
    from tdckpt._shard.inspect import describe_sharded

    try:
        if args.root is not None:
            mgr = _manager(args.root, args)
            a, b = str(mgr.path(args.a)), str(mgr.path(args.b))
        else:
            a, b = args.a, args.b
        for prefix in (a, b):
            if describe_sharded(prefix) is not None:
                raise CheckpointNotFoundError(
                    f"{prefix}: a sharded step (one prefix per rank), not one checkpoint. "
                    f"Compare the shards' prefixes (`tdckpt inspect {prefix}` lists them).",
                    path=prefix,
                )
        with _prefix_hints(a), _prefix_hints(b):
            report = diff(a, b, robust_key=_robust(args.robust_key))
    except TdckptError as exc:
        _, kind, message, path, details = _describe(exc)
        if args.json:
            _print_json_error(kind, message, path, EXIT_USAGE, details)
        _print_error(message)
        return EXIT_USAGE
    if args.json:
        _print_json(report.to_json())
    else:
        for entry in report.entries:
            _out(_clean(str(entry)))
        _out(report.summary())
    return EXIT_OK if report.equal else EXIT_PROBLEM


def _cmd_export(args: argparse.Namespace) -> int:
    from tdckpt._interop.safetensors import export_safetensors

    source = args.source
    if args.root is not None:
        source = str(_manager(args.root, args).path(args.source))
    with _prefix_hints(source):
        report = export_safetensors(
            source,
            args.out,
            max_shard_bytes=args.max_shard_bytes,
            overwrite=args.overwrite,
            allow_pickle=args.allow_pickle,
        )
    doc = {
        "files": [str(p) for p in report.files],
        "index": None if report.index is None else str(report.index),
        "tensors": len(report.tensors),
        "tied": report.tied,
        "skipped": report.skipped,
        "bytes": report.total_bytes,
    }
    if args.json:
        _print_json(doc)
        return EXIT_OK
    for path in report.files:
        _out(f"wrote {_clean(str(path))}")
    if report.index is not None:
        _out(f"wrote {_clean(str(report.index))}")
    _out(f"{len(report.tensors)} tensor(s), {report.total_bytes} bytes")
    for alias, name in sorted(report.tied.items()):
        _out(f"tied {_clean(alias)} = {_clean(name)} (written once)")
    for key in report.skipped:
        _out(f"skipped {_clean(key)} (not a tensor: safetensors holds tensors only)")
    return EXIT_OK


def _cmd_import(args: argparse.Namespace) -> int:
    from tdckpt._interop.safetensors import load_safetensors
    from tdckpt._write.export import save

    data = load_safetensors(args.source, nested=not args.flat)
    manifest = save(data, args.prefix, overwrite=args.overwrite)
    count = sum(1 for record in manifest.files if record.key is not None)
    if args.json:
        _print_json({"prefix": args.prefix, "leaves": count})
    else:
        _out(f"saved {_clean(args.prefix)} ({count} {'leaf' if count == 1 else 'leaves'})")
    return EXIT_OK
