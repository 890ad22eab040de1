"""TorchRL checkpoints (``torchrl.checkpoint``) in ``inspect``, ``validate`` and ``verify``."""

from __future__ import annotations

import argparse

from tdckpt._cli.args import _storage_options
from tdckpt._cli.output import (
    _clean,
    _exit,
    _out,
    _print_json,
    _verdict,
)


def _is_torchrl(args: argparse.Namespace) -> bool:
    """Whether the prefix is a checkpoint written by TorchRL's ``torchrl.checkpoint``."""
    if _storage_options(args) is not None or "://" in args.prefix:
        return False
    from tdckpt._interop.torchrl_checkpoint import is_torchrl_checkpoint

    return is_torchrl_checkpoint(args.prefix)


def _torchrl_report(args: argparse.Namespace, *, inspect: bool) -> int:
    """``inspect`` / ``validate`` of a TorchRL checkpoint: each component, every problem."""
    from tdckpt._interop.torchrl_checkpoint import check_torchrl_checkpoint

    report = check_torchrl_checkpoint(args.prefix)
    if args.json:
        _print_json(report.to_json())
    else:
        versions = report.manifest.get("versions") or {}
        written = (
            ", ".join(f"{_clean(k)} {_clean(str(v))}" for k, v in sorted(versions.items()))
            if isinstance(versions, dict)
            else "versions unreadable"
        )
        _out(f"torchrl checkpoint {_clean(report.path)} ({report.container}; {written})")
        for comp in report.components:
            what = [f"{comp.files} file(s), {comp.bytes} bytes"]
            if comp.tensordicts:
                what.append(f"{len(comp.tensordicts)} tensordict(s), {comp.leaves} leaves")
            if comp.verified:
                what.append("checksums verified")
            if comp.pickles:
                what.append(f"{len(comp.pickles)} pickle(s)")
            _out(f"  {_clean(comp.name)}  {_clean(comp.adapter)}  ({'; '.join(what)})")
        for p in report.problems if not inspect else report.errors:
            _out(str(p))
        _out(_verdict(_clean(report.path), report))
    return _exit(
        report.ok or inspect,
        f"{report.path}: {len(report.errors)} error(s) in the TorchRL checkpoint, listed in "
        "the report on stdout (each names the component and the file).",
    )
