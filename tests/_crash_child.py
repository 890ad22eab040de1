"""Crash-test helper: a zygote that forks writer processes for the test to SIGKILL.

Started once per test with ``sys.executable tests/_crash_child.py`` (importing torch and
tensordict takes seconds; each trial then forks a writer in milliseconds). Commands come on
stdin, one per line:

``run <root> <archive 0|1> <log>``
    fork a writer and print ``pid <pid>``; the writer saves steps latest+1, latest+2, ...
    into ``<root>`` forever (KeepLast(3) retention, an overwrite of the step just saved
    every third step) and appends ``<step>\\n`` to ``<log>`` after each save returns.
    When the writer dies (the test kills it), print ``exit <wait status>``.
``quit``
    exit.

The content of a step depends only on the step number (:func:`make_td`), so the test can
check every listed step's content after any kill.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from tensordict import NonTensorData, TensorDict

from tdckpt.manager import CheckpointManager
from tdckpt.retention import KeepLast


def make_td(step: int) -> Any:
    """A few MiB in several files and levels, all derived from ``step``."""
    return TensorDict(
        {
            "a": torch.full((256 * 1024,), float(step)),
            "b": torch.arange(128 * 1024, dtype=torch.int64) + step,
            "nested": TensorDict(
                {"c": torch.full((64, 1024), step, dtype=torch.int32), "z": torch.zeros(0)}
            ),
            "s": NonTensorData(f"step {step}"),
        }
    )


def writer(root: str, archive: bool, log: str) -> None:
    warnings.simplefilter("ignore")  # lock takeovers from the previous (killed) writer
    mgr = CheckpointManager(root, retention=KeepLast(3), archive=archive)
    step = (mgr.latest_step() or 0) + 1
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while True:
        mgr.save(step, make_td(step), metadata={"step": step})
        if step % 3 == 0:
            mgr.save(step, make_td(step), metadata={"step": step}, overwrite=True)
        os.write(fd, f"{step}\n".encode())
        step += 1


def main() -> None:
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] == "quit":
            return
        _, root, archive, log = parts
        pid = os.fork()
        if pid == 0:  # the writer
            try:
                writer(root, archive == "1", log)
            finally:
                os._exit(1)  # never return into the zygote's loop
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {status}", flush=True)


if __name__ == "__main__":
    main()
