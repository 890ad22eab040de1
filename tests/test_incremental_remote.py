# ruff: noqa: F811  (pytest fixtures imported from _remote_fixtures are parameters here)
"""Incremental steps in object storage (``memory://`` and S3 on a moto server): a record
refers to the earlier step's object instead of uploading it again, and retention and gc
count references across every record."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

pytest.importorskip("fsspec")
from _remote_fixtures import (  # noqa: F401
    Remote,
    _timeout,
    moto_s3,
    remote,
    remote_timeout,
    s3_remote,
)

from tdckpt import CheckpointManager, KeepLast

tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict


def _td() -> Any:
    # three leaves of 1.28 MB (objects of their own) and small ones (packed)
    return TensorDict(
        a=torch.arange(320_000, dtype=torch.float32),
        b=torch.ones(320_000),
        c=torch.arange(160_000, dtype=torch.int64),
        small=TensorDict(s=torch.zeros(8), t=torch.arange(4)),
    )


def _mgr(r: Remote, **kw: Any) -> CheckpointManager:
    return CheckpointManager(r.url, storage_options=r.storage_options, **kw)


def _record(r: Remote, step: int) -> dict[str, Any]:
    data: Any = r.fs().cat_file(r.path(f"{step}.tdckpt.json"))
    return json.loads(data)


def _attempt(r: Remote, step: int) -> str:
    return f"{step}.attempt-{_record(r, step)['attempt']}"


def _objects(r: Remote, attempt: str) -> list[str]:
    fs = r.fs()
    return sorted(p.rsplit("/", 1)[1] for p in fs.find(r.path(attempt)))


def _equal(a: Any, b: Any) -> bool:
    keys = set(a.keys(True, True))
    return keys == set(b.keys(True, True)) and all(torch.equal(a[k], b[k]) for k in keys)


def test_a_record_refers_to_the_earlier_objects_instead_of_uploading_them(
    remote: Remote,
) -> None:
    td = _td()
    with _mgr(remote, incremental=True) as mgr:
        mgr.save(1, td)
        td["b"] += 1
        mgr.save(2, td)
        first, second = _record(remote, 1), _record(remote, 2)
        assert first["commit_version"] == 1
        assert all("prefix" not in o for o in first["objects"])  # readable by every tdckpt
        assert second["commit_version"] == 2
        shared = {o["name"]: o["prefix"] for o in second["objects"] if "prefix" in o}
        assert set(shared.values()) == {_attempt(remote, 1)} and len(shared) == 2  # a, c
        # step 2's own prefix holds b and the pack of small files only
        assert len(_objects(remote, _attempt(remote, 2))) == len(second["objects"]) - 2
        assert mgr.verify(2).ok and mgr.verify(1).ok
        assert _equal(mgr.restore(2), td)
        first_td = _td()
        assert _equal(mgr.restore(1), first_td)


def test_retention_deleting_the_base_step_keeps_the_objects_later_steps_name(
    remote: Remote,
) -> None:
    td = _td()
    with _mgr(remote, incremental=True, retention=KeepLast(1)) as mgr:
        mgr.save(1, td)
        base = _attempt(remote, 1)
        td["b"] += 1
        mgr.save(2, td)
        assert mgr.steps() == [2]
        # the record of step 1 and its unshared objects are gone; a and c stay
        assert len(_objects(remote, base)) == 2
        td["b"] += 1
        mgr.save(3, td)  # refers to the same objects of step 1's attempt
        assert mgr.steps() == [3]
        assert {o.get("prefix") for o in _record(remote, 3)["objects"]} == {None, base}
        mgr.gc(grace_period=0)
        assert len(_objects(remote, base)) == 2
        assert not any(n.startswith("2.attempt-") for n in remote.fs().ls(remote.path(), False))
        assert mgr.verify(3).ok
        assert _equal(mgr.restore(3), td)


def test_a_record_tdckpt_cannot_parse_protects_the_attempts_it_mentions(
    remote: Remote,
) -> None:
    td = _td()
    with _mgr(remote, incremental=True) as mgr:
        mgr.save(1, td)
        td["b"] += 1
        mgr.save(2, td)
    base = _attempt(remote, 1)
    fs = remote.fs()
    fs.rm(remote.path("1.tdckpt.json"))  # step 1 gone: its attempt is named by no record
    good = fs.cat_file(remote.path("2.tdckpt.json"))
    newer = json.loads(good)
    newer["commit_version"] = 99  # a newer tdckpt's record: not parsed here
    fs.pipe_file(remote.path("2.tdckpt.json"), json.dumps(newer).encode())
    with _mgr(remote) as mgr:
        assert mgr.steps() == []
        with pytest.warns(Warning):  # gc says it kept step 2's own attempt
            mgr.gc(grace_period=0)
    assert len(_objects(remote, base)) == 4  # nothing of what record 2 may name was deleted
    fs.pipe_file(remote.path("2.tdckpt.json"), good)
    with _mgr(remote) as mgr:
        assert mgr.verify(2).ok
        assert _equal(mgr.restore(2), td)
        mgr.gc(grace_period=0)  # record 2 readable again: only a and c of step 1 stay
    assert len(_objects(remote, base)) == 2
    with _mgr(remote) as mgr:
        assert _equal(mgr.restore(2), td)


@pytest.mark.parametrize("damage", ["deleted", "truncated", "misnamed in the record"])
def test_a_base_whose_objects_are_damaged_never_makes_the_next_save_fail(
    remote: Remote, damage: str
) -> None:
    # The base's record names objects the store lacks (or holds at another size): the next
    # incremental save uploads those leaves again instead of referring to them, commits,
    # and restores exactly. (It used to fail at the commit check, "Retry the save", and
    # every later save with it.)
    td = _td()
    with _mgr(remote, incremental=True) as mgr:
        mgr.save(1, td)
    fs = remote.fs()
    base = _attempt(remote, 1)
    record = _record(remote, 1)
    a_object = record["objects"][record["locations"]["a.memmap"]["object"]]["name"]
    if damage == "deleted":
        fs.rm(remote.path(f"{base}/{a_object}"))
    elif damage == "truncated":
        fs.pipe_file(remote.path(f"{base}/{a_object}"), b"\0" * 16)
    else:  # the record names an object the attempt does not hold for "a"
        record["objects"][record["locations"]["a.memmap"]["object"]]["name"] = "data-99"
        fs.pipe_file(remote.path("1.tdckpt.json"), json.dumps(record).encode())
    td["b"] += 1
    with _mgr(remote, incremental=True) as mgr:
        assert not mgr.verify(1).ok
        mgr.save(2, td)
        assert mgr.verify(2).ok
        assert _equal(mgr.restore(2), td)
    second = _record(remote, 2)
    a_ref = second["objects"][second["locations"]["a.memmap"]["object"]]
    assert "prefix" not in a_ref  # "a" was uploaded again, not referred to
    c_ref = second["objects"][second["locations"]["c.memmap"]["object"]]
    assert c_ref.get("prefix") == base  # the intact leaf is still shared


def test_save_async_and_training_states_are_incremental_too(remote: Remote) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 2))
    model[0].requires_grad_(False)  # a frozen 1.44 MB weight
    with _mgr(remote, incremental=True) as mgr:
        mgr.save_async(1, {"model": model}).result()
        with torch.no_grad():
            model[1].weight += 1
        mgr.save_async(2, {"model": model}).result()
        record = _record(remote, 2)
        shared = [o for o in record["objects"] if "prefix" in o]
        assert len(shared) == 1  # the frozen weight
        fresh = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 2))
        mgr.restore_into({"model": fresh}, 2)
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a, b)


def test_ls_shows_each_remote_steps_own_bytes(
    remote: Remote, capsys: pytest.CaptureFixture[str]
) -> None:
    from tdckpt import cli

    td = _td()
    with _mgr(remote, incremental=True) as mgr:
        mgr.save(0, td)  # step 0: its shared bytes must count too
        td["b"] += 1
        mgr.save(1, td)
        sizes = {s.step: s.size for s in mgr.list_steps()}
        assert mgr.shared_bytes() == {0: 320_000 * 4 + 160_000 * 8, 1: 320_000 * 4 + 160_000 * 8}
    if remote.storage_options:
        return  # the CLI's S3 options are covered by test_remote_cli; memory:// below
    capsys.readouterr()
    assert cli.main(["ls", remote.url, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    shared = 320_000 * 4 + 160_000 * 8
    assert rows[0]["own_size"] == sizes[0] - shared
    assert rows[1]["own_size"] == sizes[1] - shared


@remote_timeout(lambda trials: 240)
def test_sigkill_at_every_stage_of_an_incremental_save_in_s3(s3_remote: Remote) -> None:
    """SIGKILL before the upload, before the commit, before retention deletes the base
    step's record and before it deletes the base's data: every listed step restores
    bit-exactly, before and after gc, and the objects a later record names survive."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from _remote_incremental_child import make

    from tdckpt.errors import LockError

    repo = Path(__file__).resolve().parents[1]
    expected = {"upload": [1], "commit": [1], "record": [1, 2], "data": [2]}
    for stage, steps in expected.items():
        url = f"{s3_remote.url}/{stage}"
        child = subprocess.run(
            [
                sys.executable,
                str(repo / "tests" / "_remote_incremental_child.py"),
                url,
                json.dumps(s3_remote.storage_options),
                stage,
            ],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=repo,
            env={**os.environ, "PYTHONPATH": f"{repo}:{repo / 'tests'}"},
            check=False,
        )
        assert "saved 1" in child.stdout, child.stderr
        assert child.returncode == -signal.SIGKILL, (stage, child.stdout, child.stderr)
        with CheckpointManager(url, storage_options=s3_remote.storage_options) as mgr:
            assert mgr.steps() == steps, stage
            for step in steps:
                assert _equal(mgr.restore(step), make(step)), (stage, step)
            deadline = time.monotonic() + 30
            while True:  # the dead child's lease expires after its 2 s ttl
                try:
                    mgr.gc(grace_period=0)
                    break
                except LockError:
                    assert time.monotonic() < deadline, "the dead writer's lease never expired"
                    time.sleep(0.25)
            assert mgr.steps() == steps, stage
            for step in steps:
                assert mgr.verify(step).ok, (stage, step)
                assert _equal(mgr.restore(step), make(step)), (stage, step)


def test_verify_steps_reads_an_object_several_records_name_once(remote: Remote) -> None:
    td = _td()
    with _mgr(remote, incremental=True) as mgr:
        for step in (1, 2, 3):
            td["b"] += 1
            mgr.save(step, td)
        reports = mgr.verify_steps()
        assert [r.step for r in reports] == [1, 2, 3] and all(r.ok for r in reports)
        assert [r.shared_checked for r in reports] == [0, 2, 2]  # a and c: read for step 1
        assert reports[1].files_checked == reports[0].files_checked
        assert reports[1].bytes_checked < reports[0].bytes_checked


def test_retention_removes_the_objects_only_a_retired_record_named() -> None:
    """An incremental record names objects of earlier attempts; once the steps that wrote
    them were retired, retiring the last record naming an object left it behind (a storage
    leak until someone ran gc). Retention now deletes them too - by name, no listing - and
    every object a kept record names stays."""
    import uuid

    import fsspec
    from tensordict import TensorDict

    url = f"memory://o{uuid.uuid4().hex[:12]}/run"
    fs = fsspec.filesystem("memory")
    td = TensorDict(a=torch.zeros(300_000), b=torch.zeros(300_000))  # an object each
    with CheckpointManager(url, incremental=True, retention=KeepLast(1)) as mgr:
        for step in range(1, 7):
            if step % 2 == 0:
                td["a"] += 1  # a changes every other step: later records name earlier objects
            td["b"] += 1
            mgr.save(step, td)
        assert mgr.steps() == [6]
        root = url.removeprefix("memory:/")
        named = set()
        for path in fs.find(root):
            if path.endswith(".tdckpt.json"):
                record = json.loads(fs.cat_file(path))
                own = f"{path.rsplit('/', 1)[1].split('.')[0]}.attempt-{record['attempt']}"
                named |= {f"{root}/{o.get('prefix') or own}/{o['name']}" for o in record["objects"]}
        objects = {p for p in fs.find(root) if ".attempt-" in p}
        assert objects == named, sorted(objects - named)
        assert mgr.gc(grace_period=0) == []
        assert torch.equal(mgr.restore()["a"], td["a"]) and mgr.verify().ok
