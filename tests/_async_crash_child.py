"""Crash-test helper for ``CheckpointManager.save_async``: a zygote forking savers that die.

Started once per test with ``sys.executable tests/_async_crash_child.py`` (importing torch
takes seconds; each trial then forks a saver in milliseconds). Commands come on stdin, one
per line:

``run <root> <step> leaf <k>``
    fork a saver that opens a manager on ``root`` and calls ``save_async(step,
    make_state(step))``; its background thread SIGKILLs the process just before writing
    leaf file number ``k`` (0-based), while the main thread keeps changing the state.
``run <root> <step> timer <ms>``
    the same, but a timer SIGKILLs the process ``ms`` milliseconds after ``save_async``
    returned, whatever the background thread is doing then (writing, fsyncing, committing,
    applying retention - or done).

Print ``exit <wait status>`` when the saver is gone. ``quit`` exits.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
from typing import Any

import torch
from tensordict import NonTensorData, TensorDict

from tdckpt._write import snapshot as _snapshot
from tdckpt.manager import CheckpointManager
from tdckpt.retention import KeepLast

#: Leaf files of make_state's checkpoint (a, b, nested/c).
LEAVES = 3


def make_state(value: int) -> Any:
    """A few leaf files in two levels (about 3 MiB), every byte derived from ``value``."""
    return TensorDict(
        {
            "a": torch.full((512 * 1024,), float(value)),
            "b": torch.arange(128 * 1024, dtype=torch.int64) + value,
            "nested": TensorDict({"c": torch.full((256, 256), value, dtype=torch.int32)}),
            "s": NonTensorData(f"value {value}"),
        }
    )


def value_of(td: Any) -> int:
    """The ``value`` a loaded checkpoint was made from, checking that every leaf agrees."""
    value = int(td["a"][0])
    expected = make_state(value)
    assert torch.equal(td["a"], expected["a"]), "leaf a is not one value's"
    assert torch.equal(td["b"], expected["b"]), "leaf b is not one value's"
    assert torch.equal(td["nested", "c"], expected["nested", "c"]), "leaf c is not one value's"
    assert td["s"] == f"value {value}", "the string is not one value's"
    return value


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def saver(root: str, step: int, mode: str, arg: int) -> None:
    warnings.simplefilter("ignore")
    if mode == "leaf":
        seen = [0]

        def hook(rel: str) -> None:
            if seen[0] == arg:
                _die()
            seen[0] += 1

        _snapshot._between_leaves = hook
    mgr = CheckpointManager(root, retention=KeepLast(1))
    state = make_state(step)
    future = mgr.save_async(step, state)
    if mode == "timer":
        threading.Timer(arg / 1000, _die).start()
    for _ in range(50):  # training goes on: none of this may reach the checkpoint
        state["a"].add_(1)
        state["nested", "c"].mul_(3)
    future.result()
    if mode == "timer":
        threading.Event().wait(10)  # the timer kills the process (the lock still held)
    mgr.close()


def main() -> None:
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] == "quit":
            return
        _, root, step, mode, arg = parts
        pid = os.fork()
        if pid == 0:  # the saver
            code = 1
            try:
                saver(root, int(step), mode, int(arg))
                code = 0  # never killed
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(f"exit {status}", flush=True)


if __name__ == "__main__":
    main()
