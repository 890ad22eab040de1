# ruff: noqa: F811  (pytest fixtures imported from _remote_fixtures are parameters here)
"""Object storage refuses what is wrong before anything is touched (issue 22): gc never
deletes what a record might name, retention failing after a commit is a warning, every
control object read is capped, lease names parse robustly, errors name the URL."""

from __future__ import annotations

import inspect
import json
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("fsspec")
from _remote_fixtures import Remote, _timeout, moto_s3, remote, s3_remote  # noqa: F401

from tdckpt import CheckpointManager
from tdckpt._remote import store as _store
from tdckpt.errors import IncompleteCheckpointError
from tdckpt.warnings import TdckptWarning

TensorDict = pytest.importorskip("tensordict").TensorDict


def _td(seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(w=torch.randn(8, 4, generator=g), i=torch.arange(8) + seed, batch_size=[8])


def _equal(a: Any, b: Any) -> bool:
    keys = set(a.keys(True, True))
    return keys == set(b.keys(True, True)) and all(torch.equal(a[k], b[k]) for k in keys)


def _mgr(r: Remote, **kw: Any) -> Any:
    return CheckpointManager(r.url, storage_options=r.storage_options, **kw)


def _attempts(r: Remote, step: int) -> list[str]:
    fs = r.fs()
    return sorted(
        name.rstrip("/").rsplit("/", 1)[-1]
        for name in fs.ls(r.path(), detail=False)
        if name.rstrip("/").rsplit("/", 1)[-1].startswith(f"{step}.attempt-")
    )


# -- gc never deletes what a record might name ---------------------------------------------


def _newer_version(raw: dict[str, Any]) -> dict[str, Any]:
    return {**raw, "commit_version": raw["commit_version"] + 1, "shards": [1, 2]}


def _unknown_manifest_field(raw: dict[str, Any]) -> dict[str, Any]:
    return {**raw, "manifest": {**raw["manifest"], "signature": "ed25519:..."}}


def _other_step(raw: dict[str, Any]) -> dict[str, Any]:
    return {**raw, "step": raw["step"] + 1, "manifest": {**raw["manifest"], "step": None}}


def _missing_field(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k != "objects"}


MUTATIONS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "newer-commit-version": _newer_version,
    "unknown-manifest-field": _unknown_manifest_field,
    "record-of-another-step": _other_step,
    "missing-field": _missing_field,
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_gc_keeps_the_attempt_of_a_record_it_cannot_read(remote: Remote, mutation: str) -> None:
    """A record tdckpt cannot parse (a newer writer's, say) protects every attempt of its
    step: reported by gc (a warning naming it) and by ls / verify, never collected, even
    with grace_period=0. Once a reader that understands the record is back, the step
    restores bit-exactly."""
    if remote.kind == "s3" and mutation != "newer-commit-version":
        pytest.skip("one S3 case is enough: the store plays no part in the parse")
    with _mgr(remote) as mgr:
        mgr.save(1, _td(1))
        mgr.save(2, _td(2))
    fs = remote.fs()
    record = remote.path("2.tdckpt.json")
    original = bytes(fs.cat_file(record))
    fs.pipe_file(record, json.dumps(MUTATIONS[mutation](json.loads(original))).encode())
    (attempt,) = _attempts(remote, 2)
    with _mgr(remote) as mgr:
        with pytest.warns(TdckptWarning) as caught:
            line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
            removed = mgr.gc(grace_period=0)
        assert removed == []
        (w,) = caught
        text = str(w.message)
        assert text.startswith(f"{remote.url}/2.tdckpt.json: gc kept 1 attempt(s) of step 2")
        assert f"{remote.url}/{attempt}" in text and "cannot be read" in text
        assert (w.filename, w.lineno) == (__file__, line)
        assert _attempts(remote, 2) == [attempt]
        rows = [(r.step, r.kind, r.status) for r in mgr.list_steps()]
        assert rows == [
            (1, "remote", "committed"),
            (2, "remote", "damaged"),
            (2, "tmp", "damaged"),  # not "incomplete": nothing to collect
        ]
        report = mgr.verify(2)
        assert not report.ok and report.problems[0].path == "2.tdckpt.json"
        with pytest.raises(IncompleteCheckpointError, match="step 2 is not a committed"):
            mgr.restore(2)
    # a reader that understands the record (here: the original bytes) finds all the data
    fs.pipe_file(record, original)
    with _mgr(remote) as mgr:
        assert mgr.steps() == [1, 2]
        assert _equal(mgr.restore(2), _td(2)) and mgr.verify(2).ok


def test_gc_still_collects_attempts_of_readable_steps(remote: Remote) -> None:
    """The protection is per step: an unnamed attempt of a readable step (a lost race, a
    killed save) is collected as before, next to a protected one."""
    with _mgr(remote) as mgr:
        mgr.save(1, _td(1))
        mgr.save(2, _td(2))
    fs = remote.fs()
    fs.pipe_file(remote.path("1.attempt-" + "b" * 32 + "/data-0"), b"a killed save's upload")
    fs.pipe_file(remote.path("2.attempt-" + "c" * 32 + "/data-0"), b"another attempt of 2")
    record = remote.path("2.tdckpt.json")
    fs.pipe_file(record, b'{"commit_version": 99}')
    with _mgr(remote) as mgr, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        removed = mgr.gc(grace_period=0)
    assert removed == [f"{remote.url}/1.attempt-" + "b" * 32]
    assert len(_attempts(remote, 2)) == 2 and len(_attempts(remote, 1)) == 1
    (w,) = caught
    assert w.category is TdckptWarning and "gc kept 2 attempt(s) of step 2" in str(w.message)
    assert "version 99 is newer" in str(w.message)


# -- retention failing after the commit is a warning ----------------------------------------


def _fast_failures(s3_remote: Remote, monkeypatch: pytest.MonkeyPatch) -> Remote:
    """``s3_remote`` with retries cut short: a failing store fails in a second, not 40."""
    monkeypatch.setattr(_store, "BACKOFF_S", 0.001)
    monkeypatch.setattr("s3fs.S3FileSystem.retries", 1)
    options = {
        **(s3_remote.storage_options or {}),
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    return Remote(s3_remote.kind, s3_remote.url, options, s3_remote.s3)


def _deletes_fail(s3_remote: Remote) -> None:
    assert s3_remote.s3 is not None
    s3_remote.s3.failing = lambda method, path: (
        method in ("DELETE", "POST") and (".tdckpt-lease" not in path)
    )


def test_retention_failing_after_the_commit_warns_and_the_save_returns(
    s3_remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store refuses every delete after step 2's commit: save() returns the step's URL
    (committed, listed, restorable) with a TdckptWarning pointing at the caller, instead of
    a RemoteError claiming "Nothing was committed by this call"."""
    from tdckpt import KeepLast

    s3_remote = _fast_failures(s3_remote, monkeypatch)
    with _mgr(s3_remote, retention=KeepLast(1)) as mgr:
        mgr.save(1, _td(1))
        _deletes_fail(s3_remote)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
                url = mgr.save(2, _td(2))
        finally:
            assert s3_remote.s3 is not None
            s3_remote.s3.failing = None
        (w,) = caught
        text = str(w.message)
        assert w.category is TdckptWarning
        assert text.startswith(f"{s3_remote.url}/2.tdckpt.json: step 2 is committed, but ")
        assert "retention policy after it failed" in text and "prune() and gc()" in text
        assert "Nothing was committed" not in text.split("(", 1)[0]
        assert (w.filename, w.lineno) == (__file__, line)
        assert url.startswith(f"{s3_remote.url}/2.attempt-")
        assert mgr.steps() == [1, 2]  # the delete never happened: step 1 is still there
        assert _equal(mgr.restore(2), _td(2))
        # once the store answers again, prune finishes the job
        assert [str(p) for p in mgr.prune()] and mgr.steps() == [2]


def test_retention_failing_after_an_async_commit_warns_at_result(
    s3_remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on save_async's thread: the warning is issued where the result is asked."""
    from tdckpt import KeepLast

    s3_remote = _fast_failures(s3_remote, monkeypatch)
    with _mgr(s3_remote, retention=KeepLast(1)) as mgr:
        mgr.save(1, _td(1))
        _deletes_fail(s3_remote)
        try:
            future = mgr.save_async(2, _td(2))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
                url = future.result(timeout=60)
        finally:
            assert s3_remote.s3 is not None
            s3_remote.s3.failing = None
        (w,) = caught
        assert w.category is TdckptWarning and "step 2 is committed, but" in str(w.message)
        assert (w.filename, w.lineno) == (__file__, line)
        assert str(url).startswith(f"{s3_remote.url}/2.attempt-") and mgr.steps() == [1, 2]
