# ruff: noqa: F811  (pytest fixtures imported from _remote_fixtures are parameters here)
"""Faults in object storage (issue 15): a save SIGKILLed mid-upload, two writers racing one
step, a server answering 500s or losing the answer to a commit, bytes flipped at rest or
in transit. Never a committed broken step, never a silently wrong restore."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fsspec")
from _remote_fixtures import (  # noqa: F401
    Remote,
    _timeout,
    fast_failures,
    moto_s3,
    remote,
    remote_timeout,
    s3_remote,
)
from _remote_save_child import make

from tdckpt import CheckpointManager
from tdckpt._remote import store as _store
from tdckpt._remote.lease import Lease
from tdckpt.errors import CommitConflictError, IntegrityError, LockError, RemoteError

TensorDict = pytest.importorskip("tensordict").TensorDict
REPO = Path(__file__).resolve().parents[1]


def _equal(a: Any, b: Any) -> bool:
    keys = set(a.keys(True, True))
    return keys == set(b.keys(True, True)) and all(torch.equal(a[k], b[k]) for k in keys)


def _mgr(r: Remote, **kw: Any) -> Any:
    return CheckpointManager(r.url, storage_options=r.storage_options, **kw)


# -- a save killed mid-upload --------------------------------------------------------------


@remote_timeout(lambda trials: 60 + 60 * trials)  # a child process per trial
def test_save_killed_mid_upload_leaves_no_step(s3_remote: Remote, fault_trials: int) -> None:
    """SIGKILL at a random point of a save (after k uploads began, just before the commit,
    or at a random time): the step is listed iff it was committed, and then restores
    bit-exactly; step 1 is intact; gc clears the rest."""
    rng = random.Random(15)
    # A save of this state begins 7 uploads (put_file / put_bytes), so "upload:k" kills it
    # when upload k + 1 begins for k < 7; "upload:7" would let the save finish (30 trials
    # drew it, and the child was not killed).
    modes = ["commit", "upload:0"] + [
        rng.choice([f"upload:{rng.randint(1, 6)}", f"timer:{rng.uniform(0.05, 1.5):.2f}"])
        for _ in range(max(0, fault_trials - 2))
    ]
    for trial, mode in enumerate(modes[: max(fault_trials, 2)]):
        url = f"{s3_remote.url}/trial{trial}"
        child = subprocess.run(
            [
                sys.executable,
                str(REPO / "tests" / "_remote_save_child.py"),
                url,
                json.dumps(s3_remote.storage_options),
                mode,
            ],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=REPO,
            env={**__import__("os").environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
            check=False,
        )
        assert "saved 1" in child.stdout, child.stderr
        finished = "saved 2" in child.stdout
        if not mode.startswith("timer:"):
            assert child.returncode == -signal.SIGKILL, (mode, child.stdout, child.stderr)
        reader = CheckpointManager(url, storage_options=s3_remote.storage_options)
        steps = reader.steps()
        assert steps in ([1], [1, 2]), (mode, steps)
        if finished:
            assert steps == [1, 2]
        if mode == "commit" or mode.startswith("upload:"):
            assert steps == [1], mode
        assert _equal(reader.restore(1), make(1))
        if 2 in steps:
            assert _equal(reader.restore(2), make(2))
        # the dead child's lease expires after its (2 s) ttl; then gc clears its upload
        with CheckpointManager(url, storage_options=s3_remote.storage_options) as mgr:
            deadline = time.monotonic() + 30
            while True:
                try:
                    mgr.gc(grace_period=0)
                    break
                except LockError:
                    assert time.monotonic() < deadline, "the dead writer's lease never expired"
                    time.sleep(0.25)
            rows = mgr.list_steps()
            assert all(r.status == "committed" for r in rows), rows
            if 2 not in steps:
                mgr.save(2, make(2))  # the step can be saved again after the crash
            assert _equal(mgr.restore(2), make(2))


# -- two writers racing one step -----------------------------------------------------------


def test_two_writers_racing_one_step_exactly_one_commits(
    remote: Remote, fault_trials: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease is no fence (a stalled holder may still write): the conditional create of
    the commit record is. Both writers upload, meet at a barrier, then commit together."""
    monkeypatch.setattr(Lease, "renew", lambda self: None)  # both think they hold the root
    original = _store.Store.create
    for trial in range(fault_trials):
        barrier = threading.Barrier(2, timeout=30)

        def create(self: Any, rel: str, data: bytes, _b: threading.Barrier = barrier) -> None:
            if rel.endswith(".tdckpt.json"):
                _b.wait()
            original(self, rel, data)

        monkeypatch.setattr(_store.Store, "create", create)
        url = f"{remote.url}/race{trial}"
        tds = [make(10 + trial), make(20 + trial)]
        outcome: list[Any] = [None, None]

        def writer(
            i: int, tds: list[Any] = tds, url: str = url, outcome: list[Any] = outcome
        ) -> None:
            mgr = CheckpointManager(url, storage_options=remote.storage_options)
            try:
                outcome[i] = mgr.save(5, tds[i])
            except BaseException as exc:
                outcome[i] = exc

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        wins = [i for i in range(2) if isinstance(outcome[i], str)]
        losses = [i for i in range(2) if isinstance(outcome[i], CommitConflictError)]
        assert len(wins) == 1 and len(losses) == 1, outcome
        assert "another writer committed step 5" in str(outcome[losses[0]])
        monkeypatch.setattr(_store.Store, "create", original)
        reader = CheckpointManager(url, storage_options=remote.storage_options)
        assert reader.steps() == [5]
        assert _equal(reader.restore(5), tds[wins[0]])
        # the loser's upload was removed; nothing but the winner is left
        assert [(r.step, r.status) for r in reader.list_steps()] == [(5, "committed")]


# -- a server injecting errors -------------------------------------------------------------


def test_transient_500s_are_retried(s3_remote: Remote, fault_trials: int) -> None:
    s3 = s3_remote.s3
    assert s3 is not None
    for trial in range(fault_trials):
        rng = random.Random(trial)
        # every request fails with probability 0.15, independently
        s3.failing = lambda method, path, rng=rng: rng.random() < 0.15
        url = f"{s3_remote.url}/flaky{trial}"
        td = make(trial)
        with CheckpointManager(url, storage_options=s3_remote.storage_options) as mgr:
            mgr.save(1, td)
            target = make(99)
            mgr.restore_into(target)
            assert _equal(target, td)
            assert mgr.verify(1).ok
        s3.failing = None


def test_a_failing_store_is_a_clear_error_and_nothing_is_committed(
    s3_remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3 = s3_remote.s3
    assert s3 is not None
    options = fast_failures(s3_remote, monkeypatch).storage_options
    url = s3_remote.url
    with CheckpointManager(url, storage_options=options) as mgr:
        mgr.save(1, make(1))
        # every upload of step data fails
        s3.failing = lambda method, path: method == "PUT" and "/2.attempt-" in path
        with pytest.raises(RemoteError, match="failed 5 times") as info:
            mgr.save(2, make(2))
        assert "Nothing was committed" in str(info.value)
        s3.failing = None
        assert mgr.steps() == [1]
        # every ranged read fails: a clear error, the target untouched
        s3.failing = lambda method, path: method == "GET" and ".attempt-" in path
        target = make(7)
        with pytest.raises(RemoteError, match="ranged read"):
            mgr.restore_into(target)
        s3.failing = None
        assert _equal(target, make(7))
        assert _equal(mgr.restore(1), make(1))


def test_lost_answer_to_the_commit_is_not_a_conflict(
    s3_remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server applies the commit but the answer is lost (a 500 after the write): the
    retried conditional create finds this save's own record and the save succeeds once."""
    s3 = s3_remote.s3
    assert s3 is not None
    monkeypatch.setattr(_store, "BACKOFF_S", 0.001)
    options = s3_remote.storage_options
    fs = s3_remote.fs()
    done: list[str] = []
    original = _store.Store._create_once

    def applied_then_500(self: Any, path: str, data: bytes) -> None:
        original(self, path, data)
        if path.endswith("3.tdckpt.json") and not done:
            done.append("lost")
            raise OSError("connection reset after the request was sent (simulated)")

    monkeypatch.setattr(_store.Store, "_create_once", applied_then_500)
    with CheckpointManager(s3_remote.url, storage_options=options) as mgr:
        mgr.save(3, make(3))
        assert mgr.steps() == [3]
        assert _equal(mgr.restore(), make(3))
    assert "lost" in done
    assert len([p for p in fs.ls(s3_remote.path(), detail=False) if "attempt" in p]) == 1


def test_byte_flipped_at_rest_is_an_integrity_error(remote: Remote) -> None:
    with _mgr(remote) as mgr:
        mgr.save(1, make(1))
        mgr.save(2, make(2))
        fs = remote.fs()
        record = json.loads(fs.cat_file(remote.path("2.tdckpt.json")))
        loc = record["locations"]["big3.memmap"]
        obj = remote.path(
            f"2.attempt-{record['attempt']}/{record['objects'][loc['object']]['name']}"
        )
        data = bytearray(fs.cat_file(obj))
        data[loc["offset"] + 12345] ^= 0x01
        fs.pipe_file(obj, bytes(data))
        target = make(50)
        with pytest.raises(IntegrityError, match=r"big3\.memmap") as info:
            mgr.restore_into(target)
        assert info.value.problems[0].key == ("big3",)
        assert "target is unchanged" in str(info.value)
        assert _equal(target, make(50))
        with pytest.raises(IntegrityError):
            mgr.restore(2)
        assert _equal(mgr.restore(1), make(1))  # the earlier step is untouched


def test_byte_flipped_in_transit_is_read_again(
    remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tdckpt._read import object_storage

    original = object_storage._read_into
    flipped = []

    def flipping(store: Any, reads: list[tuple[str, int, memoryview]]) -> list[int]:
        got = original(store, reads)
        if not flipped and reads and got[0] > 10:  # the bytes land in the buffer as read
            flipped.append(reads[0][0])
            reads[0][2][5] ^= 0x80
        return got

    with _mgr(remote) as mgr:
        mgr.save(1, make(1))
        monkeypatch.setattr(object_storage, "_read_into", flipping)
        assert _equal(mgr.restore(), make(1))
    assert flipped
