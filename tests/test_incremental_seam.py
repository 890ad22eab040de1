"""Incremental saves through the step-store seam (``tdckpt._store``): each store does the
incremental part of its own jobs - the local store gives an ``r+`` restore private copies
in :meth:`open`, the object store's retention keeps what the remaining records name from
the listing it just made - and the one manager only passes ``incremental`` on."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tdckpt import CheckpointManager, KeepLast

pytest.importorskip("fsspec")


def _td(v: float = 0.0) -> TensorDict:
    # leaves of 1.28 MB: objects of their own in object storage (shareable)
    return TensorDict(
        a=torch.arange(320_000, dtype=torch.float32),
        b=torch.full((320_000,), v),
    )


def test_restore_into_a_training_state_with_r_plus_unshares_the_step_first(
    tmp_path: Path,
) -> None:
    """The training-state path of restore_into opens the step for writing too: the files
    it shares with another step get private copies before anything maps them shared."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        one = mgr.save(1, {"model": model})
        two = mgr.save(2, {"model": model})
        weight = sorted((Path(two) / "model").glob("weight*.memmap"))
        assert len(weight) == 1 and os.stat(weight[0]).st_nlink == 2
        fresh = torch.nn.Linear(32, 32)
        mgr.restore_into({"model": fresh}, 1, mode="r+")
        assert torch.equal(fresh.weight, model.weight)
        rel = weight[0].relative_to(two)
        assert os.stat(Path(one) / rel).st_nlink == 1  # step 1 got its own copy
        assert os.stat(weight[0]).st_nlink == 1
        assert mgr.verify(1).ok and mgr.verify(2).ok
        # a restore with mode="r" changes nothing on disk
        mgr.save(3, {"model": model})
        before = os.stat(Path(mgr.path(3)) / rel).st_nlink
        mgr.restore_into({"model": fresh}, 3)
        assert os.stat(Path(mgr.path(3)) / rel).st_nlink == before == 2


def _calls(mgr: CheckpointManager, call: Any) -> int:
    before = mgr.store.calls
    call()
    return int(mgr.store.calls - before)


def test_retention_of_incremental_steps_in_object_storage_lists_the_root_once() -> None:
    """Retention keeps the objects later records name without listing the root again: an
    incremental save costs at most the listing that finds its base, and the listing of the
    base's prefix that checks the objects it refers to, over a full save."""
    full_url = f"memory://t{uuid.uuid4().hex[:12]}/full"
    incr_url = f"memory://t{uuid.uuid4().hex[:12]}/incr"
    with (
        CheckpointManager(full_url, retention=KeepLast(1)) as full,
        CheckpointManager(incr_url, retention=KeepLast(1), incremental=True) as incr,
    ):
        for mgr in (full, incr):
            mgr.save(1, _td(1))
            mgr.save(2, _td(2))  # retention deletes step 1 (its "a" object stays: named)
        full_cost = _calls(full, lambda: full.save(3, _td(3)))
        incr_cost = _calls(incr, lambda: incr.save(3, _td(3)))
        # full: b's and a's uploads; incremental: b's only, + base listing + base check
        assert incr_cost <= full_cost + 1, (incr_cost, full_cost)
        assert incr.steps() == [3]
        assert incr.verify(3).ok
        got = incr.restore(3)
        assert torch.equal(got["a"], _td()["a"]) and torch.equal(got["b"], _td(3)["b"])
        assert incr.shared_bytes() == {3: 0}  # nothing else names step 3's objects now
