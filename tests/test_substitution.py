"""One ``CheckpointManager`` contract on every kind of root: local folders, archives, memory://,
S3, and a 2-rank group (real gloo processes, tests/_shard_child.py ``substitution``).

Each public method is called the same way on each root and must either work alike or
refuse with the same error class. One class serves every root: the object-storage root and
the sharded steps are layers under it (tdckpt._store, tdckpt._shard), not subclasses.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _remote_fixtures import _timeout, moto_s3  # noqa: F401
from tensordict import TensorDict

import tdckpt
import tdckpt.schema
from tdckpt import CheckpointManager, KeepLast
from tdckpt.errors import CheckpointNotFoundError, MetadataError, RestoreError
from tdckpt.warnings import TdckptDeprecationWarning


@pytest.fixture(params=["dir", "archive", "memory", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    if request.param == "memory":
        pytest.importorskip("fsspec")
        yield {"root": f"memory://t{uuid.uuid4().hex[:12]}/run"}
    elif request.param == "s3":
        s3 = request.getfixturevalue("moto_s3")
        yield {"root": f"s3://{s3.new_bucket()}/run", "storage_options": s3.options()}
    else:
        yield {"root": str(tmp_path / "run"), "archive": request.param == "archive"}


def _td(v: float) -> TensorDict:
    return TensorDict(model=TensorDict(w=torch.full((3,), v)), step=torch.tensor(int(v)))


def test_every_public_method_works_alike(root: dict[str, Any]) -> None:
    with CheckpointManager(**root, retention=KeepLast(2)) as mgr:
        assert mgr.tdckpt_group is None
        assert mgr.steps() == [] and mgr.latest_step() is None
        for step in (1, 2, 3):
            mgr.save(step, _td(step), metadata={"loss": 1.0 / step})
        mgr.save_async(4, _td(4), metadata={"loss": 0.1}).result()
        assert mgr.steps() == [3, 4] and mgr.latest_step() == 4
        assert mgr.best_step("loss") == 4 and mgr.metadata(3) == {"loss": 1.0 / 3}
        assert [s.step for s in mgr.list_steps()] == [3, 4]
        assert mgr.verify(3).ok and mgr.verify().ok
        assert mgr.prune() == [] and mgr.gc(grace_period=0) == []
        assert torch.equal(mgr.restore(3)["model", "w"], torch.full((3,), 3.0))
        part, report = mgr.restore(4, keys="model", report=True)
        assert sorted(part.keys()) == ["model"] and report.skipped == [("step",)]
        target = _td(0)
        mgr.restore_into(target, step=3)
        assert torch.equal(target["model", "w"], torch.full((3,), 3.0))
        _, report = mgr.restore_into(target, step=4, keys="model", report=True)
        assert torch.equal(target["model", "w"], torch.full((3,), 4.0))
        assert target["step"].item() == 3 and report.skipped == [("step",)]


def test_refusals_are_the_same_error_on_every_root(root: dict[str, Any]) -> None:
    with CheckpointManager(**root) as mgr:
        mgr.save(1, _td(1))
        with pytest.raises(CheckpointNotFoundError):
            mgr.restore(7)
        with pytest.raises(CheckpointNotFoundError):
            mgr.metadata(7)
        with pytest.raises(RestoreError, match="select nothing"):
            mgr.restore(1, keys="nope")
        for bad in (-1, float("nan"), "5", True, [1]):
            with pytest.raises(ValueError, match=r"grace_period must be None or a number"):
                mgr.gc(grace_period=bad)  # type: ignore[arg-type]
        with pytest.raises(tdckpt.errors.CheckpointExistsError):
            mgr.save(1, _td(2))


def test_one_signature_for_every_root(tmp_path: Path) -> None:
    # One class for every root (no subclass swapped in by __new__): what object storage
    # takes, the class declares (mypy users can pass it), and a local root refuses what only
    # object storage means - clearly.
    base = inspect.signature(CheckpointManager.__init__).parameters
    assert {"storage_options", "lease_ttl", "cache_dir", "group", "timeout"} <= set(base)
    for name, value in (("lease_ttl", 5.0), ("cache_dir", tmp_path)):
        with pytest.raises(ValueError, match=f"{name} is for object-storage roots"):
            CheckpointManager(tmp_path / "run", **{name: value})
    with pytest.raises(ValueError, match="group= and timeout="):
        CheckpointManager("memory://x/run", group=object())
    with CheckpointManager(f"memory://t{uuid.uuid4().hex[:12]}/run") as far:
        assert type(far) is CheckpointManager
    assert type(CheckpointManager(tmp_path / "run")) is CheckpointManager
    assert CheckpointManager.__new__ is object.__new__


def test_remote_checkpoint_manager_is_a_deprecated_alias() -> None:
    from tdckpt.manager import RemoteCheckpointManager

    url = f"memory://t{uuid.uuid4().hex[:12]}/run"
    with pytest.warns(TdckptDeprecationWarning) as caught:
        mgr = RemoteCheckpointManager(url, retention=KeepLast(1))  # the line warned about
    assert len(caught) == 1
    warning = caught[0]
    assert warning.filename == __file__
    assert "RemoteCheckpointManager is deprecated" in str(warning.message)
    assert "Use CheckpointManager" in str(warning.message)
    assert warning.message.since == "0.1" and warning.message.removal == "0.2"  # type: ignore[union-attr]
    with mgr:
        assert type(mgr) is CheckpointManager and mgr.root == url
        mgr.save(1, _td(1))
        mgr.save(2, _td(2))
        assert mgr.steps() == [2]


def test_local_gc_grace_period_keeps_fresh_leftovers(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, _td(1))
        leftover = tmp_path / "run" / "2.tmp-0123456789abcdef0123456789abcdef"
        leftover.mkdir()
        assert mgr.gc(grace_period=3600) == []
        assert leftover.exists()
        assert mgr.gc() == [leftover] and not leftover.exists()


def test_every_public_method_on_a_two_rank_group(tmp_path: Path) -> None:
    """The column of a collective manager: the same calls, each rank with its shard.

    What differs by design: ``tdckpt_group`` is the group. A refusal rank 0 decides for the
    shared root is the same class on every rank.
    """
    from _shard_child import LENGTHS, spawn_ranks

    from tdckpt._shard.rows import even_part

    args = {"out": str(tmp_path / "o"), "root": str(tmp_path / "root"), "timeout": 60}
    results = spawn_ranks("substitution", 2, args, timeout=240)
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} died"
        assert "ok" in res, f"rank {rank} raised:\n{res['error'][2]}"
        out = res["ok"]
        assert out["group"] and out["empty"] == [[], None]
        assert out["steps"] == [[3, 4], 4]
        assert out["best"] == [4, {"loss": 1.0 / 3}]
        assert out["list_steps"] == [[3, "sharded", "committed"], [4, "sharded", "committed"]]
        assert out["verify"] == [True, True]
        assert out["prune_gc"] == [[], []]
        start, stop = even_part(sum(LENGTHS[2]), rank, 2)  # torch.tensor_split's part
        assert out["restore"] == [[stop - start], True, True]
        assert out["restore_into"] == [True]
        # a part: only the model's leaves, the rest of the target as it was
        assert out["restore_keys"] == ["ok", [["model"], [["model", "w"]]]], out["restore_keys"]
        assert out["restore_into_keys"] == ["ok", [True, True]], out["restore_into_keys"]
        assert out["metadata_missing"][0] == "CheckpointNotFoundError"
        assert "no committed step 7" in out["metadata_missing"][1]
        kind, message = out["gc_negative"]
        assert kind == "ValueError" and "grace_period" in message
        # before: rank 1 raised RestoreError / CollectiveError for rank 0's refusal
        kind, message = out["restore_missing"]
        assert kind == "CheckpointNotFoundError" and "step 7" in message, out["restore_missing"]
        kind, message = out["save_existing"]
        assert kind == "CheckpointExistsError" and "step 3 already exists" in message
        for name in ("restore_bad_step", "restore_into_bad_step"):
            kind, message = out[name]
            assert kind == "ValueError" and "a step must be a non-negative int" in message, out
        assert out["steps_after"] == [3, 4]
    # outside the group the sharded steps restore whole, like any other root's
    with CheckpointManager(tmp_path / "root" / "sub") as mgr:
        assert mgr.steps() == [3, 4] and mgr.verify(4).ok
        whole = mgr.restore(4)
        assert whole.batch_size == (sum(LENGTHS[2]),) and bool((whole["step"] == 4).all())


def test_the_seam_adds_no_request_to_object_storage() -> None:
    """Store requests per call on memory://, as the object-storage manager made them before
    it became a layer: the one manager must not list or renew more (it did: a save listed
    the root twice and renewed the lease four times, a restore listed it twice)."""
    td = _td(1)
    url = f"memory://t{uuid.uuid4().hex[:12]}/run"
    with CheckpointManager(url, retention=KeepLast(1)) as mgr:
        mgr.save(1, td)
        # a restore: list the root, list the step's folder (objects sized before any read),
        # one ranged read of the metadata, one of the leaves restored
        most = {"save": 11, "restore": 4, "restore_into": 4, "save_async": 13, "steps": 1}
        calls = {
            "save": lambda: mgr.save(2, td),
            "restore": lambda: mgr.restore(2),
            "restore_into": lambda: mgr.restore_into(_td(0), 2),
            "save_async": lambda: mgr.save_async(3, td).result(),
            "steps": mgr.steps,
        }
        for name, call in calls.items():
            before = mgr.store.calls
            call()
            assert mgr.store.calls - before <= most[name], (name, mgr.store.calls - before)


# -- parity found by a red-team review: nothing a reader refuses is committed; copies --


def _local(kind: dict[str, Any]) -> bool:
    return "archive" in kind  # the fixture's local roots (folders of steps or archives)


def _replacing(kind: dict[str, Any]) -> dict[str, Any]:
    """``overwrite=True`` where the store can replace a step (a local root); object storage
    refuses it (no atomic swap), so there the same step number is saved afresh."""
    return {"overwrite": True} if _local(kind) else {}


def test_metadata_larger_than_a_manifest_is_refused_before_anything_is_written(
    root: dict[str, Any],
) -> None:
    # 257 MiB of metadata: the step would be saved but never listed (every reader refuses
    # a manifest that large); with overwrite=True it replaced the good step.
    with CheckpointManager(**root) as mgr:
        mgr.save(1, _td(1.0))
        step = 1 if _local(root) else 2
        with pytest.raises(MetadataError, match="more than the 268435456 a step's manifest"):
            mgr.save(step, _td(2.0), metadata={"s": "x" * (257 << 20)}, **_replacing(root))
        assert mgr.steps() == [1]
        assert torch.equal(mgr.restore(1)["model", "w"], torch.full((3,), 1.0))


def test_a_manifest_over_the_cap_is_never_committed(
    root: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Metadata small enough on its own, a manifest (or commit record) that is not: the
    # writer refuses before the commit, and the step it would have replaced stays.
    with CheckpointManager(**root) as mgr:
        mgr.save(1, _td(1.0))
        monkeypatch.setattr(tdckpt.schema, "MAX_MANIFEST_BYTES", 3000)
        if _local(root):
            with pytest.raises(MetadataError, match=r"would be [0-9]+ bytes, more than the 3000"):
                mgr.save(1, _td(2.0), metadata={"pad": "y" * 3000}, overwrite=True)
        with pytest.raises(MetadataError, match=r"would be [0-9]+ bytes, .*nothing was committed"):
            mgr.save(2, _td(2.0), metadata={"pad": "y" * 3000})
        with pytest.raises(MetadataError, match="nothing was committed"):
            mgr.save_async(3, _td(3.0), metadata={"pad": "y" * 3000}).result()
        monkeypatch.undo()
        assert mgr.steps() == [1]
        assert mgr.list_steps()[0].status == "committed"
        assert torch.equal(mgr.restore(1)["model", "w"], torch.full((3,), 1.0))
        assert mgr.gc(grace_period=0) == []  # the refused attempts left nothing behind


def test_list_steps_metadata_is_the_callers_own(root: dict[str, Any]) -> None:
    # On local roots list_steps() handed out the manager's cached nested values: editing
    # them changed what metadata() and best_step() answered for the rest of its life.
    with CheckpointManager(**root) as mgr:
        saved = [{"loss": 1.0, "m": {"acc": 0.5}}, {"loss": 2.0, "m": {"acc": 0.7}}]
        for step, metadata in enumerate(saved, 1):
            mgr.save(step, _td(step), metadata=metadata)
        mgr.list_steps()[0].metadata["m"]["acc"] = 9.0
        mgr.list_steps()[1].metadata["loss"] = 0.1
        mgr.metadata(2)["m"]["acc"] = 0.1
        assert [mgr.metadata(1), mgr.metadata(2)] == saved
        assert mgr.best_step("loss") == 1
        assert [s.metadata for s in mgr.list_steps()] == saved
