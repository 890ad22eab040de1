"""The commands on a root of managed steps: ``ls``, ``verify``, ``gc`` - and ``demo``."""

from __future__ import annotations

import argparse
import json
import os
import stat
from typing import Any

from tdckpt._cli.args import _storage_options
from tdckpt._cli.output import EXIT_OK, _clean, _exit, _jsonable, _out, _print_json, _progress
from tdckpt._cli.torchrl_report import _torchrl_report
from tdckpt.errors import CheckpointNotFoundError


def _check_root(root: str) -> None:
    """Refuse a root that does not exist, is a file, or is a checkpoint itself."""
    try:
        info = os.stat(root)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise CheckpointNotFoundError(
            f"{root}: no such folder. Pass the root folder a CheckpointManager saves its "
            "numbered steps into.",
            path=root,
        ) from exc
    if not stat.S_ISDIR(info.st_mode):
        raise CheckpointNotFoundError(
            f"{root}: is a file, not a checkpoint root (a folder of numbered steps). For a "
            f"single checkpoint use `tdckpt inspect {root}` or `tdckpt validate {root}`.",
            path=root,
        )
    if any(os.path.lexists(os.path.join(root, name)) for name in ("meta.json", "meta.pt")):
        parent = os.path.dirname(os.path.abspath(root))
        raise CheckpointNotFoundError(
            f"{root}: is a checkpoint (it holds meta.json), not a root of numbered steps. Use "
            f"`tdckpt inspect {root}` or `tdckpt validate {root}`, or pass the folder holding "
            f"the steps (perhaps {parent}).",
            path=root,
        )


def _manager(root: str, args: argparse.Namespace) -> Any:
    from tdckpt._remote.urls import is_url
    from tdckpt.manager import CheckpointManager

    if is_url(root):
        return CheckpointManager(root, storage_options=_storage_options(args))
    _check_root(root)
    return CheckpointManager(root)


def _rotation(args: argparse.Namespace) -> Any:
    """The entries of a TorchRL ``CheckpointRotation`` folder given as the root, or None."""
    if _storage_options(args) is not None or "://" in args.root:
        return None
    from tdckpt._interop.torchrl_checkpoint import rotation_entries

    return rotation_entries(args.root)


def _cmd_ls(args: argparse.Namespace) -> int:
    rotation = _rotation(args)
    if rotation is not None:  # TorchRL's CheckpointRotation folder: its checkpoints by step
        if args.json:
            _print_json([entry.to_json() for entry in rotation])
            return EXIT_OK
        _out(f"{'step':>10}  {'format':<9} {'size':>12}  {'created':<32} components / metadata")
        for e in rotation:
            meta = json.dumps(_jsonable(e.metadata), sort_keys=True) if e.metadata else ""
            _out(
                f"{e.step:>10}  {e.container:<9} {e.size:>12}  {_clean(e.created_at or '-'):<32} "
                f"{_clean(','.join(e.components))} {_clean(meta)}".rstrip()
            )
        return EXIT_OK
    mgr = _manager(args.root, args)
    rows = mgr.list_steps()
    shared = mgr.shared_bytes()  # incremental steps: bytes other steps name too
    if args.json:
        out = [row.to_json() for row in rows]
        for row, entry in zip(rows, out, strict=True):
            if row.step in shared and row.status == "committed":
                entry["own_size"] = row.size - shared[row.step]
        _print_json(out)
        return EXIT_OK
    if not rows:
        _out(f"{args.root}: no steps")
        return EXIT_OK
    if any(shared.values()):  # each step's own bytes (what deleting it frees) and its total
        _out(f"{'step':>10}  {'status':<10} {'kind':<7} {'own':>12} {'size':>12}  metadata")
        for row in rows:
            step = "-" if row.step is None else str(row.step)
            committed = row.status == "committed" and row.step is not None
            own = row.size - shared.get(row.step, 0) if committed else 0
            meta = json.dumps(_jsonable(row.metadata), sort_keys=True, default=str)
            _out(
                f"{step:>10}  {row.status:<10} {row.kind:<7} {own:>12} {row.size:>12}  "
                f"{_clean(meta if row.metadata else '')}".rstrip()
            )
        return EXIT_OK
    _out(f"{'step':>10}  {'status':<10} {'kind':<7} {'size':>12}  {'format':<14} metadata")
    for row in rows:
        step = "-" if row.step is None else str(row.step)
        fmt = f"v{row.format_version} {row.key_encoding}" if row.format_version is not None else "-"
        meta = (
            json.dumps(_jsonable(row.metadata), sort_keys=True, default=str) if row.metadata else ""
        )
        _out(f"{step:>10}  {row.status:<10} {row.kind:<7} {row.size:>12}  {fmt:<14} {_clean(meta)}")
    return EXIT_OK


def _verify_all(args: argparse.Namespace) -> int:
    """``verify --all``: every committed step, a file several steps share read once."""
    with _progress("verify", unit="B") as bar:
        reports = _manager(args.root, args).verify_steps(progress=bar)
    if args.json:
        _print_json(
            {
                "ok": all(report.ok for report in reports),
                "steps": [report.to_json() for report in reports],
            }
        )
    else:
        for report in reports:
            _out(report.summary())
        if not reports:
            _out(f"{args.root}: no steps")
    bad = [report for report in reports if not report.ok]
    return _exit(
        not bad,
        f"{args.root}: {len(bad)} of {len(reports)} step(s) differ from what was saved (steps "
        f"{', '.join(str(r.step) for r in bad)}; listed in the report on stdout); restore "
        "another step, or save these again.",
    )


def _cmd_verify(args: argparse.Namespace) -> int:
    rotation = _rotation(args)
    if rotation is not None:  # TorchRL's CheckpointRotation folder: check one checkpoint
        chosen = [e for e in rotation if args.step is None or e.step == args.step]
        if not chosen:
            raise CheckpointNotFoundError(
                f"{args.root}: no TorchRL checkpoint of step {args.step} (steps: "
                f"{', '.join(str(e.step) for e in rotation)}).",
                path=args.root,
            )
        args.prefix = os.fspath(chosen[-1].path)
        return _torchrl_report(args, inspect=False)
    if args.all:
        return _verify_all(args)
    with _progress("verify", unit="B") as bar:
        report = _manager(args.root, args).verify(args.step, progress=bar)
    if args.json:
        _print_json(report.to_json())
    else:
        _out(report.summary())
    return _exit(
        report.ok,
        f"step {report.step} at {report.path}: {len(report.problems)} file(s) differ from what "
        "was saved (listed in the report on stdout); restore another step, or save this one "
        "again.",
    )


def _cmd_gc(args: argparse.Namespace) -> int:
    with _manager(args.root, args) as mgr:
        removed = mgr.gc() if args.grace_period is None else mgr.gc(grace_period=args.grace_period)
    if args.json:
        _print_json([str(p) for p in removed])
    else:
        for p in removed:
            _out(f"removed {p}")
        _out(f"{len(removed)} stale folder(s) removed")
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from tdckpt._demo_run import run_demo

    return _exit(
        run_demo() == EXIT_OK,
        "the demo's resumed weights or its verify did not match what was saved (see above): "
        "this is a bug, please report it.",
    )
