"""Crash-test helper for training-state saves: a zygote forking savers that SIGKILL themselves.

Started once per test with ``sys.executable tests/_state_crash_child.py`` (importing torch
takes seconds; each trial then forks a saver in milliseconds). Commands on stdin:

``run <root> <step> <stage> <value>``
    fork a saver that runs ``CheckpointManager(root).save(step, make_state(value))`` and
    SIGKILLs itself at ``stage``: ``partial`` (after the first leaf file), ``manifest``
    (every leaf written, before the manifest), ``commit`` (staging complete, before the
    rename) or ``committed`` (just after the rename). ``direct`` and ``direct-manifest``
    make every leaf of 4 KiB or more go through the O_DIRECT pipeline in 8 KiB buffers and
    die at the third O_DIRECT write (others in flight) or before the manifest. Print
    ``exit <wait status>``.
``quit``
    exit.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from typing import Any

import torch
from tensordict import TensorDict

import tdckpt
from tdckpt._write import atomic as _atomic
from tdckpt._write import writer as _writer


def make_state(value: int) -> dict[str, Any]:
    """A model, its SGD-with-momentum state, the generators and a TensorDict, all from ``value``."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(value))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.full_like(p, float(value) + 0.5)
    return {
        "model": model,
        "optimizer": optimizer,
        "rng": tdckpt.RandomState(),
        "data": TensorDict(a=torch.full((4096,), value, dtype=torch.int64)),
    }


def value_of(state: dict[str, Any]) -> int:
    """The ``value`` a restored state was made from, checking every tensor agrees."""
    value = int(state["data"]["a"][0])
    assert torch.equal(state["data"]["a"], torch.full((4096,), value, dtype=torch.int64))
    for p in state["model"].parameters():
        assert torch.equal(p, torch.full_like(p, float(value))), "a parameter is not one value's"
        buf = state["optimizer"].state[p]["momentum_buffer"]
        assert torch.equal(buf, torch.full_like(p, float(value) + 0.5)), "momentum differs"
    return value


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def saver(root: str, step: int, stage: str, value: int) -> None:
    warnings.simplefilter("ignore")  # the killed saver's lock is taken over
    if stage.startswith("direct"):
        _writer._DIRECT_MIN = 4096
        _writer._DIRECT_CHUNK = 8192
    if stage == "direct":
        calls = []
        pwrite = _writer.Writer._pwrite_direct

        def pwrite_then_die(self: Any, *args: Any) -> None:
            calls.append(None)
            if len(calls) == 3:
                _die()
            pwrite(self, *args)

        _writer.Writer._pwrite_direct = pwrite_then_die  # type: ignore[method-assign]
    if stage == "partial":
        original = _writer.Writer.write_tensor

        def write_one_then_die(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            _die()

        _writer.Writer.write_tensor = write_one_then_die  # type: ignore[method-assign]
    elif stage in ("manifest", "direct-manifest"):
        _writer.write_small = lambda *a, **k: _die()  # type: ignore[assignment]
    elif stage in ("commit", "committed"):
        rename = _atomic.rename_noreplace

        def rename_and_die(src: Any, dst: Any) -> None:
            if stage == "committed":
                rename(src, dst)
            _die()

        _atomic.rename_noreplace = rename_and_die  # type: ignore[assignment]
    with tdckpt.CheckpointManager(root) as mgr:
        mgr.save(step, make_state(value), metadata={"value": value})


def main() -> None:
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] == "quit":
            return
        _, root, step, stage, value = parts
        pid = os.fork()
        if pid == 0:  # the saver
            code = 1
            try:
                saver(root, int(step), stage, int(value))
                code = 0  # the stage was never reached
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(f"exit {status}", flush=True)


if __name__ == "__main__":
    main()
