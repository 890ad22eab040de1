"""Sharded steps in the consolidated layout: one tensordict.consolidated data file per shard.

Two real gloo ranks (tests/_shard_child.py, commands in tests/_shardcons_child.py) save each
case with ``CheckpointManager(root, layout="consolidated")``; the ranks (and one process
outside the group) restore it whole, by ``rows=`` and in place, verify it, and refuse a
tampered shard file before any target is touched. Each shard file is what
``td.consolidate(filename=...)`` writes: plain ``TensorDict.from_consolidated`` loads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _shard_child import LENGTHS, ok_results, spawn_ranks
from _shard_compare import assert_same
from _shard_local import edit_manifest, write_sharded
from _shardcons_child import STEPS, reference
from tensordict import TensorDict

from tdckpt import CheckpointManager
from tdckpt._read.consolidated import DATA_NAME
from tdckpt._shard.manifest import parse_step_manifest
from tdckpt.errors import MetadataError
from tdckpt.schema import MANIFEST_NAME, Manifest, ShardedManifest

WORLD = 2
TOTAL = sum(LENGTHS[WORLD])  # shard 0 holds rows 0..4, shard 1 rows 4..13
CONSOLIDATED = {"layout": "consolidated"}


def _run(command: str, root: Path, out: Path, **extra: Any) -> list[Any]:
    args = {"out": str(out), "root": str(root), "manager": CONSOLIDATED, **extra}
    return ok_results(spawn_ranks(f"_shardcons_child:{command}", WORLD, args), command)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case of STEPS saved by two ranks in the consolidated layout (a root to copy)."""
    base = tmp_path_factory.mktemp("shardcons")
    root = base / "root"
    assert _run("cmd_save", root, base / "out") == [list(STEPS)] * WORLD
    return root


def _copy(saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(saved, root)
    return root


def _step(root: Path, step: int) -> tuple[Path, ShardedManifest]:
    folder = root / str(step)
    manifest = parse_step_manifest((folder / MANIFEST_NAME).read_bytes())
    assert isinstance(manifest, ShardedManifest)
    return folder, manifest


def test_each_shard_is_one_consolidated_file(saved: Path) -> None:
    for step, case in STEPS.items():
        folder, manifest = _step(saved, step)
        assert manifest.layout == "consolidated"
        assert json.loads((folder / MANIFEST_NAME).read_text())["layout"] == "consolidated"
        whole = reference(case, TOTAL)
        for shard in manifest.shards:
            prefix = folder / shard.prefix
            assert sorted(p.name for p in prefix.iterdir()) == sorted([DATA_NAME, MANIFEST_NAME])
            # plain tensordict loads the shard file as it is: the shard's rows
            plain = TensorDict.from_consolidated(str(prefix / DATA_NAME))
            rows = whole[shard.start : shard.stop]
            if manifest.replicated is not None:  # saved once, beside the shards
                rows = rows.exclude(*map(tuple, manifest.replicated.keys))
            assert_same(plain, rows, f"{case} shard {shard.rank}")
            # the shard's own manifest: every leaf's offset, size and checksum
            own = Manifest.model_validate_json((prefix / MANIFEST_NAME).read_bytes())
            assert own.consolidated is not None and own.consolidated.file == DATA_NAME
            assert own.consolidated.leaves
            assert all(leaf.checksum for leaf in own.consolidated.leaves)
            assert manifest.root_type == own.root_type == shard.root_type
            recorded = {f.path for f in manifest.files}
            assert f"{shard.prefix}/{DATA_NAME}" in recorded
            assert f"{shard.prefix}/{MANIFEST_NAME}" in recorded
        if manifest.replicated is not None:  # rank 0's replicated entries: a memmap folder
            assert (folder / manifest.replicated.prefix / "meta.json").is_file()


def test_a_memmap_step_manifest_does_not_write_the_layout(tmp_path: Path) -> None:
    td = TensorDict(x=torch.arange(8.0), batch_size=[8])
    folder = write_sharded(tmp_path, 1, [td[:3], td[3:]])
    assert "layout" not in json.loads((folder / MANIFEST_NAME).read_text())
    _, manifest = _step(tmp_path, 1)
    assert manifest.layout == "memmap"


def test_two_ranks_restore_whole_rows_and_in_place(saved: Path, tmp_path: Path) -> None:
    root = _copy(saved, tmp_path)
    assert _run("cmd_restore", root, tmp_path / "out") == [list(STEPS)] * WORLD


def test_outside_a_group_the_step_restores_and_verifies(saved: Path) -> None:
    mgr = CheckpointManager(saved, layout="consolidated")
    for step, case in STEPS.items():
        whole = reference(case, TOTAL)
        assert_same(mgr.restore(step), whole, f"{case} whole")
        assert_same(mgr.restore(step, rows=slice(3, 11)), whole[3:11], f"{case} rows")
        report = mgr.verify(step)
        assert report.ok, report.summary()
    target = reference("nested", TOTAL).zero_()
    mgr.restore_into(target, 1)
    assert_same(target, reference("nested", TOTAL), "restore_into")
    # keys=: only the selected leaves of each shard
    got = mgr.restore(1, keys="a", rows=slice(2, 9))
    assert sorted(got.keys(True, True)) == ["a"]
    assert torch.equal(got["a"], reference("nested", TOTAL)["a"][2:9])


def test_rows_in_one_shard_are_views_of_its_one_mapping(saved: Path) -> None:
    mgr = CheckpointManager(saved)
    got = mgr.restore(1, rows=slice(5, 12))  # inside shard 1 (rows 4..13)
    leaves = [v for v in got.values(True, True) if isinstance(v, torch.Tensor)]
    assert len(leaves) == 4
    # every leaf is a view of the one mapping of shard 1's data file: one storage, no copy
    assert len({v.untyped_storage().data_ptr() for v in leaves}) == 1
    assert all(v.untyped_storage().nbytes() > v.nbytes for v in leaves)
    assert_same(got, reference("nested", TOTAL)[5:12], "rows of shard 1")


def _leaf_byte(root: Path, step: int, rank: int) -> tuple[Path, int, list[str]]:
    folder, manifest = _step(root, step)
    prefix = folder / manifest.shards[rank].prefix
    own = Manifest.model_validate_json((prefix / MANIFEST_NAME).read_bytes())
    assert own.consolidated is not None
    leaf = max(own.consolidated.leaves, key=lambda r: r.size)
    return prefix / DATA_NAME, leaf.offset, leaf.key


def test_a_changed_shard_file_is_refused_before_any_target_is_touched(
    saved: Path, tmp_path: Path
) -> None:
    root = _copy(saved, tmp_path)
    data, offset, key = _leaf_byte(root, 1, 1)
    raw = bytearray(data.read_bytes())
    raw[offset] ^= 0xFF
    data.write_bytes(bytes(raw))
    report = CheckpointManager(root).verify(1)
    assert not report.ok
    changed = [(p.path, p.key) for p in report.problems if p.kind == "changed"]
    rel = data.relative_to(root / "1").as_posix()
    assert len(changed) == 2 and {path for path, _ in changed} == {rel}  # the whole file
    assert (rel, tuple(key)) in changed  # and the leaf, named by its shard manifest's key
    results = _run("cmd_tampered", root, tmp_path / "out", verify=True)
    for rank, got in enumerate(results):
        assert got["raised"] is not None and got["raised"][0] == "IntegrityError", (rank, got)
        assert got["untouched"], f"rank {rank}'s target was changed"


def test_a_truncated_shard_file_is_refused_before_any_target_is_touched(
    saved: Path, tmp_path: Path
) -> None:
    root = _copy(saved, tmp_path)
    data, _, _ = _leaf_byte(root, 1, 1)
    raw = data.read_bytes()
    data.write_bytes(raw[: len(raw) // 2])  # its footer (the metadata) is gone
    results = _run("cmd_tampered", root, tmp_path / "out")
    for rank, got in enumerate(results):
        assert got["raised"] is not None, f"rank {rank} restored a truncated shard"
        assert got["untouched"], f"rank {rank}'s target was changed"
    with pytest.raises(MetadataError, match="not a consolidated data file") as caught:
        CheckpointManager(root).restore(1)
    assert caught.value.facts["path"] == str(data)
    # rows of shard 0 alone: refused too (every shard is checked, as the rows rest on them)
    with pytest.raises(MetadataError, match="not a consolidated data file"):
        CheckpointManager(root).restore(1, rows=slice(0, 2))
    for got in results:
        assert got["raised"][0] == "MetadataError" and "not a consolidated" in got["raised"][1]


def test_a_manifest_that_misstates_the_layout_is_refused(saved: Path, tmp_path: Path) -> None:
    root = _copy(saved, tmp_path)
    edit_manifest(root / "1", lambda doc: doc.pop("layout"))  # sealed again: a lie
    with pytest.raises(MetadataError, match="records layout 'memmap'") as caught:
        CheckpointManager(root).restore(1)
    assert caught.value.facts["path"].endswith("shard-0/meta.json")
    # and a memmap step that claims to be consolidated
    td = TensorDict(x=torch.arange(8.0), batch_size=[8])
    plain = tmp_path / "plain"
    folder = write_sharded(plain, 1, [td[:3], td[3:]])
    edit_manifest(folder, lambda doc: doc.__setitem__("layout", "consolidated"))
    with pytest.raises(MetadataError, match=r"holds a meta\.json \(the memmap layout\)"):
        CheckpointManager(plain).restore(1)


def test_incremental_is_refused_by_a_consolidated_collective_manager(
    saved: Path, tmp_path: Path
) -> None:
    root = _copy(saved, tmp_path)
    for got in _run("cmd_incremental", root, tmp_path / "out"):
        assert got is not None and got[0] == "ValueError"
        assert "layout='consolidated'" in got[1] and "incremental" in got[1]
    assert CheckpointManager(root).steps() == list(STEPS)
    with pytest.raises(ValueError, match="incremental saves share leaf files"):
        CheckpointManager(tmp_path / "other", layout="consolidated", incremental=True)


def test_a_shard_file_replaced_after_the_check_is_not_read(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is swapped between the check and the load (the hook only times it): each
    shard is opened once, checked, and mapped as it was checked, so the replaced file is
    never read. (Before the shards were opened once, the load opened the file again and
    refused the 3 swapped-in rows as "changed while the step was being restored".)"""
    from tdckpt._shard import check

    root = _copy(saved, tmp_path)
    data, _, _ = _leaf_byte(root, 1, 1)
    real = check.open_checked
    swapped: list[Path] = []

    def check_then_swap(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        fewer = reference("nested", TOTAL)[4:7]  # shard 1 held rows 4..13: now 3 rows
        data.unlink()
        fewer.consolidate(filename=str(data))
        swapped.append(data)
        return out

    monkeypatch.setattr(check, "open_checked", check_then_swap)
    got = CheckpointManager(root).restore(1)
    assert swapped == [data]
    assert_same(got, reference("nested", TOTAL), "the rows as checked")
    # the file now there is the swapped-in one: the next restore checks it, and refuses it
    monkeypatch.setattr(check, "open_checked", real)
    with pytest.raises(MetadataError, match=r"shard 1 holds 3 rows"):
        CheckpointManager(root).restore(1)


def test_an_empty_shard_and_uneven_shards(tmp_path: Path) -> None:
    td = TensorDict(x=torch.arange(6.0), n=TensorDict(y=torch.ones(6, 2)), batch_size=[6])
    write_sharded(tmp_path, 1, [td[:4], td[4:4], td[4:]], layout="consolidated")
    mgr = CheckpointManager(tmp_path)
    assert_same(mgr.restore(1), td, "whole")
    assert_same(mgr.restore(1, rows=slice(3, 5)), td[3:5], "across the empty shard")
    assert mgr.verify(1).ok


def test_inspect_names_the_layout(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tdckpt.cli import main

    step = saved / "1"
    assert main(["inspect", str(step), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "consolidated" and info["world_size"] == WORLD
    assert [s["files"] for s in info["shards"]] == [2, 2]  # the data file and its manifest
    assert main(["inspect", str(step)]) == 0
    assert "layout       consolidated" in capsys.readouterr().out
    # each shard inspects as the consolidated step it is
    assert main(["inspect", str(step / info["shards"][1]["prefix"])]) == 0
    assert "a: torch.float32" in capsys.readouterr().out


def test_only_the_shards_the_rows_overlap_are_read(saved: Path) -> None:
    from tdckpt._shard.rows import ReadStats, read_rows

    folder, manifest = _step(saved, 1)
    whole = reference("nested", TOTAL)
    row_bytes = sum(v[0].numel() * v.element_size() for v in whole.values(True, True))
    for start, stop, opened in ((5, 12, 1), (0, 4, 1), (2, 9, 2), (0, TOTAL, 2)):
        stats = ReadStats()
        got = read_rows(folder, manifest, start, stop, allow_pickle=None, mode="r", stats=stats)
        assert_same(got, whole[start:stop], f"rows {start}..{stop}")
        assert stats.shards_opened == opened
        assert stats.bytes_requested == row_bytes * (stop - start)
