"""Selective restore of a sharded step on 2 ranks: each rank reads only its selected leaves.

Real processes (tests/_shard_child.py: forkserver children, gloo on 127.0.0.1); the files
each rank opened are its own os.open calls (tests/_fs_access.py: OpenLog).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _fs_access import needs_linux
from _shard_child import LENGTHS, make_case, ok_results, spawn_ranks, step_of

from tdckpt import CheckpointManager
from tdckpt.errors import RestoreError


@needs_linux
def test_two_ranks_restore_a_subset_of_a_sharded_step(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ok_results(spawn_ranks("save", 2, {"out": str(tmp_path / "o1"), "root": str(root)}), "save")
    rank0, rank1 = ok_results(
        spawn_ranks("select", 2, {"out": str(tmp_path / "o2"), "root": str(root)}), "select"
    )
    assert LENGTHS[2] == [4, 9]  # 13 rows: rank 0 restores rows 0..7 (both shards), rank 1 7..13
    leaf = "nested/deeper/d.memmap"
    assert len(rank0["opened"]) == 2 and all(p.endswith(leaf) for p in rank0["opened"])
    assert len(rank1["opened"]) == 1 and rank1["opened"][0].endswith(leaf)
    assert rank1["opened"][0] in rank0["opened"]  # the second shard
    for got in (rank0, rank1):
        assert got["loaded"] == [["nested", "deeper", "d"]]
        assert got["skipped"] == [["a"], ["b"], ["nested", "c"]]
        assert got["replicated_loaded"] == [["cfg", "lr"], ["run"]]
        assert "select nothing: nope" in got["strict"]
        assert got["missing"] == [["nope"]]
        assert got["cast"] == "torch.bfloat16"
        # in place: rank r takes r + 1 rows (rank 0 rows 0..1, rank 1 rows 1..3): shard 0 only
        assert len(got["into_opened"]) == 1 and got["into_opened"][0].endswith("/a.memmap")
        assert got["into_loaded"] == [["a"]]
        # rank 0's target lacked nested.deeper.d: both ranks refused, nothing changed
        assert "strict=True" in got["into_strict"]
        assert (
            "In the checkpoint but not the target: ('nested', 'deeper', 'd')"
            in (got["into_strict"])
        )
    assert rank0["into_strict"].startswith("RestoreError: ")
    assert rank1["into_strict"].startswith("CollectiveError: rank 0 failed restore_into")
    assert rank0["into_unexpected"] == [["nested", "deeper", "d"]]
    assert rank1["into_unexpected"] == []

    # outside a group: the whole global rows, in place; strict=False removes the target's
    # keys within the selection that the step lacks, and keeps everything outside it
    nested = make_case("nested", 13)
    target = make_case("nested", 13).apply(torch.zeros_like)
    target["nested", "old"] = torch.zeros(13, 2)
    target["mine"] = torch.ones(13, 2)
    with CheckpointManager(root) as mgr:
        _, report = mgr.restore_into(
            target, step_of("nested"), keys="nested", strict=False, report=True
        )
        # transforms of a sharded part: rows across both shards, renamed, cast, moved
        got = mgr.restore(
            step_of("nested"),
            rows=slice(2, 6),
            keys=["a", "nested.deeper"],
            rename={"a": "obs"},
            dtype={torch.float32: torch.bfloat16},
            device=torch.device("cpu"),
        )
        assert set(got.keys(True, True)) == {("nested", "deeper", "d"), "obs"}
        assert torch.equal(got["obs"], nested["a"][2:6].bfloat16())
        assert got["nested", "deeper", "d"].dtype == torch.float16  # not in the table
        with pytest.raises(RestoreError, match="onto"):
            mgr.restore(step_of("nested"), keys=["a", "b"], rename={"a": "b"})
    assert report.missing == [("nested", "old")] and report.unexpected == []
    assert sorted(report.loaded) == [("nested", "c"), ("nested", "deeper", "d")]
    assert "old" not in target["nested"].keys()  # noqa: SIM118 (a TensorDict has no 'in')
    assert torch.equal(target["mine"], torch.ones(13, 2))
    assert torch.equal(target["nested", "c"], nested["nested", "c"]) and not target["a"].any()
