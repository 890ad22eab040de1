"""Crash-test helper for incremental saves: a zygote that forks savers which SIGKILL themselves.

Started once per test with ``sys.executable tests/_incremental_crash_child.py`` (importing
torch takes seconds; each trial then forks a saver in milliseconds). Commands come on stdin,
one per line:

``run <root> <stage>``
    fork a saver that, with ``CheckpointManager(root, incremental=True,
    retention=KeepLast(2))``, saves steps 1 and 2 (:func:`make_td`), then arms a fault at
    ``stage`` and saves step 3 (or overwrites step 2, for the ``overwrite-*`` stages), and
    SIGKILLs itself when the save reaches ``stage``. Print ``exit <wait status>`` when the
    saver is gone.
``quit``
    exit.

Stages: ``share`` / ``shared`` (before / after a leaf is linked from the base: the hook of
:mod:`tdckpt._write.incremental`), ``written`` (after the first leaf of the save, linked or
written), ``manifest`` (before the manifest), ``committing`` (manifest written, before the
rename), ``committed`` (after the rename, before retention), ``retired`` (retention renamed
the base step aside, before deleting it), ``removed`` (after retention deleted it),
``overwrite-swapped`` (an overwrite of step 2 swapped the folders, the old one not deleted).
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from typing import Any

import torch
from tensordict import TensorDict

from tdckpt._write import atomic as _atomic
from tdckpt._write import incremental as _incremental
from tdckpt._write import save as _save
from tdckpt._write import writer as _writer
from tdckpt.manager import CheckpointManager
from tdckpt.retention import KeepLast

STAGES = (
    "share",
    "shared",
    "written",
    "manifest",
    "committing",
    "committed",
    "retired",
    "removed",
    "overwrite-swapped",
)


def make_td(step: int) -> Any:
    """Eight leaves; leaf ``l<k>`` changes at step k only (its bytes: ``k`` and the step)."""
    return TensorDict(
        {
            f"l{k}": torch.full((4096,), float(k * 1000 + (step if step >= k else 0)))
            for k in range(8)
        }
        | {"nested": TensorDict(ids=torch.arange(512, dtype=torch.int64))}
    )


def _die(*_: Any, **__: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _after(module: Any, name: str) -> None:
    original = getattr(module, name)

    def run_then_die(*args: Any, **kwargs: Any) -> Any:
        original(*args, **kwargs)
        _die()

    setattr(module, name, run_then_die)


def _arm(stage: str) -> None:
    if stage in ("share", "shared"):
        _incremental._fault = lambda reached: _die() if reached == stage else None
    elif stage == "written":
        _after(_writer.Writer, "write_tensor")
    elif stage == "manifest":
        _save.write_manifest_last = _die  # type: ignore[assignment]
    elif stage == "committing":
        _atomic.rename_noreplace = _die  # type: ignore[assignment]
    elif stage == "committed":
        _after(_atomic, "rename_noreplace")
    elif stage == "retired":
        _atomic.remove_retired = _die  # type: ignore[assignment]
    elif stage == "removed":
        _after(_atomic, "remove_retired")
    elif stage == "overwrite-swapped":
        original = _atomic._exchange

        def exchange_then_die(a: Any, b: Any) -> bool:
            original(a, b)  # without RENAME_EXCHANGE: nothing swapped yet, killed anyway
            _die()
            return False

        _atomic._exchange = exchange_then_die
    else:
        raise ValueError(stage)


def saver(root: str, stage: str) -> None:
    warnings.simplefilter("ignore")
    mgr = CheckpointManager(root, incremental=True, retention=KeepLast(2), fsync=True)
    mgr.save(1, make_td(1))
    mgr.save(2, make_td(2))
    _arm(stage)
    if stage.startswith("overwrite-"):
        td = make_td(2)
        td["l0"] += 0.5  # a changed leaf in the overwrite
        mgr.save(2, td, overwrite=True)
    else:
        mgr.save(3, make_td(3))
    os._exit(3)  # the fault was never reached


def main() -> None:
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] == "quit":
            return
        _, root, stage = parts
        pid = os.fork()
        if pid == 0:
            try:
                saver(root, stage)
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        print(f"exit {status}", flush=True)


if __name__ == "__main__":
    main()
