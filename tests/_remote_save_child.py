"""Child process for test_remote_faults: save step 1, then SIGKILL itself during step 2.

argv: url, storage options (JSON), kill mode ("upload:<n>": after n uploads began,
"commit": just before the commit record is created, "timer:<seconds>": at that time).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
from tensordict import TensorDict

from tdckpt import CheckpointManager
from tdckpt._remote import store as _store


def make(seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {f"big{i}": torch.randn(2 << 18, generator=g) for i in range(6)}  # 2 MiB each
        | {f"small{i}": torch.randn(100, generator=g) for i in range(40)},
        batch_size=[],
    )


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    url, options, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    mgr = CheckpointManager(url, storage_options=options, lease_ttl=2.0)  # type: ignore[call-arg]
    mgr.save(1, make(1))
    print("saved 1", flush=True)
    lock = threading.Lock()
    started = [0]
    if mode.startswith("upload:"):
        limit = int(mode.split(":")[1])
        for name in ("put_file", "put_bytes"):
            original = getattr(_store.Store, name)

            def wrapped(self, *a, _o=original, **k):  # type: ignore[no-untyped-def]
                with lock:
                    started[0] += 1
                    n = started[0]
                if n > limit:
                    die()
                return _o(self, *a, **k)

            setattr(_store.Store, name, wrapped)
    elif mode == "commit":
        original_create = _store.Store.create

        def create(self, rel, data):  # type: ignore[no-untyped-def]
            if rel.endswith(".tdckpt.json"):
                die()
            return original_create(self, rel, data)

        _store.Store.create = create  # type: ignore[method-assign]
    elif mode.startswith("timer:"):
        threading.Timer(float(mode.split(":")[1]), die).start()
    start = time.monotonic()
    mgr.save(2, make(2))
    print(f"saved 2 after {time.monotonic() - start:.3f}s", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
