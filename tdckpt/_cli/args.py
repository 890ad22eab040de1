"""The command line's argument types and cross-argument checks (a malformed value is a
usage error, exit code 2, raised to :func:`tdckpt.cli.main` instead of exiting)."""

from __future__ import annotations

import argparse
import json
import math
import re
from typing import Any, NoReturn

from tdckpt._write.atomic import MAX_STEP

#: Longest step number accepted on the command line (Python refuses longer int strings).
_MAX_STEP_DIGITS = 4000
_STEP_TEXT = re.compile(r"[0-9]+")  # ASCII digits only: steps name folders


class _UsageError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse, except that a usage error is raised to :func:`tdckpt.cli.main` instead of
    exiting."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


def _robust(value: str) -> bool | None:
    return {"auto": None, "true": True, "false": False}[value]


def _step_arg(text: str) -> int:
    if _STEP_TEXT.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(
            f"invalid step {text!r}: a step is a whole number >= 0 written in decimal digits, "
            "e.g. 1000 (`tdckpt ls ROOT` lists them)"
        )
    if len(text) > _MAX_STEP_DIGITS or int(text) > MAX_STEP:
        raise argparse.ArgumentTypeError(
            f"invalid step: {len(text)} digits is too long to name a step folder (the "
            f"largest step is 2**63 - 1, {MAX_STEP})"
        )
    return int(text)


def _path_arg(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError(
            "the path is empty; pass a folder or file name (. for here)"
        )
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"the path {text!r} holds a NUL character")
    return text


def _storage_option_arg(text: str) -> tuple[list[str], Any]:
    """``KEY=VALUE`` (``a.b=v`` nests; the value is JSON when it parses, else a string)."""
    key, sep, value = text.partition("=")
    parts = key.split(".")
    if not sep or not all(p.strip() for p in parts):
        raise argparse.ArgumentTypeError(
            f"invalid storage option {text!r}: expected KEY=VALUE, e.g. anon=true or "
            "client_kwargs.endpoint_url=http://127.0.0.1:9000"
        )
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    return parts, parsed


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    pairs = getattr(args, "storage_option", None)
    if not pairs:
        return None
    options: dict[str, Any] = {}
    for parts, value in pairs:
        where = options
        for part in parts[:-1]:
            nested = where.setdefault(part, {})
            if not isinstance(nested, dict):
                nested = where[part] = {}
            where = nested
        where[parts[-1]] = value
    return options


def _check_storage_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--storage-option only with a URL (it means nothing locally)."""
    from tdckpt._remote.urls import is_url

    target = getattr(args, "prefix", None) or getattr(args, "root", None)
    if target is None or is_url(target):
        return
    for flag, value in (("--storage-option", getattr(args, "storage_option", None)),):
        if value:
            parser.error(f"{flag} is for fsspec URLs (s3://..., memory://...), not {target!r}")


def _check_diff_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``tdckpt diff --root ROOT A B``: A and B are step numbers of a local root."""
    if getattr(args, "command", None) != "diff":
        return
    if args.root is None:
        try:
            args.a, args.b = _path_arg(args.a), _path_arg(args.b)
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
        return
    from tdckpt._remote.urls import is_url

    if is_url(args.root):
        parser.error(f"--root {args.root!r}: diff compares steps of local roots only")
    try:
        args.a, args.b = _step_arg(args.a), _step_arg(args.b)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"with --root, A and B are steps: {exc}")


def _check_export_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``tdckpt export --root ROOT STEP OUT``: STEP is a step number of a local root."""
    if getattr(args, "command", None) != "export" or args.root is None:
        return
    try:
        args.source = _step_arg(args.source)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"with --root, SOURCE is a step: {exc}")


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: a number of seconds >= 0")
    return value


def _size_arg(text: str) -> int:
    match = re.fullmatch(r"([0-9]+)\s*([KMGT]?I?B?)?", text.strip().upper())
    if match is None or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: a number of bytes > 0, optionally with a unit: 500MB, 5GB, "
            "2GiB"
        )
    unit = (match.group(2) or "B").rstrip("B") or ""
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    binary = {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    factor = scale.get(unit) or binary.get(unit)
    if factor is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: unknown unit")
    return int(match.group(1)) * factor
