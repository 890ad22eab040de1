"""What the command line writes: exit codes, escaped text and JSON on stdout, one
``error:`` / ``warning:`` line on stderr for whatever ended or troubled a command, and the
progress bar (only between terminals)."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from tdckpt._progress import Bar, isatty
from tdckpt.errors import TdckptError

# The exit codes (documented where they are public: tdckpt.cli).
EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


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


def _first_line(func: Callable[..., Any]) -> str:
    return (func.__doc__ or "").strip().splitlines()[0]


def _progress(label: str, *, unit: str) -> Bar:
    """A tqdm bar on stderr when stdout and stderr are terminals; quiet in pipes and logs.

    Both must be terminals: ``tdckpt verify ROOT --json | jq`` or ``> report.txt`` gets
    clean output and no bar in between.
    """
    return Bar(label, unit=unit, enabled=isatty(sys.stdout) and isatty(sys.stderr))
