"""A collective restore shares the shard check out among the ranks.

Alone, a reader checks every shard of a sharded step against the step manifest (rows,
keys, dtypes, shapes; tests/test_sharded_checks.py). In a group, rank ``r`` checks the
shards it reads and every shard ``i`` with ``i % world == r``: every shard is checked by
some rank, each shard's metadata is read about once per group rather than once per rank,
and the ranks compare what their shards hold in the all_gather that closes the restore.
Two real gloo ranks (tests/_shard_child.py, commands in tests/_split_check_child.py)
restore steps written in the test process (tests/_shard_local.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _shard_child import ok_results, spawn_ranks
from _shard_local import write_sharded
from tensordict import TensorDict

from tdckpt._shard.check import SplitCheck

WORLD = 2


def _rows(start: int, stop: int, dtype: torch.dtype = torch.float32) -> TensorDict:
    return TensorDict(x=torch.arange(start, stop, dtype=dtype), batch_size=[stop - start])


def _restore(root: Path, out: Path, rows: list[int]) -> list[dict[str, Any]]:
    args = {"out": str(out), "root": str(root), "rows": rows}
    return ok_results(spawn_ranks("_split_check_child:cmd_restore", WORLD, args), "restore")


def test_a_rank_checks_the_shards_it_reads_and_its_share_only(tmp_path: Path) -> None:
    write_sharded(tmp_path / "root", 1, [_rows(2 * i, 2 * i + 2) for i in range(4)])
    results = _restore(tmp_path / "root", tmp_path / "o", [4, 4])
    for rank, res in enumerate(results):
        mine = list(range(4 * rank, 4 * rank + 4))
        assert res["restore"] == ["returned", [float(v) for v in mine]], res
        assert res["restore_into"] == ["returned", [float(v) for v in mine]], res
    # rank 0 reads shards 0 and 1 and checks shard 2 too; rank 1 reads 2 and 3, checks 1
    # (before: both ranks opened all four, each restore)
    for call in (0, 1):
        seen = [sorted(res["opened"][call]) for res in results]
        assert seen == [
            ["shard-0", "shard-1", "shard-2"],
            ["shard-1", "shard-2", "shard-3"],
        ], seen


def test_shards_that_disagree_across_the_ranks_are_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    # Each rank reads and checks only its own shard: neither sees the other's dtype. The
    # digests exchanged at the end differ, so every rank checks every shard and raises.
    shards = [_rows(0, 4), _rows(4, 8, torch.float64)]
    write_sharded(tmp_path / "root", 1, shards, lie=True)
    results = _restore(tmp_path / "root", tmp_path / "o", [4, 4])
    for res in results:
        for call in ("restore", "restore_into"):
            kind, message = res[call]
            assert kind == "MetadataError", (call, res[call])
            assert "shard-1" in message and "shard 1" in message, message
            assert "torch.float64" in message and "in shard 0" in message, message
            assert "nothing was restored and the target is unchanged" in message, message
        assert res["untouched"] is True


def test_a_shard_one_rank_refuses_is_refused_alike_on_every_rank(tmp_path: Path) -> None:
    # Rank 1 checks shards 1, 2 and 3 and finds shard 3's dtype unlike the others'; rank 0
    # never opened shard 3. Every rank then checks every shard: the same error everywhere,
    # as when each rank checked every shard itself.
    shards = [_rows(0, 2), _rows(2, 4), _rows(4, 6), _rows(6, 8, torch.float64)]
    write_sharded(tmp_path / "root", 1, shards, lie=True)
    results = _restore(tmp_path / "root", tmp_path / "o", [4, 4])
    for call in ("restore", "restore_into"):
        assert results[0][call] == results[1][call], (call, results)
        kind, message = results[0][call]
        assert kind == "MetadataError", results[0][call]
        assert "shard-3" in message and "in shard 0" in message, message
    assert all(res["untouched"] is True for res in results)


def test_the_share_covers_every_shard() -> None:
    for world in range(1, 6):
        for shards in range(1, 12):
            owners = [
                [r for r in range(world) if SplitCheck(r, world).wants(i)] for i in range(shards)
            ]
            assert all(len(o) == 1 for o in owners), (world, shards, owners)
    assert SplitCheck.settled([(False, "a"), (False, None), (False, "a")])
    assert not SplitCheck.settled([(False, "a"), (False, "b"), (False, None)])
    assert not SplitCheck.settled([(False, "a"), (True, None)])


def test_all_gather_carries_any_size_in_one_or_two_rounds(tmp_path: Path) -> None:
    from tdckpt._shard.group import INLINE_BYTES

    args = {"out": str(tmp_path / "o"), "root": str(tmp_path / "root")}
    results = ok_results(spawn_ranks("_split_check_child:cmd_gather", WORLD, args), "gather")
    sizes = (0, 1, INLINE_BYTES - 64, INLINE_BYTES, INLINE_BYTES + 1, 3 * INLINE_BYTES)
    expected = [[["x", 0, None], ["x" * size, 1, None]] for size in sizes]
    assert results == [expected] * WORLD
