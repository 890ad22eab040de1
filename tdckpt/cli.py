"""The ``tdckpt`` command line: a thin shell over the public functions.

Whatever the input, a command ends with one of these exit codes and never prints a
traceback (unless ``--traceback`` asks for one):

* 0: success (``validate`` / ``verify``: no error found);
* 1: a problem was found or the operation failed: the checkpoint is damaged or is not
  one, a step is missing, a file cannot be read or written, another writer holds the
  root. One ``error: ...`` line on stderr says what, where and what to do;
* 2: bad usage (unknown command or option, a malformed value), or an internal error (a
  bug in tdckpt: the ``error:`` line says so and asks for a rerun with ``--traceback``);
* 130: interrupted (Ctrl-C).

With ``--json`` stdout holds exactly one JSON document: the result, or on failure
``{"error": {"type", "message", "path", "exit_code", "details"}}`` (the ``error:`` line
still goes to stderr). Text output escapes what a terminal must not interpret (control
characters, names that are not valid UTF-8) and never fails on the terminal's encoding.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import re
import stat
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from tdckpt._progress import Bar, isatty
from tdckpt._write.atomic import MAX_STEP
from tdckpt.errors import CheckpointNotFoundError, TdckptError

__all__ = ["EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "main"]

#: Success (``validate`` / ``verify``: nothing wrong).
EXIT_OK = 0
#: A problem found, or the operation failed (one ``error:`` line says which).
EXIT_PROBLEM = 1
#: Bad usage, or an internal error (a bug in tdckpt).
EXIT_USAGE = 2
#: Interrupted by the user (Ctrl-C).
EXIT_INTERRUPTED = 130

_EPILOG = """\
exit codes:
  0    success (validate, verify: no error found)
  1    a problem was found or the operation failed: not a checkpoint, damaged,
       a missing step, a file that cannot be read or written, a held lock
  2    bad usage, or an internal error (a bug in tdckpt: rerun with --traceback
       and report it)
  130  interrupted (Ctrl-C)
Failures print one `error: ...` line on stderr. With --json, stdout holds one JSON
document: the result, or {"error": {"type", "message", "path", "exit_code", "details"}}."""

#: Longest step number accepted on the command line (Python refuses longer int strings).
_MAX_STEP_DIGITS = 4000
_STEP_TEXT = re.compile(r"[0-9]+")  # ASCII digits only: steps name folders


class _UsageError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse, except that a usage error is raised to :func:`main` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


# -- output ------------------------------------------------------------------------------------


def _clean(text: str, *, newlines: bool = False) -> str:
    """``text`` with every character a terminal must not interpret written as an escape.

    Control characters (an ESC from a hostile key name would drive the terminal), lone
    or surrogate-escaped code points (file names that are not valid UTF-8) and other
    non-printable characters become ``\\x1b``, ``\\udce9``, ...; ``newlines`` keeps ``\\n``.
    """
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() or (newlines and ch == "\n") else ascii(ch)[1:-1] for ch in text
    )


def _write(text: str, *, flush: bool = False) -> None:
    """Write to stdout; a failure names stdout (``> /dev/full`` has no file name otherwise)."""
    if sys.stdout is None:  # stdout was closed before Python started: nothing to write to
        return
    try:
        sys.stdout.write(text)
        if flush:
            sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        if exc.filename is None:
            exc.filename = "<standard output>"
        raise


def _out(text: str = "") -> None:
    _write(_clean(text, newlines=True) + "\n")


def _jsonable(data: Any) -> Any:
    """``data`` with what strict JSON cannot hold replaced: NaN and infinities as strings."""
    if isinstance(data, float) and not math.isfinite(data):
        return str(data)
    if isinstance(data, dict):
        return {k if isinstance(k, str) else str(k): _jsonable(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_jsonable(v) for v in data]
    return data


def _print_json(data: Any) -> None:
    # ensure_ascii (the default): any name prints on any terminal and stays valid JSON.
    text = json.dumps(_jsonable(data), indent=2, default=str, allow_nan=False)
    _write(text + "\n")


def _display(path: object) -> str:
    return os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)


@contextlib.contextmanager
def _tolerant_streams() -> Iterator[None]:
    """Write what the terminal's encoding cannot show as escapes, never raising on it.

    ``PYTHONIOENCODING=ascii``, ``LC_ALL=C`` or a name that is not valid UTF-8 would
    otherwise raise UnicodeEncodeError from a print.
    """
    changed: list[tuple[Any, str]] = []
    for stream in (sys.stdout, sys.stderr):
        errors = getattr(stream, "errors", None)
        if errors in ("strict", "surrogateescape") and hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="backslashreplace")
                changed.append((stream, errors))
    try:
        yield
    finally:
        for stream, errors in changed:
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors=errors)


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """Warnings as one ``warning:`` line (not Python's two lines with a source excerpt)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        first, *rest = str(message).splitlines() or [""]
        text = "\n".join([f"warning: {_clean(first)}", *(f"  {_clean(r)}" for r in rest)])
        sys.stderr.write(text + "\n")


# -- errors ------------------------------------------------------------------------------------

_OS_HINTS = {
    errno.EACCES: "run tdckpt as a user who may read it (and, for upgrade and gc, write it "
    "and its folder), or fix its permissions",
    errno.EPERM: "run tdckpt as a user who may change it, or fix its permissions",
    errno.ENOENT: "it does not exist (or vanished while tdckpt read it); check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
    errno.EISDIR: "a folder is where a file was expected; check the path",
    errno.EROFS: "copy the checkpoint somewhere writable first",
    errno.ENOSPC: "free some space, then rerun",
    errno.EDQUOT: "free some space, then rerun",
    errno.ELOOP: "replace the links with the real files, or pass the real path",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.EIO: "the disk or network file system failed; check it, then rerun",
    errno.EBUSY: "it is in use or a mount point; use another path",
    errno.EMFILE: "raise the limit (ulimit -n), then rerun",
}


def _describe(exc: BaseException) -> tuple[int, str, str, str | None, dict[str, Any]]:
    """``(exit code, type, message, path, details)`` for an exception that ended a command."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "KeyboardInterrupt", "interrupted (Ctrl-C).", None, {}
    if isinstance(exc, TdckptError):
        path = exc.facts.get("path", exc.facts.get("root"))
        details = {k: v for k, v in exc.facts.items() if k != "report"}
        to_json = getattr(exc.facts.get("report"), "to_json", None)
        if callable(to_json):
            details["problems"] = to_json().get("problems")
        return (
            EXIT_PROBLEM,
            type(exc).__name__,
            str(exc),
            None if path is None else _display(path),
            details,
        )
    if isinstance(exc, OSError):
        where = ""
        path = None
        if exc.filename is not None:
            path = _display(exc.filename)
            where = f"{path}: "
            if exc.filename2 is not None:
                where = f"{path} -> {_display(exc.filename2)}: "
        reason = exc.strerror or str(exc) or type(exc).__name__
        code = errno.errorcode.get(exc.errno, "") if isinstance(exc.errno, int) else ""
        fallback = "check the path, then rerun (--traceback shows where)"
        hint = _OS_HINTS.get(exc.errno, fallback) if isinstance(exc.errno, int) else fallback
        message = f"{where}{reason}{f' ({code})' if code else ''}; {hint}."
        details = {"errno": code or None}
        return EXIT_PROBLEM, type(exc).__name__, message, path, details
    from tdckpt._version import __version__

    text = (str(exc).splitlines() or [""])[0][:500]
    message = (
        f"internal error in tdckpt {__version__} ({type(exc).__name__}: {text}). This is a "
        "bug: please report it with the output of the same command rerun with --traceback."
    )
    return EXIT_USAGE, "InternalError", message, None, {"exception": type(exc).__name__}


def _print_error(message: str) -> None:
    """One ``error:`` line on stderr (further lines of the message indented below it)."""
    first, *rest = message.splitlines() or [""]
    text = "\n".join([f"error: {_clean(first)}", *(f"  {_clean(r)}" for r in rest)])
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _exit(ok: bool, error: str) -> int:
    """:data:`EXIT_OK`, or the ``error:`` line and :data:`EXIT_PROBLEM`."""
    if ok:
        return EXIT_OK
    _print_error(error)
    return EXIT_PROBLEM


def _verdict(name: str, report: Any) -> str:
    """The last line of a report: ``name: ok`` or its errors, and its warnings."""
    errors = "ok" if report.ok else f"{len(report.errors)} error(s)"
    return f"{name}: {errors}, {len(report.warnings)} warning(s)"


def _print_json_error(
    kind: str, message: str, path: str | None, code: int, details: dict[str, Any]
) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        _print_json(
            {
                "error": {
                    "type": kind,
                    "message": message,
                    "path": path,
                    "exit_code": code,
                    "details": details,
                }
            }
        )
        sys.stdout.flush()


def _stdout_to_devnull() -> None:
    """After a broken pipe: point stdout at /dev/null so the final flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


# -- argument types ----------------------------------------------------------------------------


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


def _first_line(func: Callable[..., Any]) -> str:
    return (func.__doc__ or "").strip().splitlines()[0]


def _progress(label: str, *, unit: str) -> Bar:
    """A tqdm bar on stderr when stdout and stderr are terminals; quiet in pipes and logs.

    Both must be terminals: ``tdckpt verify ROOT --json | jq`` or ``> report.txt`` gets
    clean output and no bar in between.
    """
    return Bar(label, unit=unit, enabled=isatty(sys.stdout) and isatty(sys.stderr))


# -- roots and prefixes ------------------------------------------------------------------------


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


# -- commands ----------------------------------------------------------------------------------


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
        written = ", ".join(f"{k} {_clean(str(v))}" for k, v in sorted(versions.items()))
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


def _parser() -> argparse.ArgumentParser:
    from tdckpt._read.inspect import inspect, validate

    parser = _Parser(
        prog="tdckpt",
        description="Inspect, validate and upgrade TensorDict checkpoints of any tensordict "
        "release; list, verify and clean a root of managed steps.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--traceback", action="store_true", help="show the full traceback on errors"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, help_: str, func: Callable[[argparse.Namespace], int]
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help_,
            description=help_,
            epilog=_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(func=func)
        # Also after the command (`tdckpt ls ROOT --traceback`); SUPPRESS keeps the
        # top-level value when it is not given here.
        p.add_argument(
            "--traceback",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show the full traceback on errors",
        )
        return p

    def add_json(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print JSON (errors too)")
        p.add_argument(
            "--storage-option",
            action="append",
            type=_storage_option_arg,
            metavar="KEY=VALUE",
            help="for an fsspec URL (s3://...): a filesystem option, repeatable; a.b=v nests, "
            "values parse as JSON when they can (anon=true)",
        )

    for func, command in ((inspect, _cmd_inspect), (validate, _cmd_validate)):
        p = add(func.__name__, _first_line(func), command)
        p.add_argument("prefix", type=_path_arg)
        p.add_argument("--robust-key", choices=["auto", "true", "false"], default="auto")
        add_json(p)
    p = add(
        "upgrade",
        "Upgrade a checkpoint on disk to the current format (crash-safe, with a backup).",
        _cmd_upgrade,
    )
    p.add_argument("prefix", type=_path_arg)
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--no-backup", action="store_true", help="delete the old layout after the swap")
    p.add_argument(
        "--convert-pickles",
        action="store_true",
        help="store pickled plain values as JSON (trusted data only: unpickles)",
    )
    add_json(p)
    p = add("ls", "List the committed steps of a checkpoint root.", _cmd_ls)
    p.add_argument("root", type=_path_arg)
    add_json(p)
    p = add(
        "verify", "Recompute every file's checksum of a step against its manifest.", _cmd_verify
    )
    p.add_argument("root", type=_path_arg)
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--step", type=_step_arg, default=None, help="the step (default: the latest)"
    )
    which.add_argument(
        "--all",
        action="store_true",
        help="every committed step, one report each (a file steps share is read once)",
    )
    add_json(p)
    p = add(
        "diff",
        "Compare two checkpoints key by key: exit 0 when equal, 1 when they differ, 2 when "
        "either cannot be read (as diff).",
        _cmd_diff,
    )
    p.add_argument("a", help="the first prefix (with --root: a step number)")
    p.add_argument("b", help="the second prefix (with --root: a step number)")
    p.add_argument(
        "--root", type=_path_arg, default=None, help="compare two steps of this checkpoint root"
    )
    p.add_argument("--robust-key", choices=["auto", "true", "false"], default="auto")
    p.add_argument("--json", action="store_true", help="print JSON (errors too)")
    p = add(
        "export",
        "Export a checkpoint (or a step of a root) as safetensors: one file, or Hugging Face "
        "shards and their index.",
        _cmd_export,
    )
    p.add_argument("source", help="a checkpoint prefix (with --root: a step number)")
    p.add_argument("out", type=_path_arg, help="a .safetensors file name, or a folder")
    p.add_argument("--format", choices=["safetensors"], default="safetensors")
    p.add_argument("--root", type=_path_arg, default=None, help="export a step of this root")
    p.add_argument(
        "--max-shard-size",
        dest="max_shard_bytes",
        type=_size_arg,
        default=None,
        metavar="SIZE",
        help="split into shards of at most SIZE tensor bytes (5GB, 500MiB); OUT is a folder",
    )
    p.add_argument("--overwrite", action="store_true", help="replace existing files")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read a source that holds pickled values (trusted data only; they are skipped)",
    )
    p.add_argument("--json", action="store_true", help="print JSON (errors too)")
    p = add(
        "import",
        "Import safetensors (a file, or a folder with its index) as a tdckpt checkpoint.",
        _cmd_import,
    )
    p.add_argument("source", type=_path_arg, help="a .safetensors file or a folder")
    p.add_argument("prefix", type=_path_arg, help="the checkpoint to write (folder or .tdz)")
    p.add_argument("--flat", action="store_true", help="keep dotted names flat (no nesting)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint")
    p.add_argument("--json", action="store_true", help="print JSON (errors too)")
    p = add("gc", "Remove stale temporary folders left by crashed saves.", _cmd_gc)
    p.add_argument("root", type=_path_arg)
    p.add_argument(
        "--grace-period",
        type=_seconds_arg,
        default=None,
        metavar="SECONDS",
        help="keep leftovers changed less than SECONDS ago (default: URLs 3600, local 0)",
    )
    add_json(p)
    add(
        "demo",
        "Restore a bundled tensordict 0.3.2 checkpoint and run a small training loop.",
        _cmd_demo,
    )
    return parser


def _usage_error(exc: _UsageError, want_json: bool) -> NoReturn:
    message = f"{exc.message} (see `{exc.parser.prog} --help`)"
    if want_json:
        _print_json_error("UsageError", message, None, EXIT_USAGE, {})
    with contextlib.suppress(OSError, ValueError, AttributeError):
        exc.parser.print_usage(sys.stderr)
    _print_error(message)
    raise SystemExit(EXIT_USAGE)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code (``--help`` and usage errors raise SystemExit)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    want_json = "--json" in arguments
    want_traceback = "--traceback" in arguments
    with _tolerant_streams(), warnings.catch_warnings():
        # tdckpt's warnings are part of the output ("it worked, but ..."): one line each.
        warnings.simplefilter("default")
        warnings.showwarning = _show_warning
        try:
            try:
                parser = _parser()
                args = parser.parse_args(arguments)
                _check_storage_args(parser, args)
                _check_diff_args(parser, args)
                _check_export_args(parser, args)
            except _UsageError as exc:
                _usage_error(exc, want_json)
            want_json = bool(getattr(args, "json", False))
            want_traceback = bool(args.traceback)
            code = int(args.func(args))
            _write("", flush=True)  # a closed pipe shows here, not at interpreter exit
            return code
        except (SystemExit, GeneratorExit):
            raise
        except BrokenPipeError:
            if want_traceback:
                raise
            # The reader (e.g. `head`) went away: stdout is gone, report on stderr only.
            _stdout_to_devnull()
            _print_error("the output was closed before tdckpt finished writing it (broken pipe).")
            return EXIT_PROBLEM
        except BaseException as exc:
            if want_traceback or not isinstance(exc, (Exception, KeyboardInterrupt)):
                raise
            code, kind, message, path, details = _describe(exc)
            if want_json:
                _print_json_error(kind, message, path, code, details)
            _print_error(message)
            return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
