"""Crash-test helper for ``tdckpt.save``: a zygote that forks savers which SIGKILL themselves.

Started once per test with ``sys.executable tests/_save_crash_child.py`` (importing torch
takes seconds; each trial then forks a saver in milliseconds). Commands come on stdin, one
per line:

``run <prefix> <stage> <exchange 0|1> <value>``
    fork a saver that runs ``tdckpt.save(make_td(value), prefix, overwrite=True)`` and
    SIGKILLs itself when the save reaches ``stage`` (a name ``tdckpt._write.export`` passes
    to its fault hook, or ``partial``: after the first leaf file is written). With
    exchange 0 the saver acts as on a file system without ``RENAME_EXCHANGE``. Print
    ``exit <wait status>`` when the saver is gone.
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
from tensordict import NonTensorData, TensorDict

import tdckpt
from tdckpt._write import atomic as _atomic
from tdckpt._write import export as _export
from tdckpt._write import writer as _writer


def make_td(value: int) -> Any:
    """A few files in two levels, every byte derived from ``value``."""
    return TensorDict(
        {
            "a": torch.full((4096,), float(value)),
            "b": torch.arange(1024, dtype=torch.int64) + value,
            "nested": TensorDict({"c": torch.full((8, 16), value, dtype=torch.int32)}),
            "s": NonTensorData(f"value {value}"),
        }
    )


def value_of(td: Any) -> int:
    """The ``value`` a loaded checkpoint was made from, checking every leaf agrees."""
    value = int(td["a"][0])
    expected = make_td(value)
    assert torch.equal(td["a"], expected["a"]), "leaf a is not one value's"
    assert torch.equal(td["b"], expected["b"]), "leaf b is not one value's"
    assert torch.equal(td["nested", "c"], expected["nested", "c"]), "leaf c is not one value's"
    assert td["s"] == f"value {value}", "the string is not one value's"
    return value


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def saver(prefix: str, stage: str, exchange: bool, value: int) -> None:
    warnings.simplefilter("ignore")
    if not exchange:
        _atomic._exchange = lambda a, b: False
    if stage == "partial":
        original = _writer.Writer.write_tensor

        def write_one_then_die(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            _die()

        _writer.Writer.write_tensor = write_one_then_die  # type: ignore[method-assign]
    else:
        _export._fault = lambda reached: _die() if reached == stage else None
    tdckpt.save(make_td(value), prefix, overwrite=True)


def main() -> None:
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] == "quit":
            return
        _, prefix, stage, exchange, value = parts
        pid = os.fork()
        if pid == 0:  # the saver
            code = 1
            try:
                saver(prefix, stage, exchange == "1", int(value))
                code = 0  # the stage was never reached
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(f"exit {status}", flush=True)


if __name__ == "__main__":
    main()
