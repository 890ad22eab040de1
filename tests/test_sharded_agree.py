"""Ranks agree on the operation and the step before anything is written or restored.

Two real ranks (gloo on 127.0.0.1, tests/_shard_child.py): rank 0 ``save(5)`` while rank 1
``save(6)``; ranks restoring different steps; one rank restoring while the other saves; a
bad step on one rank; one rank whose target has other keys. Every rank raises (the same
error where they disagree), nothing is written, no target is touched, and the group works
afterwards. ``close()`` frees the gloo group the manager made, never one the user passed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _shard_child import ok_results, spawn_ranks

from tdckpt import CheckpointManager

WORLD = 2


def _results(command: str, tmp_path: Path) -> list[dict[str, Any]]:
    args = {"out": str(tmp_path / "o"), "root": str(tmp_path / "root"), "timeout": 30}
    return ok_results(spawn_ranks(command, WORLD, args, timeout=120), command)


def _same_error(results: list[dict[str, Any]], what: str, *needles: str) -> str:
    kinds = {tuple(r[what]) for r in results}
    assert len(kinds) == 1, f"{what}: the ranks raised different errors: {kinds}"
    kind, message = kinds.pop()
    assert kind == "CollectiveError", (what, kind, message)
    for needle in needles:
        assert needle in message, (what, message)
    return message


def test_ranks_that_disagree_all_raise_and_nothing_is_touched(tmp_path: Path) -> None:
    results = _results("disagree", tmp_path)
    # before: both returned; rank 1 got a path that does not exist, step 5 held both shards
    msg = _same_error(results, "save", "rank 0: save(step=5), rank 1: save(step=6)")
    assert "nothing was written or restored" in msg
    assert all(r["root_after_save"] is None for r in results), results  # not even the lock
    # a bad step on one rank: the same refusal on both, at once
    _same_error(results, "bad_step", "rank 0: save(step=7), rank 1: save(step=-1)")
    # before: rank 0's target was overwritten before rank 1 raised
    _same_error(results, "restore_into", "restore_into(step=1), rank 1: restore_into(step=2)")
    _same_error(results, "restore", "rank 0: restore(step=1), rank 1: restore(step=2)")
    _same_error(results, "mixed", "rank 0: restore(step=1), rank 1: save(step=3)")
    # one rank refuses: its own error there, a CollectiveError naming it elsewhere
    assert results[1]["one_refuses"][0] == "RestoreError"
    assert "('nested', 'c')" in results[1]["one_refuses"][1]
    assert results[0]["one_refuses"][0] == "CollectiveError"
    assert "rank 1 failed restore_into of step 1" in results[0]["one_refuses"][1]
    assert all(r["steps"] == [1, 2] and r["tmp"] == [] for r in results), results
    assert CheckpointManager(tmp_path / "root").steps() == [1, 2]


def test_close_frees_the_managers_own_group_only(tmp_path: Path) -> None:
    results = _results("close", tmp_path)
    for rank, out in enumerate(results):
        # before: every manager left its gloo group behind
        assert out["after"] == out["before"], (rank, out)
        assert out["given_kept"] and out["given_works"], (rank, out)
        assert out["with_freed"], (rank, out)
        # arguments a collective manager refuses are refused before it makes a group
        assert [kind for kind, _ in out["refused"]] == ["ValueError", "ValueError"], out
        assert "archive=False" in out["refused"][0][1], out
        assert "incremental" in out["refused"][1][1], out
        assert out["refused_groups"] == 0, (rank, out)
        for what in ("after_close", "restore_after_close"):
            kind, message = out[what]
            assert kind == "CollectiveError", (rank, what, out[what])
            assert "close() freed" in message
