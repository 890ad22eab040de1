"""A training script that ends right after ``save_async``, without ``close()``.

``python tests/_exit_save_child.py ROOT STEP MODE``: opens a manager on ROOT (never closed),
calls ``save_async(STEP, make_state(STEP))`` with a background writer slowed down (0.2 s
before each leaf file), prints whether that save was still in flight, and ends:

``end``
    by falling off the end of the script;
``exit``
    by ``sys.exit(0)``;
``fail``
    by falling off the end, while the background writer fails (OSError) at its second leaf.
"""

from __future__ import annotations

import errno
import sys
import time

from _async_crash_child import make_state

from tdckpt._write import snapshot as _snapshot
from tdckpt.manager import CheckpointManager


def main() -> None:
    root, step, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    seen = [0]

    def slow(rel: str) -> None:
        seen[0] += 1
        if mode == "fail" and seen[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", rel)
        time.sleep(0.2)

    _snapshot._between_leaves = slow
    mgr = CheckpointManager(root)
    future = mgr.save_async(step, make_state(step))
    print(f"in flight: {not future.done()}", flush=True)
    if mode == "exit":
        sys.exit(0)


if __name__ == "__main__":
    main()
