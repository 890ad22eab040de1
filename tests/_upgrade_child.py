"""Run ``tdckpt.upgrade`` in a child process, for the fault-injection tests of test_upgrade.py.

Usage::

    python _upgrade_child.py PREFIX [--kill-at N] [--sleep S] [--no-exchange] [--no-backup]

Prints ``start`` just before calling ``upgrade``, ``op <done> <total> <what>`` after each
file operation, and ``done`` at the end (all flushed at once).

* ``--kill-at N``: SIGKILL this process right after operation ``N`` (a crash at a chosen
  point of the protocol);
* ``--sleep S``: sleep ``S`` seconds after each operation, so that the parent can kill the
  process at a random instant;
* ``--no-exchange``: pretend the kernel has no ``renameat2(RENAME_EXCHANGE)``, to exercise
  the two-rename fallback of the swap;
* ``--no-backup``: ``upgrade(..., backup=False)``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prefix")
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--no-exchange", action="store_true")
    parser.add_argument("--no-backup", action="store_true")
    args = parser.parse_args()

    # this checkout's tdckpt, not whichever one is installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tdckpt._write.atomic
    from tdckpt._upgrade.upgrade import upgrade

    if args.no_exchange:
        tdckpt._write.atomic._exchange = lambda a, b: False  # type: ignore[assignment]

    def progress(done: int, total: int, what: str) -> None:
        print(f"op {done} {total} {what}", flush=True)
        if done == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.sleep:
            time.sleep(args.sleep)

    print("start", flush=True)
    upgrade(args.prefix, backup=not args.no_backup, progress=progress)
    print("done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
