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
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import NoReturn

from tdckpt._cli import output
from tdckpt._cli.args import (
    _check_diff_args,
    _check_export_args,
    _check_storage_args,
    _Parser,
    _path_arg,
    _seconds_arg,
    _size_arg,
    _step_arg,
    _storage_option_arg,
    _UsageError,
)
from tdckpt._cli.output import (
    _describe,
    _first_line,
    _print_error,
    _print_json_error,
    _show_warning,
    _stdout_to_devnull,
    _tolerant_streams,
    _write,
)
from tdckpt._cli.prefix import (
    _cmd_diff,
    _cmd_export,
    _cmd_import,
    _cmd_inspect,
    _cmd_upgrade,
    _cmd_validate,
)
from tdckpt._cli.root import _cmd_demo, _cmd_gc, _cmd_ls, _cmd_verify

__all__ = ["EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "main"]

#: Success (``validate`` / ``verify``: nothing wrong).
EXIT_OK = output.EXIT_OK
#: A problem found, or the operation failed (one ``error:`` line says which).
EXIT_PROBLEM = output.EXIT_PROBLEM
#: Bad usage, or an internal error (a bug in tdckpt).
EXIT_USAGE = output.EXIT_USAGE
#: Interrupted by the user (Ctrl-C).
EXIT_INTERRUPTED = output.EXIT_INTERRUPTED

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
