"""Run a test body as an unprivileged user (uid/gid 65534) in a forked child.

Root opens read-only files for writing and writes into read-only directories, so permission
checks are only meaningful for another user. The child is a fork of this interpreter (no new
Python to start); it sends back what the function returned, and an exception it raised is
re-raised here as an AssertionError naming it.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable

import tdckpt._read.directory as storage_module


def run_unprivileged(func: Callable[[], object]) -> object:
    """``func()`` as uid 65534 when running as root (as is, otherwise)."""
    if os.geteuid() != 0:
        return func()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        code = 0
        try:
            os.close(read_fd)
            os.setgid(65534)
            os.setuid(65534)
            storage_module._effective_uid.cache_clear()  # asked once per process: ask again
            try:
                outcome: tuple[str, object] = ("ok", func())
            except BaseException as exc:
                outcome = ("raised", (type(exc).__name__, str(exc)))
            with os.fdopen(write_fd, "wb") as fh:
                pickle.dump(outcome, fh)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the unprivileged child failed"
    kind, value = pickle.loads(data)
    if kind == "raised":
        name, message = value
        raise AssertionError(f"unprivileged child raised {name}: {message}")
    return value
