"""A rank killed (os._exit(9), as SIGKILL leaves it) at each phase of a sharded save.

Every surviving rank raises a TdckptError within 30 s, the previous step restores
bit-exactly, no uncommitted step is listed, and gc removes what the save left; a re-save
(overwrite) killed half-way leaves the old step or the new one, whole. The kill is armed
through TDCKPT_TEST_FAULT, read only by the test helper (tests/_shard_child.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _shard_child import LENGTHS, make_case, spawn_ranks
from _shard_compare import assert_same

from tdckpt import CheckpointManager
from tdckpt.warnings import TdckptWarning

WORLD = 3
#: Seconds each collective waits in these runs (survivors must raise within 30 s).
TIMEOUT = 12
#: phase -> the ranks where it can fire (after_records / after_commit run on rank 0 only).
PHASES = {
    "before_write": (0, 1, 2),
    "mid_leaf": (1, 2, 0),
    "before_gather": (2, 0, 1),
    "after_records": (0,),
    "after_commit": (0,),
}


def _check_outcome(results: list[dict[str, Any] | None], killed: int, what: str) -> None:
    assert results[killed] is None, f"{what}: the killed rank {killed} reported {results[killed]}"
    for rank, res in enumerate(results):
        if rank == killed:
            continue
        assert res is not None and "ok" in res, f"{what}: rank {rank}: {res}"
        out = res["ok"]
        assert out["raised"] is not None, f"{what}: rank {rank} returned without an error"
        assert out["tdckpt"], f"{what}: rank {rank} raised {out['raised']}: {out['message']}"
        assert out["seconds"] < 30, f"{what}: rank {rank} took {out['seconds']:.1f} s"


def _check_root(root: Path, *, committed: list[int], step1: str, killed: int) -> None:
    mgr = CheckpointManager(root)
    assert mgr.steps() == committed
    want = make_case(step1, sum(LENGTHS[WORLD]))
    assert_same(mgr.restore(1), want, "step 1 after the fault")
    for step in committed:
        assert mgr.verify(step).ok, mgr.verify(step).summary()
    if 2 in committed:
        assert_same(mgr.restore(2), make_case("nested", sum(LENGTHS[WORLD]))[:, :1], "step 2")
    statuses = mgr.list_steps()
    assert all(s.status in ("committed", "incomplete") for s in statuses), statuses
    assert sorted(s.step for s in statuses if s.status == "committed") == committed
    if killed == 0:  # the dead rank 0 held the writer lock
        with pytest.warns(TdckptWarning, match="took over the lock") as caught:
            mgr.gc()
        assert caught[0].filename == __file__
    else:
        mgr.gc()
    assert [s.status for s in mgr.list_steps()] == ["committed"] * len(committed)
    left = sorted(os.listdir(root))
    assert left == sorted([".tdckpt.lock", *map(str, committed)]), left
    mgr.close()


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_a_rank_killed_mid_save(phase: str, tmp_path: Path, fault_trials: int) -> None:
    ranks = PHASES[phase]
    for trial in range(fault_trials):
        killed = ranks[trial % len(ranks)]
        root = tmp_path / f"t{trial}"
        args = {"out": str(tmp_path / f"o{trial}"), "root": str(root), "timeout": TIMEOUT}
        args["fault"] = f"{killed}:{phase}"
        results = spawn_ranks("fault", WORLD, args, timeout=90)
        what = f"{phase}, rank {killed} killed (trial {trial})"
        _check_outcome(results, killed, what)
        # after the commit the step is durable even though no rank heard the outcome
        _check_root(
            root,
            committed=[1, 2] if phase == "after_commit" else [1],
            step1="nested",
            killed=killed,
        )


@pytest.mark.parametrize(
    ("phase", "killed"), [("mid_leaf", 1), ("after_records", 0), ("after_commit", 0)]
)
def test_an_overwrite_killed_half_way_leaves_old_or_new(
    phase: str, killed: int, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    args = {"out": str(tmp_path / "o"), "root": str(root), "timeout": TIMEOUT}
    args.update(fault=f"{killed}:{phase}", overwrite=True)
    results = spawn_ranks("fault", WORLD, args, timeout=90)
    _check_outcome(results, killed, f"overwrite, {phase}")
    # before the commit: the old step, whole; after it: the new one, whole
    _check_root(
        root,
        committed=[1],
        step1="tensorclass" if phase == "after_commit" else "nested",
        killed=killed,
    )


def test_a_rank_with_bad_input_makes_every_rank_raise(tmp_path: Path) -> None:
    root = tmp_path / "root"
    results = spawn_ranks(
        "mismatch", WORLD, {"out": str(tmp_path / "o"), "root": str(root), "timeout": TIMEOUT}
    )
    for rank, res in enumerate(results):
        assert res is not None and "ok" in res, res
        out = res["ok"]
        kind, message = out["mismatch"]
        assert kind in ("CoverageError", "CollectiveError"), (rank, kind, message)
        assert (
            "('nested', 'c')" in message or "'nested.c' is on rank 0 but not on rank 1" in message
        ), message
        assert out["exists"][0] in ("CheckpointExistsError", "CollectiveError"), out["exists"]
        assert "already exists" in out["exists"][1]
        assert out["steps"] == [1]
    mgr = CheckpointManager(root)
    assert mgr.steps() == [1]
    mgr.gc()
    assert [s.status for s in mgr.list_steps()] == ["committed"]
