"""Child process for test_incremental_remote: incremental saves to an S3 root (moto), the
second one SIGKILLed at a stage.

argv: url, storage options (JSON), stage: ``upload`` (before the first upload of step 2),
``commit`` (just before step 2's commit record is created), ``record`` (step 2 committed;
retention is about to delete step 1's record), ``data`` (step 1's record deleted; its
attempt's data not yet).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import torch
from tensordict import TensorDict

from tdckpt import CheckpointManager, KeepLast
from tdckpt._remote import store as _store
from tdckpt._remote.layout import LEASE_DIR


def make(step: int) -> TensorDict:
    """Six 2 MiB leaves (objects of their own) and small ones; ``big5`` changes per step."""
    g = torch.Generator().manual_seed(0)
    td = TensorDict(
        {f"big{i}": torch.randn(2 << 18, generator=g) for i in range(6)}
        | {f"small{i}": torch.randn(100, generator=g) for i in range(10)},
        batch_size=[],
    )
    td["big5"] += step
    return td


def die(*_: Any, **__: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    url, options, stage = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    mgr = CheckpointManager(
        url, storage_options=options, lease_ttl=2.0, incremental=True, retention=KeepLast(1)
    )
    mgr.save(1, make(1))
    print("saved 1", flush=True)
    if stage == "upload":
        for name in ("put_file", "put_bytes", "put_parts"):
            if hasattr(_store.Store, name):
                setattr(_store.Store, name, die)
    elif stage == "commit":
        _store.Store.create = die  # type: ignore[method-assign]
    elif stage in ("record", "data"):
        original = _store.Store.rm_files

        def rm_files(self: Any, rels: Any) -> None:
            rels = list(rels)
            # A lease renewal removes its old generation: not a stage of the save (on a
            # loaded machine the save outlives half the 2 s ttl and renews).
            lease = all(r.startswith(f"{LEASE_DIR}/") for r in rels)
            if not lease and (
                stage == "record" or not any(r.endswith(".tdckpt.json") for r in rels)
            ):
                die()
            original(self, rels)

        _store.Store.rm_files = rm_files  # type: ignore[method-assign]
        _store.Store.rm_tree = die  # type: ignore[method-assign]
    mgr.save(2, make(2))
    print("saved 2", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
