"""A sharded step's manifest is checked against its shards, and by its own checksum.

Each case is a step written by tdckpt's shard writer in this process (tests/_shard_local.py)
and then made to lie: rows shifted or inflated in the manifest, a replicated entry no one
holds, shards that disagree in dtype or keys. Every restore (a new object, some rows, in
place) refuses with a tdckpt error naming the shard's file and the key, before the target
is touched; an edited manifest fails its checksum in ``verify`` and every restore; a step
written before the checksum was recorded is still read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _shard_local import edit_manifest, write_sharded
from tensordict import TensorDict

from tdckpt import CheckpointManager
from tdckpt._shard.manifest import manifest_digest, parse_step_manifest
from tdckpt.errors import IncompleteCheckpointError, MetadataError, TdckptError
from tdckpt.schema import MANIFEST_NAME, ShardedManifest


def _rows(start: int, stop: int, dtype: torch.dtype = torch.float32) -> TensorDict:
    return TensorDict(
        x=torch.arange(start, stop, dtype=dtype),
        y=torch.arange(start, stop).reshape(-1, 1).expand(-1, 3).clone(),
        batch_size=[stop - start],
    )


def _two(root: Path, **kw: Any) -> Path:
    return write_sharded(root, 1, [_rows(0, 4), _rows(4, 8)], **kw)


def _refused(root: Path, match: str, **restore: Any) -> MetadataError:
    """Every restore path refuses with ``match``; restore_into leaves its target unchanged."""
    mgr = CheckpointManager(root)
    with pytest.raises(MetadataError, match=match) as caught:
        mgr.restore(1, **restore)
    target = _rows(100, 104)
    before = target.clone()
    with pytest.raises(MetadataError, match=match):
        mgr.restore_into(target, 1)
    assert (target == before).all(), "the target was changed"
    return caught.value


def test_a_correct_step_restores(tmp_path: Path) -> None:
    _two(tmp_path)
    mgr = CheckpointManager(tmp_path)
    assert mgr.restore(1)["x"].tolist() == list(range(8))
    assert mgr.restore(1, rows=slice(3, 5))["x"].tolist() == [3.0, 4.0]
    assert mgr.verify(1).ok


def test_rows_shifted_in_the_manifest_are_refused(tmp_path: Path) -> None:
    folder = _two(tmp_path)

    def shift(doc: dict[str, Any]) -> None:
        doc["shards"][0]["stop"] = 3
        doc["shards"][1]["start"] = 3

    edit_manifest(folder, shift)
    # before: rows=slice(3, 5) silently gave rows 4 and 5
    err = _refused(tmp_path, r"shard 0 holds 4 rows, but the step manifest gives it rows 0\.\.3")
    assert err.facts["path"].endswith("shard-0/meta.json")
    _refused(tmp_path, "shard 0 holds 4 rows", rows=slice(3, 5))


def test_a_huge_batch_size_is_refused(tmp_path: Path) -> None:
    folder = _two(tmp_path)

    def inflate(doc: dict[str, Any]) -> None:
        doc["shards"][1]["stop"] = 2**40
        doc["batch_size"] = [2**40]

    edit_manifest(folder, inflate)
    err = _refused(tmp_path, f"shard 1 holds 4 rows, .* rows 4..{2**40}")
    assert err.facts["path"].endswith("shard-1/meta.json")
    assert str(folder / MANIFEST_NAME) in str(err)


def test_a_replicated_entry_no_one_holds_is_refused(tmp_path: Path) -> None:
    shards = [_rows(0, 4), _rows(4, 8)]
    for shard in shards:
        shard["run"] = "exp-1"
    folder = write_sharded(tmp_path, 1, shards, replicated=("run",))
    assert CheckpointManager(tmp_path).restore(1)["run"] == "exp-1"
    edit_manifest(folder, lambda doc: doc["replicated"]["keys"].append(["ghost"]))
    # before: restored with "ghost" invented as None
    err = _refused(tmp_path, "the replicated entry 'ghost' named by the step manifest")
    assert err.facts["key"] == ("ghost",)
    assert err.facts["path"].endswith("replicated/meta.json")


def test_shards_that_disagree_in_dtype_are_refused(tmp_path: Path) -> None:
    write_sharded(tmp_path, 1, [_rows(0, 4), _rows(4, 8, torch.float64)], lie=True)
    # before: silently promoted to float64
    err = _refused(tmp_path, r"the key 'x' is a tensor of torch.float64 \[\] in shard 1 and")
    assert err.facts["key"] == ("x",)
    assert err.facts["path"].endswith("shard-1/meta.json")
    # the rows of shard 0 alone: still refused, shard 1 disagrees with it
    _refused(tmp_path, "in shard 1", rows=slice(0, 2))


def test_a_shard_missing_a_key_is_refused(tmp_path: Path) -> None:
    write_sharded(tmp_path, 1, [_rows(0, 4), _rows(4, 8).exclude("y")], lie=True)
    # before: tensordict's bare KeyError from torch.cat
    err = _refused(tmp_path, "shard 1 has no key 'y', which shard 0 has")
    assert err.facts["key"] == ("y",)


def test_a_shard_with_other_trailing_dims_is_refused(tmp_path: Path) -> None:
    wide = TensorDict(
        x=torch.zeros(4, 2), y=torch.zeros(4, 2, 3, dtype=torch.int64), batch_size=[4, 2]
    )
    folder = write_sharded(tmp_path, 1, [wide, wide.clone()])
    edit_manifest(folder, lambda doc: doc.__setitem__("batch_size", [8, 5]))
    _refused(tmp_path, r"shard 0 has batch size \[4, 2\]; the step manifest says \[rows, 5\]")


def test_the_step_manifest_is_sealed_by_a_checksum(tmp_path: Path) -> None:
    folder = _two(tmp_path)
    raw = (folder / MANIFEST_NAME).read_bytes()
    manifest = parse_step_manifest(raw)
    assert isinstance(manifest, ShardedManifest)
    assert manifest.manifest_checksum is not None
    assert manifest.manifest_checksum.startswith("sha256:")

    def shift(doc: dict[str, Any]) -> None:
        doc["shards"][0]["stop"] = 3
        doc["shards"][1]["start"] = 3

    edit_manifest(folder, shift, seal=False)
    mgr = CheckpointManager(tmp_path)
    report = mgr.verify(1)
    assert not report.ok
    assert [p.kind for p in report.problems] == ["manifest"]
    assert "manifest_checksum" in (report.problems[0].found or "")
    for restore in (
        lambda: mgr.restore(1),
        lambda: mgr.restore(1, rows=slice(3, 5)),
        lambda: mgr.restore_into(_rows(0, 8), 1),
    ):
        with pytest.raises(IncompleteCheckpointError, match="manifest_checksum"):
            restore()
    assert mgr.steps() == []  # never listed as committed
    assert [s.status for s in mgr.list_steps()] == ["damaged"]


def test_user_metadata_edits_fail_the_checksum(tmp_path: Path) -> None:
    folder = _two(tmp_path, metadata={"loss": 0.5})
    assert CheckpointManager(tmp_path).metadata(1) == {"loss": 0.5}
    edit_manifest(folder, lambda doc: doc["user_metadata"].update(loss=0.1), seal=False)
    assert not CheckpointManager(tmp_path).verify(1).ok
    with pytest.raises(TdckptError):
        CheckpointManager(tmp_path).metadata(1)


def test_a_step_without_a_checksum_is_still_read(tmp_path: Path) -> None:
    folder = _two(tmp_path)
    edit_manifest(folder, lambda doc: doc.pop("manifest_checksum"))
    mgr = CheckpointManager(tmp_path)
    assert mgr.restore(1)["x"].tolist() == list(range(8))
    assert mgr.verify(1).ok
    # ... and its shards still check it
    edit_manifest(folder, lambda doc: doc["shards"][1].update(stop=2**40) or None)
    edit_manifest(folder, lambda doc: doc.__setitem__("batch_size", [2**40]))
    _refused(tmp_path, "shard 1 holds 4 rows")
    # verify checks the manifest against its shards too (before: OK)
    report = CheckpointManager(tmp_path).verify(1)
    assert [(p.kind, p.path.split("/", 1)[1]) for p in report.problems] == [
        ("manifest", "shard-1/meta.json")
    ]
    assert "shard 1 holds 4 rows" in (report.problems[0].found or "")


def test_the_digest_ignores_spacing_not_content() -> None:
    doc = {"b": [1, 2.5, "é"], "a": {"z": None, "y": True}}
    same = {"a": {"y": True, "z": None}, "b": [1, 2.5, "é"]}
    assert manifest_digest(doc) == manifest_digest(same)
    assert manifest_digest(doc) != manifest_digest({**doc, "b": [1, 2.5, "e"]})
    assert manifest_digest(doc, "crc32").startswith("crc32:")


def test_shards_swapped_or_left_out_in_the_manifest_are_refused(tmp_path: Path) -> None:
    folder = _two(tmp_path)

    def swap(doc: dict[str, Any]) -> None:
        a, b = doc["shards"][0]["prefix"], doc["shards"][1]["prefix"]
        doc["shards"][0]["prefix"], doc["shards"][1]["prefix"] = b, a

    edit_manifest(folder, swap)
    # both shards hold 4 rows of one structure: only their names tell them apart
    _refused(tmp_path, "the step manifest gives rank 0 the folder")
    edit_manifest(folder, swap)

    def drop_last(doc: dict[str, Any]) -> None:
        doc["shards"].pop()
        doc["world_size"] = 1
        doc["batch_size"] = [4]

    edit_manifest(folder, drop_last)
    _refused(tmp_path, "which the step manifest does not name")


def test_replicated_entries_the_manifest_forgets_are_refused(tmp_path: Path) -> None:
    shards = [_rows(0, 4), _rows(4, 8)]
    for shard in shards:
        shard["run"] = "exp-1"
        shard["lr"] = "0.5"
    folder = write_sharded(tmp_path, 1, shards, replicated=("run", "lr"))
    edit_manifest(folder, lambda doc: doc["replicated"]["keys"].remove(["lr"]))
    _refused(tmp_path, "the replicated entries hold 'lr', which the step manifest does not")
    edit_manifest(folder, lambda doc: doc.__setitem__("replicated", None))
    _refused(tmp_path, "replicated.*which the step manifest does not name")
