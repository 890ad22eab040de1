"""Sharded save and restore across ranks: N -> M reshards, compared with one-process references.

Real processes (forkserver children of this test process, gloo on 127.0.0.1 and a free
port; tests/_shard_child.py), each run bounded by a timeout that kills the ranks and fails.
To keep CI time bounded on 2 cores, the ranks are started once per world size to save
(every case as its own step) and once per world size to restore every root (N = 1..4).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _shard_child import CASES, LENGTHS, make_case, ok_results, spawn_ranks, step_of
from _shard_compare import assert_same
from pydantic import ValidationError

from tdckpt import CheckpointManager
from tdckpt._shard.manifest import ShardResult, build_manifest, parse_step_manifest
from tdckpt._shard.rows import ReadStats, even_part, plan_rows, read_rows, row_range
from tdckpt.errors import MetadataError, RestoreError
from tdckpt.schema import ShardedManifest

WORLDS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def saved_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """One root per N = 1..4, every case saved by N ranks as its own step."""
    base = tmp_path_factory.mktemp("sharded")
    roots = {}
    for world in WORLDS:
        root = base / f"by{world}"
        steps = ok_results(
            spawn_ranks("save", world, {"out": str(base / f"o{world}"), "root": str(root)}),
            f"save by {world}",
        )
        assert all(s == [step_of(c) for c in CASES] for s in steps)
        roots[world] = root
    return roots


@pytest.mark.parametrize("world", WORLDS)
def test_restore_n_to_m(saved_roots: dict[int, Path], world: int, tmp_path: Path) -> None:
    """M ranks restore the steps saved by each N: their tensor_split part, a slice, into."""
    roots = [[n, str(root)] for n, root in saved_roots.items()]
    args = {"out": str(tmp_path), "root": str(saved_roots[1]), "roots": roots}
    checked = ok_results(spawn_ranks("restore", world, args), f"restore by {world}")
    for per_rank in checked:
        assert len(per_rank) == len(WORLDS) * len(CASES)


@pytest.mark.parametrize("case", CASES)
def test_outside_a_group_a_sharded_step_restores_whole(
    saved_roots: dict[int, Path], case: str
) -> None:
    for world, root in saved_roots.items():
        mgr = CheckpointManager(root)
        whole = make_case(case, sum(LENGTHS[world]))
        assert_same(mgr.restore(step_of(case)), whole, f"by {world}: {case}")
        assert_same(mgr.restore(step_of(case), rows=slice(2, -2)), whole[2:-2], f"{case} rows")
        assert mgr.metadata(step_of(case)) == {"case": case}
        assert mgr.verify(step_of(case)).ok


def test_layout_and_manifest(saved_roots: dict[int, Path]) -> None:
    root = saved_roots[4]
    step = root / str(step_of("nested"))
    manifest = parse_step_manifest((step / "tdckpt.manifest.json").read_bytes())
    assert isinstance(manifest, ShardedManifest)
    assert manifest.world_size == 4 and manifest.batch_size == [sum(LENGTHS[4]), 2]
    assert [(s.start, s.stop) for s in manifest.shards] == [(0, 6), (6, 6), (6, 9), (9, 17)]
    on_disk = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file()}
    assert on_disk == {f.path for f in manifest.files} | {"tdckpt.manifest.json"}
    # every shard is a plain tensordict prefix
    from tensordict import TensorDict

    whole = make_case("nested", 17)
    for shard in manifest.shards:
        loaded = TensorDict.load_memmap(step / shard.prefix)
        assert_same(loaded, whole[shard.start : shard.stop], f"shard {shard.rank}")
    rep = parse_step_manifest(
        (root / str(step_of("replicated")) / "tdckpt.manifest.json").read_bytes()
    )
    assert isinstance(rep, ShardedManifest) and rep.replicated is not None
    assert rep.replicated.keys == [["run"], ["cfg"]]
    # replicated entries are in no shard
    for shard in rep.shards:
        assert set(
            TensorDict.load_memmap(root / str(step_of("replicated")) / shard.prefix).keys()
        ) == {"x"}


def test_reads_only_the_requested_rows(saved_roots: dict[int, Path]) -> None:
    root = saved_roots[2]
    path = root / str(step_of("nested"))
    manifest = parse_step_manifest((path / "tdckpt.manifest.json").read_bytes())
    assert isinstance(manifest, ShardedManifest)
    row_bytes = (2 * 3 * 4) + (2 * 8) + 2 * 1 + 2 * 2  # a, b, nested.c, nested.deeper.d
    for start, stop in [(0, 4), (1, 3), (3, 7), (5, 13), (0, 13), (6, 6)]:
        stats = ReadStats()
        got = read_rows(path, manifest, start, stop, allow_pickle=None, mode="r", stats=stats)
        assert got.batch_size[0] == stop - start
        assert stats.bytes_requested == row_bytes * (stop - start)
        assert stats.shards_opened == max(1, len(plan_rows(manifest.shards, start, stop)))
    # rows in one shard (rank 1 holds rows 4..13): a zero-copy view of the mapped file
    one = read_rows(path, manifest, 5, 8, allow_pickle=None, mode="r")
    assert one["a"].untyped_storage().nbytes() == 9 * 2 * 3 * 4  # the whole shard's leaf
    assert one["a"].storage_offset() == 1 * 2 * 3


def test_even_part_is_tensor_split() -> None:
    for total in range(0, 12):
        for world in range(1, 6):
            parts = torch.tensor_split(torch.arange(total), world)
            for rank, part in enumerate(parts):
                start, stop = even_part(total, rank, world)
                assert part.tolist() == list(range(start, stop))


def test_row_range() -> None:
    assert row_range(slice(None), 10) == (0, 10)
    assert row_range(slice(-3, None), 10) == (7, 10)
    assert row_range(slice(8, 2), 10) == (8, 8)
    assert row_range(range(2, 5), 10) == (2, 5)
    with pytest.raises(ValueError, match="step 1"):
        row_range(slice(0, 10, 2), 10)
    with pytest.raises(TypeError, match="slice"):
        row_range(3, 10)


def _shards(*bounds: tuple[int, int]) -> list[dict[str, Any]]:
    return [
        {
            "rank": i,
            "prefix": f"attempt-{'0' * 32}/shard-{i}",
            "start": a,
            "stop": b,
            "root_type": "t",
        }
        for i, (a, b) in enumerate(bounds)
    ]


def _manifest(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "schema_version": 1,
        "format_version": 1,
        "created": "now",
        "writer": {"tdckpt": "x", "torch": "x", "python": "x"},
        "key_encoding": "robust",
        "root_type": "t",
        "sharded": 1,
        "world_size": 2,
        "attempt": "attempt-" + "0" * 32,
        "batch_size": [7],
        "shards": _shards((0, 3), (3, 7)),
    }
    base.update(over)
    return base


def test_manifest_refuses_bad_coverage() -> None:
    ShardedManifest.model_validate(_manifest())
    bad = [
        ({"shards": _shards((0, 3), (2, 7))}, "expected it to start at row 3"),
        ({"shards": _shards((0, 3), (4, 7))}, "expected it to start at row 3"),
        ({"batch_size": [8]}, "cover 7 rows of a global batch of 8"),
        ({"world_size": 3}, "2 shards for a world size of 3"),
        (
            {
                "shards": [
                    {**_shards((0, 3))[0], "prefix": "elsewhere/x"},
                    _shards((0, 3), (3, 7))[1],
                ]
            },
            "outside the attempt",
        ),
        (
            {
                "shards": [
                    {**_shards((0, 3))[0], "prefix": f"attempt-{'0' * 32}/../x"},
                    _shards((0, 3), (3, 7))[1],
                ]
            },
            "relative path",
        ),
        (
            {"shards": [{**_shards((0, 3))[0], "prefix": "/abs"}, _shards((0, 3), (3, 7))[1]]},
            "pattern",
        ),
    ]
    for over, message in bad:
        with pytest.raises(ValidationError, match=message):
            ShardedManifest.model_validate(_manifest(**over))


def test_plain_manifest_parses_as_before() -> None:
    import json

    plain = {
        k: v
        for k, v in _manifest().items()
        if k not in ("sharded", "world_size", "attempt", "batch_size", "shards")
    }
    plain["user_metadata"] = {"note": '"sharded"'}
    m = parse_step_manifest(json.dumps(plain).encode())
    assert type(m).__name__ == "Manifest"


def test_build_manifest_names_the_disagreeing_rank() -> None:
    def res(
        rank: int, rows: int, leaves: dict[tuple[str, ...], Any], tail: list[int] | None = None
    ) -> ShardResult:
        return ShardResult(
            rank=rank,
            rows=rows,
            batch_tail=tail or [],
            root_type="tensordict:TensorDict",
            prefix=f"attempt-{'1' * 32}/shard-{rank}",
            leaves=leaves,
            writer={"tdckpt": "x", "torch": "x", "python": "x"},
        )

    a = {("a",): ("tensor", "torch.float32", (3,))}
    ok = build_manifest(
        [res(0, 2, a), res(1, 5, a)], step=1, attempt="attempt-" + "1" * 32, user_metadata={}
    )
    assert ok.batch_size == [7] and [s.stop for s in ok.shards] == [2, 7]
    cases = [
        ([res(0, 2, a), res(1, 5, {})], "'a' is on rank 0 but not on rank 1: its rows 2..7"),
        (
            [res(0, 2, a), res(1, 5, {**a, ("b",): ("tensor", "torch.int64", ())})],
            "'b' is on rank 1",
        ),
        ([res(0, 2, a), res(1, 5, {("a",): ("tensor", "torch.float64", (3,))})], "float64"),
        ([res(0, 2, a, [4]), res(1, 5, a, [5])], "the dims after dim 0 must agree"),
    ]
    for results, message in cases:
        with pytest.raises(MetadataError, match=message):
            build_manifest(results, step=1, attempt="attempt-" + "1" * 32, user_metadata={})


def test_a_given_group_saves_on_its_ranks_only(tmp_path: Path) -> None:
    sub_root = tmp_path / "sub"
    args = {"out": str(tmp_path / "o"), "root": str(tmp_path / "world"), "sub_root": str(sub_root)}
    results = ok_results(spawn_ranks("subgroup", 3, args), "subgroup")
    assert results[0] == {"world_group": True}
    assert CheckpointManager(tmp_path / "world").steps() == [1]
    assert [r["sub_rank"] for r in results[1:]] == [0, 1]
    assert all(r["steps"] == [3] for r in results[1:])
    whole = make_case("nested", sum(LENGTHS[2]))
    assert_same(CheckpointManager(sub_root).restore(3), whole, "subgroup step, whole")


def test_a_single_process_manager_is_unchanged(tmp_path: Path) -> None:
    from tensordict import TensorDict

    mgr = CheckpointManager(tmp_path / "root")
    assert mgr.tdckpt_group is None
    mgr.save(1, TensorDict(a=torch.arange(3), batch_size=[3]), replicated=("a",))
    mgr.save(2, TensorDict(a=torch.arange(3)))
    manifest = parse_step_manifest((tmp_path / "root" / "1" / "tdckpt.manifest.json").read_bytes())
    assert type(manifest).__name__ == "Manifest"
    assert mgr.restore(1)["a"].tolist() == [0, 1, 2]
    assert mgr.restore(1, rows=slice(1, 3))["a"].tolist() == [1, 2]
    with pytest.raises(RestoreError, match="no rows to select"):
        mgr.restore(2, rows=slice(1, 3))


def test_ls_inspect_and_verify_know_sharded_steps(
    saved_roots: dict[int, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    import shutil

    from tdckpt.cli import main

    root = tmp_path / "copy"
    shutil.copytree(saved_roots[3], root)
    mgr = CheckpointManager(root)
    rows = mgr.list_steps()
    assert [(r.step, r.kind, r.status) for r in rows] == [
        (step_of(c), "sharded", "committed") for c in CASES
    ]
    assert rows[0].detail == "3 shards, rows 0..5, 5..6, 6..13; batch size [13, 2]"
    assert main(["ls", str(root)]) == 0
    assert "sharded" in capsys.readouterr().out
    step = root / str(step_of("replicated"))
    assert main(["inspect", str(step), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["world_size"] == 3 and info["batch_size"] == [13]
    assert [s["rows"] for s in info["shards"]] == [[0, 5], [5, 6], [6, 13]]
    assert info["replicated"]["keys"] == [["run"], ["cfg"]]
    assert main(["inspect", str(step)]) == 0
    text = capsys.readouterr().out
    assert "world size   3" in text and "replicated   run, cfg" in text
    # each shard inspects as the plain prefix it is
    assert main(["inspect", str(step / info["shards"][2]["prefix"])]) == 0
    assert "x: torch.float32 [7]" in capsys.readouterr().out
    # verify: a flipped byte in one shard's leaf, named with its key
    assert mgr.verify(step_of("nested")).ok
    leaf = next((root / str(step_of("nested"))).glob("attempt-*/shard-2/a.memmap"))
    data = bytearray(leaf.read_bytes())
    data[5] ^= 0xFF
    leaf.write_bytes(bytes(data))
    report = mgr.verify(step_of("nested"))
    assert not report.ok
    assert [(p.kind, p.path.split("/", 1)[1], p.key) for p in report.problems] == [
        ("changed", "shard-2/a.memmap", ("a",))
    ]
    from tdckpt.errors import IntegrityError

    with pytest.raises(IntegrityError, match="failed verification"):
        mgr.restore(step_of("nested"), verify=True)


def test_restore_into_checks_before_touching_the_target(saved_roots: dict[int, Path]) -> None:
    mgr = CheckpointManager(saved_roots[2])
    step = step_of("nested")
    whole = make_case("nested", sum(LENGTHS[2]))
    target = make_case("nested", 5)
    before = target.clone()
    assert mgr.restore_into(target, step) is target
    assert_same(target, whole[:5], "restore_into outside a group: the first rows")
    wrong = before.clone().exclude(("nested", "c"))
    kept = wrong.clone()
    with pytest.raises(
        RestoreError, match=r"In the checkpoint but not the target: \('nested', 'c'\)"
    ):
        mgr.restore_into(wrong, step)
    assert_same(wrong, kept, "unchanged after a key mismatch")
    too_many = make_case("nested", sum(LENGTHS[2]) + 1)
    kept = too_many.clone()
    with pytest.raises(RestoreError, match="take 14 rows"):
        mgr.restore_into(too_many, step)
    assert_same(too_many, kept, "unchanged after too many rows")


def test_replicated_entries_must_carry_no_batch_dim() -> None:
    from tensordict import TensorDict

    from tdckpt._shard.save import split_shard
    from tdckpt.errors import UnsupportedContentError

    td = make_case("replicated", 4)
    shard, rep, keys = split_shard(td, ("run", ("cfg",)))
    assert set(shard.keys()) == {"x"} and keys == [["run"], ["cfg"]]
    assert rep.batch_size == torch.Size([]) and rep["run"] == "exp-1"
    with pytest.raises(UnsupportedContentError, match="x: a replicated entry must carry no batch"):
        split_shard(td, ("x",))
    with pytest.raises(UnsupportedContentError, match="nope: named in replicated= but not in"):
        split_shard(td, ("nope",))
    with pytest.raises(UnsupportedContentError, match="has batch size \\[\\]"):
        split_shard(TensorDict(a=torch.zeros(3)), ())
    with pytest.raises(TypeError, match="a str or a tuple of str"):
        split_shard(td, (3,))


def test_retention_and_gc_on_sharded_steps(saved_roots: dict[int, Path], tmp_path: Path) -> None:
    import shutil

    from tdckpt import KeepLast

    root = tmp_path / "copy"
    shutil.copytree(saved_roots[4], root)
    (root / f"20.tmp-{'a' * 32}").mkdir()  # what a killed sharded save leaves
    mgr = CheckpointManager(root, retention=KeepLast(2))
    assert [s.status for s in mgr.list_steps()][-1] == "incomplete"
    gone = mgr.prune()
    assert sorted(p.name for p in gone) == [str(step_of("nested")), str(step_of("nontensor"))]
    assert mgr.steps() == [step_of("tensorclass"), step_of("replicated")]
    assert [p.name for p in mgr.gc()] == ["20.tmp-" + "a" * 32]
    assert sorted(os.listdir(root)) == sorted([".tdckpt.lock", *map(str, mgr.steps())])
    whole = make_case("replicated", sum(LENGTHS[4]))
    assert_same(mgr.restore(), whole, "latest after retention")
    mgr.close()


def test_save_async_in_a_group_commits_the_values_at_the_call(tmp_path: Path) -> None:
    root = tmp_path / "root"
    args = {"out": str(tmp_path / "o"), "root": str(root)}
    results = ok_results(spawn_ranks("async", 2, args), "async")
    steps = sorted(step_of(case) for case in CASES)
    assert results == [steps, steps]
    mgr = CheckpointManager(root)
    for case in CASES:  # the shards were overwritten right after each call: not in the step
        assert_same(mgr.restore(step_of(case)), make_case(case, sum(LENGTHS[2])), case)
        assert mgr.verify(step_of(case)).ok


def test_a_save_async_one_rank_refuses_fails_on_every_rank_and_the_group_goes_on(
    tmp_path: Path,
) -> None:
    """Rank 1's metadata (a NaN loss) was refused on its own thread, so it made one fewer
    collective call than rank 0: every later save and restore paired each rank's calls with
    the other's wrong ones. The refusal now runs through the protocol: every rank's result()
    raises, nothing is committed, and the next save and restore work."""
    args = {"out": str(tmp_path / "o"), "root": str(tmp_path / "root")}
    results = ok_results(spawn_ranks("async_refusal", 2, args), "async_refusal")
    for rank, result in enumerate(results):
        (kind2, says2), (kind3, _), restored = result["outcomes"]
        assert kind2 == ("CollectiveError" if rank == 0 else "MetadataError"), says2
        assert "nan is not valid JSON" in says2
        assert kind3 == "returned" and restored is True
        assert result["steps"] == [3]


def test_a_lazy_stack_along_dim_0_with_uneven_shards_is_refused_before_the_commit(
    tmp_path: Path,
) -> None:
    """A lazy stack's shard saves its members by index ('0', '1', ...): shards of 3 and 5
    members read back with different keys, which every restore refused - the save had
    committed a step no restore could read. The save now compares the shards as a restore
    reads them back, and refuses before the commit; equal shards still save and restore."""
    from _shard_local import write_sharded
    from tensordict import LazyStackedTensorDict, TensorDict

    from tdckpt._shard.manifest import CoverageError

    def lazy(a: int, b: int) -> Any:
        return LazyStackedTensorDict(
            *[TensorDict(x=torch.full((2,), float(i))) for i in range(a, b)], stack_dim=0
        )

    with pytest.raises(CoverageError, match=r"rank 1's shard reads back with other keys"):
        write_sharded(tmp_path / "uneven", 1, [lazy(0, 3), lazy(3, 8)])
    write_sharded(tmp_path / "even", 1, [lazy(0, 4), lazy(4, 8)])
    with CheckpointManager(tmp_path / "even", group=False) as mgr:
        assert mgr.restore(1)["x"][:, 0].tolist() == [float(i) for i in range(8)]


def test_a_sharded_selective_restore_in_place_keeps_what_a_pattern_only_reaches_below(
    tmp_path: Path,
) -> None:
    """keys='*.x' reaches below every top-level name: a target leaf it selects nothing under
    was reported missing (a strict restore refused); it stays, as for a plain step."""
    from _shard_local import write_sharded
    from tensordict import TensorDict

    def shard(a: int, b: int) -> Any:
        rows = torch.arange(a, b, dtype=torch.float32)
        return TensorDict(a=rows, m=TensorDict(x=rows, batch_size=[b - a]), batch_size=[b - a])

    write_sharded(tmp_path / "root", 1, [shard(0, 3), shard(3, 5)])
    target = TensorDict(
        a=torch.full((5,), -1.0), m=TensorDict(x=torch.zeros(5), batch_size=[5]), batch_size=[5]
    )
    with CheckpointManager(tmp_path / "root", group=False) as mgr:
        _, report = mgr.restore_into(target, keys="*.x", report=True)
    assert report.missing == []
    assert target["a"].tolist() == [-1.0] * 5
    assert target["m", "x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
