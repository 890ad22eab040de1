# ruff: noqa: F811  (pytest fixtures imported from _remote_fixtures are parameters here)
"""Object storage refuses what is wrong before anything is touched (issue 22): gc never
deletes what a record might name, retention failing after a commit is a warning, every
control object read is capped, lease names parse robustly, errors name the URL."""

from __future__ import annotations

import inspect
import json
import warnings
from collections.abc import Callable
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
    s3_remote,
)

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

    s3_remote = fast_failures(s3_remote, monkeypatch)
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
        assert "Nothing was committed" not in text and "delete of " in text
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

    s3_remote = fast_failures(s3_remote, monkeypatch)
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


# -- commit records: whatever their bytes, a damaged step, never a crash -------------------


RECORD_GARBAGE = {
    "version-a-string": b'{"commit_version": "2"}',
    "version-5000-digits": b'{"commit_version": ' + b"9" * 5000 + b"}",
    "version-a-float": b'{"commit_version": 3.0}',  # incremental records are version 2
    "nested-100000-deep": b"[" * 100_000 + b"]" * 100_000,
    "not-utf8": b"\xff\xfe{}",
    "a-list": b"[1, 2]",
}


@pytest.mark.parametrize("garbage", sorted(RECORD_GARBAGE))
def test_a_garbage_record_is_a_damaged_step_not_a_crash(garbage: str) -> None:
    """steps(), ls, gc and verify all go on: the record is listed damaged, its attempt kept."""
    import uuid

    r = Remote("memory", f"memory://t{uuid.uuid4().hex[:12]}/run", None)
    with _mgr(r) as mgr:
        mgr.save(1, _td(1))
        mgr.save(2, _td(2))
    r.fs().pipe_file(r.path("2.tdckpt.json"), RECORD_GARBAGE[garbage])
    with _mgr(r) as mgr:
        assert mgr.steps() == [1]
        rows = [(row.step, row.kind, row.status) for row in mgr.list_steps()]
        assert rows == [(1, "remote", "committed"), (2, "remote", "damaged"), (2, "tmp", "damaged")]
        detail = mgr.list_steps()[1].detail
        assert detail.startswith(f"{r.url}/2.tdckpt.json: ") and len(detail) < 600
        if garbage == "version-a-float":  # 3.0 is version 3 to pydantic: newer, not valid
            assert "version 3.0 is newer than this tdckpt reads" in detail
        with pytest.warns(TdckptWarning, match="gc kept 1 attempt"):
            assert mgr.gc(grace_period=0) == []
        assert not mgr.verify(2).ok
        assert _equal(mgr.restore(), _td(1))


def test_an_oversized_record_is_damaged_from_its_listed_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record over MAX_RECORD_BYTES is refused from its listed size, unread."""
    import uuid

    from tdckpt._remote import layout

    monkeypatch.setattr(layout, "MAX_RECORD_BYTES", 4096)
    r = Remote("memory", f"memory://t{uuid.uuid4().hex[:12]}/run", None)
    with _mgr(r) as mgr:
        mgr.save(1, _td(1))
        r.fs().pipe_file(r.path("2.tdckpt.json"), b" " * 10_000)
        (row,) = [row for row in mgr.list_steps() if row.status == "damaged"]
        assert row.detail == (
            f"{r.url}/2.tdckpt.json: 10000 bytes, more than 4096, too large for a commit "
            "record; it was not read."
        )
        assert mgr.steps() == [1]


def test_capped_read_never_reads_past_the_cap(remote: Remote) -> None:
    """Store.cat_capped asks the store for at most cap + 1 bytes (one ranged read) and
    refuses a larger object with an error naming its URL."""
    from tdckpt._remote.store import open_store
    from tdckpt.errors import MetadataError

    store = open_store(remote.url, remote.storage_options)
    store.put_bytes("big", b"x" * (3 << 20))
    store.put_bytes("small", b"y" * 100)
    seen: list[int] = []
    cat_file = store.fs.cat_file

    def counting(path: str, *args: Any, **kwargs: Any) -> Any:
        out = cat_file(path, *args, **kwargs)
        seen.append(len(out))
        return out

    store.fs.cat_file = counting
    try:
        with pytest.raises(MetadataError) as info:
            store.cat_capped("big", 1 << 20, "lease record")
        assert str(info.value) == (
            f"{remote.url}/big: more than 1048576 bytes, too large for a lease record; it "
            "was not read. It is not a lease record tdckpt wrote: delete or replace it."
        )
        assert info.value.path == f"{remote.url}/big"  # type: ignore[attr-defined]
        assert store.cat_capped("small", 1 << 20, "lease record") == b"y" * 100
    finally:
        del store.fs.cat_file
    assert seen == [(1 << 20) + 1, 100]


# -- the lease: hostile records and names ---------------------------------------------------


def _lease_record(**fields: Any) -> bytes:
    import time

    now = time.time()
    record = {"owner": "f" * 32, "host": "h", "pid": 1, "written": now, "expires": now + 600}
    return json.dumps({**record, **fields}).encode()


def test_a_lease_with_a_20_mib_host_is_not_read_whole_nor_shown(remote: Remote) -> None:
    """A lease record past MAX_CONTROL_BYTES is not a record tdckpt wrote: it is read up to
    the cap only and treated as damaged (expired, as unparsable records are); the first save
    takes the root. One under the cap but with a long host is refused with a short message."""
    fs = remote.fs()
    fs.pipe_file(
        remote.path(".tdckpt-lease/000000000001.json"), _lease_record(host="h" * (20 << 20))
    )
    with _mgr(remote) as mgr:
        mgr.save(1, _td(1))
        assert mgr.steps() == [1]
    fs.pipe_file(remote.path(".tdckpt-lease/000000000009.json"), _lease_record(host="x" * 500_000))
    from tdckpt.errors import LockError

    with pytest.raises(LockError) as info, _mgr(remote) as mgr:
        mgr.save(2, _td(2))
    text = str(info.value)
    assert text.startswith(f"{remote.url}/.tdckpt-lease: another writer holds this root's lease")
    assert len(text) < 800 and "x" * 61 not in text and "xxx..." in text
    assert len(repr(info.value.holder)) < 400  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "expires",
    ["1e999", "1" + "0" * 400, '"soon"', "true", "NaN", "[1]"],
)
def test_a_lease_expiry_that_is_no_time_is_expired(remote: Remote, expires: str) -> None:
    if remote.kind == "s3" and expires != "1" + "0" * 400:
        pytest.skip("one S3 case is enough")
    import time

    now = time.time()
    fields = f'"owner": "other", "host": "h", "pid": 1, "written": {now!r}, "expires": {expires}'
    raw = ("{" + fields + "}").encode()
    remote.fs().pipe_file(remote.path(".tdckpt-lease/000000000003.json"), raw)
    if expires == "1e999":  # json reads it as inf: a lease that never expires, honestly held
        from tdckpt.errors import LockError

        with pytest.raises(LockError, match="expires in inf s"), _mgr(remote) as mgr:
            mgr.save(1, _td(1))
        return
    with _mgr(remote) as mgr:
        mgr.save(1, _td(1))
        assert mgr.steps() == [1]


def test_a_lease_generation_at_the_12_digit_ceiling_does_not_lock_out(remote: Remote) -> None:
    """Generation 999999999999 (an expired holder): the next is 1000000000000, named one digit
    wider and compared as a number; saves, renewals and close all work."""
    fs = remote.fs()
    lease = remote.path(".tdckpt-lease")
    fs.pipe_file(f"{lease}/999999999999.json", _lease_record(expires=1.0))
    with _mgr(remote, lease_ttl=0.5) as mgr:
        mgr.save(1, _td(1))
        import time

        time.sleep(0.3)  # past half the ttl: the next save renews into a new generation
        mgr.save(2, _td(2))
        names = sorted(n.rsplit("/", 1)[-1] for n in fs.ls(lease, detail=False))
        assert names == ["1000000000001.json"]
        assert mgr.steps() == [1, 2]
    fs.invalidate_cache()
    assert not fs.exists(lease) or fs.ls(lease, detail=False) == []  # released


def test_the_largest_lease_generation_is_refused_clearly(remote: Remote) -> None:
    fs = remote.fs()
    top = "9" * 40
    fs.pipe_file(remote.path(f".tdckpt-lease/{top}.json"), _lease_record(expires=1.0))
    from tdckpt.errors import LockError

    with pytest.raises(LockError) as info, _mgr(remote) as mgr:
        mgr.save(1, _td(1))
    assert str(info.value).startswith(
        f"{remote.url}/.tdckpt-lease: the lease generation has reached the largest"
    )
    assert "delete the objects under" in str(info.value)


def test_garbage_lease_names_are_ignored(remote: Remote) -> None:
    """Names tdckpt never writes are ignored (not parsed into a crash, not deleted): other
    suffixes, non-canonical or too long numbers, a folder named like a generation."""
    fs = remote.fs()
    lease = remote.path(".tdckpt-lease")
    garbage = [
        "notes.txt",
        "abc.json",
        "7.json",  # not zero-padded
        "0000000000007.json",  # 13 digits with a leading zero: not canonical
        "9" * 300 + ".json",
        "٣٣٣٣٣٣٣٣٣٣٣٣.json",  # Arabic-Indic digits: str.isdigit, not ASCII
        "000000000005.json/inner",  # a "folder" named like a generation
    ]
    for name in garbage:
        fs.pipe_file(f"{lease}/{name}", _lease_record())
    with _mgr(remote) as mgr:
        mgr.save(1, _td(1))
        mgr.save(2, _td(2))
        assert mgr.steps() == [1, 2]
    left = {n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(lease, detail=False)}
    assert {g.split("/")[0] for g in garbage} <= left


# -- every error names the URL, never the private local copy --------------------------------


def _no_local(exc: BaseException, url: str) -> None:
    text = str(exc) + repr(getattr(exc, "facts", ""))
    assert url in text, text
    for private in ("tdckpt-url-", "tdckpt-restore-", "/dev/shm", "/tmp/"):
        assert private not in text, text


def test_errors_reading_a_url_prefix_name_the_url(remote: Remote, tmp_path: Any) -> None:
    import tdckpt
    from tdckpt.errors import TdckptError

    local = tmp_path / "td"
    _td(1).memmap(local)
    fs = remote.fs()
    for f in local.iterdir():
        fs.put_file(str(f), remote.path(f"x/{f.name}"))
    fs.pipe_file(remote.path("x/meta.json"), b"{not json")
    url = f"{remote.url}/x"
    opts = remote.storage_options
    with pytest.raises(TdckptError) as info:
        tdckpt.load_memmap(url, storage_options=opts)
    _no_local(info.value, url)
    assert str(info.value).startswith(f"{url}: ")
    assert getattr(info.value, "prefix", url) == url
    target = _td(5)
    with pytest.raises(TdckptError) as info:
        tdckpt.load_memmap_(target, url, storage_options=opts)
    _no_local(info.value, url)
    assert _equal(target, _td(5))
    report = tdckpt.validate(url, storage_options=opts)
    assert not report.ok and str(report.prefix) == url


def test_errors_restoring_a_step_name_its_url(remote: Remote) -> None:
    """A step whose record and bytes agree (checksums pass) but whose meta.json is wrong:
    the local engine's refusal names the step's URL, not the temporary download folder."""
    from tdckpt._write.checksum import new_hasher
    from tdckpt.errors import TdckptError

    with _mgr(remote) as mgr:
        mgr.save(1, _td(1))
        step_url = mgr.path(1)
    fs = remote.fs()
    record_path = remote.path("1.tdckpt.json")
    record = json.loads(fs.cat_file(record_path))
    loc = record["locations"]["meta.json"]
    data_path = remote.path(
        f"1.attempt-{record['attempt']}/{record['objects'][loc['object']]['name']}"
    )
    blob = bytearray(fs.cat_file(data_path))
    (entry,) = [f for f in record["manifest"]["files"] if f["path"] == "meta.json"]
    meta = bytes(blob[loc["offset"] : loc["offset"] + entry["size"]])
    assert b'"shape": [8, 4]' in meta
    bad = meta.replace(b'"shape": [8, 4]', b'"shape": [9, 4]')
    blob[loc["offset"] : loc["offset"] + entry["size"]] = bad
    h = new_hasher(entry["checksum"].split(":")[0])
    h.update(bad)
    entry["checksum"] = f"{entry['checksum'].split(':')[0]}:{h.hexdigest()}"
    fs.pipe_file(data_path, bytes(blob))
    fs.pipe_file(record_path, json.dumps(record).encode())
    with _mgr(remote) as mgr:
        with pytest.raises(TdckptError) as info:
            mgr.restore(1)
        _no_local(info.value, step_url)
        target = _td(3)
        with pytest.raises(TdckptError) as info:
            mgr.restore_into(target, 1)
        _no_local(info.value, step_url)
        assert _equal(target, _td(3))


def test_an_oversized_metadata_file_at_a_url_is_refused_unfetched(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A meta.json over the reader's cap is never downloaded: it is refused from its listed
    size, and the error names the URL. Nothing else is fetched either: a restore whose
    metadata is refused reads no leaf."""
    import uuid

    import fsspec

    import tdckpt
    from tdckpt._read import storage
    from tdckpt.errors import TdckptError

    monkeypatch.setattr(storage, "MAX_JSON_BYTES", 4096)
    local = tmp_path / "td"
    _td(1).memmap(local)
    url = f"memory://t{uuid.uuid4().hex[:12]}/x"
    fs = fsspec.filesystem("memory")
    for f in local.iterdir():
        fs.put_file(str(f), f"{url[len('memory://') - 1 :]}/{f.name}")
    meta = (local / "meta.json").read_bytes()
    fs.pipe_file(f"{url[len('memory://') - 1 :]}/meta.json", meta.rstrip() + b" " * 10_000)
    asked: list[str] = []
    cat_ranges = fs.cat_ranges

    def spy(paths: list[str], *args: Any, **kwargs: Any) -> Any:
        asked.extend(paths)
        return cat_ranges(paths, *args, **kwargs)

    monkeypatch.setattr(fs, "cat_ranges", spy)
    with pytest.raises(TdckptError) as info:
        tdckpt.load_memmap(url)
    _no_local(info.value, url)
    assert "it was not fetched" in str(info.value)
    assert asked == []


# -- tdckpt.save of a URL -------------------------------------------------------------------


def _nested_td() -> TensorDict:
    return TensorDict(
        a=torch.arange(6.0).reshape(2, 3),
        nested=TensorDict(b=torch.ones(2, 4, dtype=torch.int16), batch_size=[2]),
        batch_size=[2],
    )


def test_save_to_a_url_round_trips_and_writes_nothing_local(
    remote: Remote, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tdckpt.save(td, url)`` then ``tdckpt.load_memmap(url)``: the same tensors, a plain
    prefix of objects (one per file, as tensordict's memmap writes them, with tdckpt's
    manifest), and no local folder named after the scheme (it used to write ``memory:``)."""
    import tdckpt
    from tdckpt.schema import MANIFEST_NAME

    monkeypatch.chdir(tmp_path)
    td = _nested_td()
    url = f"{remote.url}/ckpt"
    manifest = tdckpt.save(td, url, metadata={"epoch": 3}, storage_options=remote.storage_options)
    assert manifest.user_metadata == {"epoch": 3}
    got = tdckpt.load_memmap(url, storage_options=remote.storage_options)
    assert torch.equal(got["a"], td["a"]) and torch.equal(got["nested", "b"], td["nested", "b"])
    assert got.batch_size == td.batch_size
    fs = remote.fs()
    names = sorted(p.removeprefix(remote.path("ckpt") + "/") for p in fs.find(remote.path("ckpt")))
    assert names == sorted(
        ["a.memmap", "meta.json", MANIFEST_NAME, "nested/b.memmap", "nested/meta.json"]
    )
    assert list(tmp_path.iterdir()) == []  # nothing local: no "memory:" / "s3:" folder
    # a plain tensordict reads it after a download (the objects are its files)
    fs.get(remote.path("ckpt"), str(tmp_path / "down"), recursive=True)
    from tensordict import TensorDict as TD

    assert torch.equal(TD.load_memmap(tmp_path / "down")["nested", "b"], td["nested", "b"])


def test_save_to_a_url_refuses_what_it_cannot_do_all_or_nothing(
    remote: Remote, tmp_path: Path
) -> None:
    """An existing prefix or object is never replaced (no atomic rename in object storage),
    nor is ``overwrite=True`` accepted, nor the consolidated layout; each before anything is
    written. A ``.tdz`` URL gets one archive object."""
    import tdckpt
    from tdckpt.errors import CheckpointExistsError

    opts = remote.storage_options
    url = f"{remote.url}/ckpt"
    tdckpt.save(_nested_td(), url, storage_options=opts)
    before = sorted(remote.fs().find(remote.path("ckpt")))
    with pytest.raises(CheckpointExistsError) as info:
        tdckpt.save(_td(1), url, storage_options=opts)
    assert str(info.value).startswith(f"{url}: 5 object(s) already lie under this prefix")
    assert "nothing was written" in str(info.value) and "recursive=True" in str(info.value)
    for kwargs, words in (
        ({"overwrite": True}, "overwrite=True replaces a checkpoint all or nothing"),
        ({"layout": "consolidated"}, "a URL holds the memmap layout"),
    ):
        with pytest.raises(ValueError, match=words):
            tdckpt.save(_td(1), f"{remote.url}/other", storage_options=opts, **kwargs)
    assert sorted(remote.fs().find(remote.path("ckpt"))) == before
    assert remote.fs().find(remote.path("other")) == []
    # a .tdz URL is one archive object (one PUT: all or nothing), never replaced either
    tdckpt.save(_td(2), f"{remote.url}/one.tdz", storage_options=opts)
    got = tdckpt.load_memmap(f"{remote.url}/one.tdz", storage_options=opts)
    assert torch.equal(got["w"], _td(2)["w"])
    with pytest.raises(CheckpointExistsError, match="an object already lies at this URL"):
        tdckpt.save(_td(3), f"{remote.url}/one.tdz", storage_options=opts)
    assert torch.equal(
        tdckpt.load_memmap(f"{remote.url}/one.tdz", storage_options=opts)["w"], _td(2)["w"]
    )
    with pytest.raises(ValueError, match="storage_options are for fsspec URLs"):
        tdckpt.save(_td(1), tmp_path / "local-folder", storage_options={"anon": True})
    assert not (tmp_path / "local-folder").exists()  # refused before anything is written


def test_save_to_a_url_uploads_the_root_metadata_last(s3_remote: Remote) -> None:
    """A failed upload leaves no readable checkpoint: the root ``meta.json`` is the last
    object written, so a load finds none, and the error says what was left and the fix."""
    import tdckpt
    from tdckpt.errors import CheckpointNotFoundError, RemoteError

    s3 = s3_remote.s3
    assert s3 is not None
    url = f"{s3_remote.url}/ckpt"
    s3.failing = lambda method, path: method == "PUT" and path.endswith("/ckpt/meta.json")
    try:
        with pytest.raises(RemoteError) as info:
            tdckpt.save(_nested_td(), url, storage_options=s3_remote.storage_options)
    finally:
        s3.failing = None
    text = str(info.value)
    assert text.startswith(f"{url}: tdckpt.save could not upload meta.json (")
    assert "4 object(s) were uploaded without the root meta.json" in text
    assert info.value.key == "meta.json"  # type: ignore[attr-defined]
    # what was uploaded is not taken for a checkpoint
    with pytest.raises(CheckpointNotFoundError, match=r"no meta\.json"):
        tdckpt.load_memmap(url, storage_options=s3_remote.storage_options)


# -- reads are sized by the store's listing, not by the record -----------------------------


def test_a_record_claiming_a_huge_object_is_refused_from_the_listing(remote: Remote) -> None:
    """A record (checksums and all) claiming a 16 GiB object that holds 1 MiB: restore and
    verify report the file short from one listing, without planning 16 GiB of reads."""
    from tdckpt.errors import IntegrityError

    with _mgr(remote) as mgr:
        mgr.save(1, TensorDict(big=torch.zeros(1 << 18), batch_size=[]))  # 1 MiB: own object
    fs = remote.fs()
    record_path = remote.path("1.tdckpt.json")
    record = json.loads(fs.cat_file(record_path))
    loc = record["locations"]["big.memmap"]
    (entry,) = [f for f in record["manifest"]["files"] if f["path"] == "big.memmap"]
    entry["size"] = 1 << 34
    record["objects"][loc["object"]]["size"] = loc["offset"] + (1 << 34)
    fs.pipe_file(record_path, json.dumps(record).encode())
    name = record["objects"][loc["object"]]["name"]
    held = fs.info(remote.path(f"1.attempt-{record['attempt']}/{name}"))["size"]
    with _mgr(remote) as mgr:
        report = mgr.verify(1)
        (p,) = report.problems
        assert (p.path, p.kind) == ("big.memmap", "short")
        assert (
            p.found
            == f"object {name} holds {held} bytes, the record says {(1 << 34) + loc['offset']}"
        )
        with pytest.raises(IntegrityError, match="step 1 is damaged in the store"):
            mgr.restore(1)


# -- gc: a record committed while gc runs, a store without times -----------------------------


def test_gc_rereads_the_record_before_deleting(remote: Remote) -> None:
    """A record that appears after gc listed the root (a commit landing meanwhile) is read
    again just before the attempt is deleted: the attempt stays."""
    with _mgr(remote) as mgr:
        mgr.save(1, _td(1))
    fs = remote.fs()
    record_path = remote.path("1.tdckpt.json")
    record = bytes(fs.cat_file(record_path))
    fs.rm_file(record_path)  # as if the commit had not landed yet
    (attempt,) = _attempts(remote, 1)
    with _mgr(remote) as mgr:
        find = mgr.store.find

        def commit_lands(rel: str) -> Any:
            out = find(rel)
            if rel == attempt:  # gc is about to decide on the attempt: the commit lands
                fs.pipe_file(record_path, record)
            return out

        mgr.store.find = commit_lands
        assert mgr.gc(grace_period=0) == []
        del mgr.store.find
        assert _attempts(remote, 1) == [attempt] and mgr.steps() == [1]
        assert _equal(mgr.restore(1), _td(1))


def test_gc_keeps_attempts_of_unknown_age_until_grace_period_zero(remote: Remote) -> None:
    """A store whose listing gives no modification times: an unnamed attempt's age is
    unknown (it may be uploading), so only gc(grace_period=0) removes it."""
    with _mgr(remote) as mgr:
        mgr.save(1, _td(1))
        stale = "5.attempt-" + "d" * 32
        remote.fs().pipe_file(remote.path(f"{stale}/data-0"), b"x")
        find = mgr.store.find
        times = ("LastModified", "mtime", "created", "updated", "last_modified")

        def timeless(rel: str) -> Any:
            return {k: {f: x for f, x in v.items() if f not in times} for k, v in find(rel).items()}

        mgr.store.find = timeless
        assert mgr.gc(grace_period=3600) == []
        assert mgr.gc(grace_period=0) == [f"{remote.url}/{stale}"]
        del mgr.store.find


def test_a_permission_refusal_names_the_url() -> None:
    """A definite refusal (403, EACCES) is a RemoteError naming the object's URL and the
    fix, not the filesystem library's bare PermissionError."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from _unprivileged import run_unprivileged

    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    base = Path(tempfile.mkdtemp(prefix="tdckpt-perm-"))  # under /tmp: others may traverse
    os.chmod(base, 0o755)
    root = base / "run"
    url = f"file://{root}"
    with CheckpointManager(url) as mgr:
        mgr.save(1, _td(1))
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        os.chmod(d, 0o755)
    (root / "1.tdckpt.json").chmod(0o000)

    def read() -> object:
        from tdckpt.errors import RemoteError

        try:
            CheckpointManager(url).steps()
        except RemoteError as exc:
            return (str(exc), exc.path)  # type: ignore[attr-defined]
        return None

    try:
        result = run_unprivileged(read)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert result is not None
    message, path = result  # type: ignore[misc]
    assert path == f"{url}/1.tdckpt.json"
    assert message.startswith(f"{url}/1.tdckpt.json: read refused by the store (PermissionError")
    assert "credentials and permissions" in message


def test_objects_under_a_record_name_protect_the_step(remote: Remote) -> None:
    """``3.tdckpt.json/...`` (a prefix where step 3's record belongs) is not a record, but
    gc cannot prove it names nothing: step 3's attempts are kept and it is listed damaged."""
    with _mgr(remote) as mgr:
        mgr.save(1, _td(1))
    fs = remote.fs()
    fs.pipe_file(remote.path("3.tdckpt.json/part-0"), b"{}")
    fs.pipe_file(remote.path("3.attempt-" + "e" * 32 + "/data-0"), b"x")
    with _mgr(remote) as mgr:
        with pytest.warns(TdckptWarning, match="a prefix of objects where the step's commit"):
            assert mgr.gc(grace_period=0) == []
        assert [(r.step, r.status) for r in mgr.list_steps()] == [
            (1, "committed"),
            (3, "damaged"),
            (3, "damaged"),
        ]
        assert mgr.steps() == [1]


def test_cli_gc_reports_what_it_keeps(remote: Remote, capsys: pytest.CaptureFixture[str]) -> None:
    """`tdckpt gc URL --grace-period 0`: exit 0, nothing removed, one warning line naming the
    kept attempt; `ls` shows it damaged, not incomplete."""
    from tdckpt.cli import main

    with _mgr(remote) as mgr:
        mgr.save(1, _td(1))
        mgr.save(2, _td(2))
    fs = remote.fs()
    record = remote.path("2.tdckpt.json")
    fs.pipe_file(record, json.dumps(_newer_version(json.loads(fs.cat_file(record)))).encode())
    flags: list[str] = []
    for key, value in (remote.storage_options or {}).items():
        flags += ["--storage-option", f"{key}={json.dumps(value)}"]
    (attempt,) = _attempts(remote, 2)
    assert main(["gc", remote.url, "--grace-period", "0", "--json", *flags]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == []
    assert out.err.startswith(f"warning: {remote.url}/2.tdckpt.json: gc kept 1 attempt(s)")
    assert f"{remote.url}/{attempt}" in out.err
    assert main(["ls", remote.url, "--json", *flags]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["kind"], r["status"]) for r in rows][1:] == [
        (2, "remote", "damaged"),
        (2, "tmp", "damaged"),
    ]
    assert _attempts(remote, 2) == [attempt]


@pytest.mark.parametrize("clash", ["manifest-itself", "file-and-folder"])
def test_a_record_whose_files_cannot_all_exist_is_damaged(clash: str) -> None:
    """Paths that cannot all be files of one folder (the manifest's own name among them, or
    ``meta.json`` both a file and a folder) make the record invalid: listed damaged, its
    attempt kept, never a raw OSError about the temporary download folder."""
    import uuid

    r = Remote("memory", f"memory://t{uuid.uuid4().hex[:12]}/run", None)
    with _mgr(r) as mgr:
        mgr.save(1, _td(1))
    fs = r.fs()
    path = r.path("1.tdckpt.json")
    record = json.loads(fs.cat_file(path))
    new = "tdckpt.manifest.json" if clash == "manifest-itself" else "meta.json/w.memmap"
    for f in record["manifest"]["files"]:
        if f["path"] == "w.memmap":
            f["path"] = new
    record["manifest"]["files"].sort(key=lambda f: f["path"])
    record["locations"][new] = record["locations"].pop("w.memmap")
    fs.pipe_file(path, json.dumps(record).encode())
    with _mgr(r) as mgr:
        (row,) = [row for row in mgr.list_steps() if row.kind == "remote"]
        assert row.status == "damaged"
        expected = (
            "lists tdckpt.manifest.json itself"
            if clash == "manifest-itself"
            else ("['meta.json'] are listed as files and as folders of other files")
        )
        assert expected in row.detail, row.detail
        with pytest.raises(IncompleteCheckpointError) as info:
            mgr.restore(1)
        _no_local(info.value, f"{r.url}/1.tdckpt.json")


def test_a_record_with_a_file_without_checksum_is_damaged() -> None:
    """Where a file lies in object storage is the record's word, and only the file's
    checksum checks it: a record whose manifest lists a file without one (tdckpt writes one
    for every file) is damaged. Before, a record whose location of a file was moved onto
    another file's bytes and whose checksum of it was deleted restored those bytes in its
    place (found by tests/property/test_fuzz_steps.py)."""
    import uuid

    r = Remote("memory", f"memory://t{uuid.uuid4().hex[:12]}/run", None)
    with _mgr(r) as mgr:
        mgr.save(1, _td(1))
        mgr.save(2, _td(2))
    fs = r.fs()
    path = r.path("2.tdckpt.json")
    record = json.loads(fs.cat_file(path))
    for f in record["manifest"]["files"]:
        if f["path"] == "w.memmap":
            del f["checksum"]
    fs.pipe_file(path, json.dumps(record).encode())
    with _mgr(r) as mgr:
        assert mgr.steps() == [1]
        (row,) = [row for row in mgr.list_steps() if row.kind == "remote" and row.step == 2]
        assert row.status == "damaged"
        assert "['w.memmap'] have no checksum" in row.detail, row.detail
        with pytest.raises(IncompleteCheckpointError) as info:
            mgr.restore(2)
        _no_local(info.value, f"{r.url}/2.tdckpt.json")
        assert _equal(mgr.restore(1), _td(1))


def test_a_url_prefix_with_an_object_that_is_also_a_folder_is_refused(
    s3_remote: Remote, tmp_path: Any
) -> None:
    """``meta.json`` and ``meta.json/x`` both exist (possible in S3, not in a folder):
    refused up front, naming the URL, instead of an OSError about the download folder."""
    import tdckpt
    from tdckpt.errors import UnsafePathError

    local = tmp_path / "td"
    _td(1).memmap(local)
    fs = s3_remote.fs()
    for f in local.iterdir():
        fs.put_file(str(f), s3_remote.path(f"x/{f.name}"))
    fs.pipe_file(s3_remote.path("x/meta.json/stray"), b"x")
    url = f"{s3_remote.url}/x"
    with pytest.raises(UnsafePathError) as info:
        tdckpt.load_memmap(url, storage_options=s3_remote.storage_options)
    assert str(info.value).startswith(f"{url}/meta.json: an object that is also the prefix")
    _no_local(info.value, url)


def test_a_retried_commit_reads_at_most_its_own_size(
    remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer to the commit is lost and, meanwhile, a 3 MiB object took the record's
    name: the retry compares at most len(record) + 1 bytes (not the whole object), finds it
    is not this save's record, and the save is a CommitConflictError."""
    from tdckpt.errors import CommitConflictError

    monkeypatch.setattr(_store, "BACKOFF_S", 0.001)
    original = _store.Store._create_once
    read: list[int] = []

    def taken_then_lost(self: Any, path: str, data: bytes) -> None:
        if path.endswith("3.tdckpt.json") and not read:
            self.fs.pipe_file(path, b" " * (3 << 20))  # another object took the name
            cat_file = self.fs.cat_file

            def spy(p: str, *args: Any, **kwargs: Any) -> Any:
                out = cat_file(p, *args, **kwargs)
                if p == path:
                    read.append(len(out))
                return out

            monkeypatch.setattr(self.fs, "cat_file", spy)
            raise OSError("connection reset after the request was sent (simulated)")
        original(self, path, data)

    monkeypatch.setattr(_store.Store, "_create_once", taken_then_lost)
    with _mgr(remote) as mgr, pytest.raises(CommitConflictError):
        mgr.save(3, _td(3))
    assert read and max(read) < 64 << 10


def test_a_record_with_a_lone_surrogate_is_damaged_not_a_crash() -> None:
    """JSON may escape a lone surrogate (``"\\udcff"``) that UTF-8 cannot encode: Python's
    json reads it, and the record's manifest could then never be written out again. Such a
    record (tdckpt never writes one) is a damaged step, listed as such and never restored;
    before, every restore of the newest step died in a raw PydanticSerializationError."""
    import uuid

    r = Remote("memory", f"memory://t{uuid.uuid4().hex[:12]}/run", None)
    with _mgr(r) as mgr:
        mgr.save(1, _td(1))
        mgr.save(2, _td(2), metadata={"note": "x"})
    fs = r.fs()
    path = r.path("2.tdckpt.json")
    data = fs.cat_file(path)
    assert b'"note": "x"' in data
    fs.pipe_file(path, data.replace(b'"note": "x"', b'"note": "\\udcff"'))
    with _mgr(r) as mgr:
        assert mgr.steps() == [1]
        (row,) = [row for row in mgr.list_steps() if row.kind == "remote" and row.step == 2]
        assert row.status == "damaged"
        assert "not a valid tdckpt commit record" in row.detail, row.detail
        assert "surrogate" in row.detail, row.detail
        with pytest.raises(IncompleteCheckpointError) as info:
            mgr.restore(2)
        _no_local(info.value, f"{r.url}/2.tdckpt.json")
        assert _equal(mgr.restore(), _td(1))
        with pytest.warns(TdckptWarning, match=r"gc kept 1 attempt\(s\) of step 2.*surrogates"):
            mgr.gc(grace_period=0)
    assert fs.cat_file(path) == data.replace(b'"note": "x"', b'"note": "\\udcff"')  # kept


def test_a_root_whose_url_has_glob_characters_is_really_cleaned(remote: Remote) -> None:
    """fsspec's ``rm`` reads paths as glob patterns: under ``.../exp[lr=0.1]`` it matched
    nothing, so retention, gc and a failed save's cleanup deleted nothing while gc listed
    the attempts as removed. Objects are now deleted by their exact names."""
    from dataclasses import replace

    from tdckpt.retention import KeepLast

    r = replace(remote, url=remote.url + "/exp[lr=0.1]*?")
    fs = r.fs()
    with _mgr(r, retention=KeepLast(1)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _td(step))
        assert mgr.steps() == [3]
        assert mgr.gc(grace_period=0) == []
        assert _equal(mgr.restore(), _td(3))
    left = sorted(p.rsplit("/", 2)[-2] for p in fs.find(r.path()) if "attempt" in p)
    assert len(left) == 1 and left[0].startswith("3.attempt-"), left
    assert not [p for p in fs.find(r.path()) if "/1." in p or "/2." in p]


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_a_selective_restore_is_not_stopped_by_a_leaf_it_leaves_out(
    remote: Remote, damage: str
) -> None:
    """As on a local root (docs/remote.rst): a leaf a selective restore does not select is
    never read, so the loss of its object does not stop it; a whole restore, restore_into
    and verify still refuse or report it, the target unchanged. Before, opening the step
    refused it for any damaged object."""
    from tensordict import TensorDict

    from tdckpt.errors import IntegrityError

    td = TensorDict(w=torch.arange(400_000.0), b=torch.ones(2))  # w: an object of its own
    with _mgr(r := remote) as mgr:
        mgr.save(1, td)
    fs = r.fs()
    (big,) = [o for o in fs.find(r.path()) if "attempt" in o and fs.info(o)["size"] > 1 << 20]
    if damage == "missing":
        fs.rm_file(big)
    else:
        fs.pipe_file(big, fs.cat_file(big)[:1000])
    with _mgr(r) as mgr:
        assert torch.equal(mgr.restore(1, keys="b")["b"], td["b"])
        target = TensorDict(w=torch.zeros(400_000), b=torch.zeros(2))
        with pytest.raises(IntegrityError, match=rf"{damage}: w\.memmap"):
            mgr.restore(1)
        with pytest.raises(IntegrityError, match=rf"{damage}: w\.memmap"):
            mgr.restore_into(target, 1)
        assert not target["w"].any() and not target["b"].any()
        mgr.restore_into(target, 1, keys="b")
        assert torch.equal(target["b"], td["b"]) and not target["w"].any()
        report = mgr.verify(1)
        assert not report.ok and [p.path for p in report.problems] == ["w.memmap"]


def _child_saving(url: str, end: str) -> str:
    return (
        "import os, signal, torch\n"
        "from tensordict import TensorDict\n"
        "from tdckpt import CheckpointManager\n"
        f"m = CheckpointManager({url!r})\n"
        "m.save(1, TensorDict(w=torch.ones(2)))\n"
        + ("os.kill(os.getpid(), signal.SIGKILL)\n" if end == "killed" else "")
    )


@pytest.mark.parametrize("end", ["exits", "killed"])
def test_a_process_that_never_closes_its_manager_does_not_lock_the_root_out(
    tmp_path: Path, end: str
) -> None:
    """A script that ends without close() releases its lease as it exits (a local root's
    flock goes with the process too): the next run saves at once. Before, the root stayed
    locked for the lease's time to live (10 minutes). A process killed outright cannot
    release it: the refusal then says that its holder is gone."""
    import subprocess
    import sys

    from conftest import subprocess_env

    from tdckpt.errors import LockError

    url = f"file://{tmp_path}/run"
    child = subprocess.run(
        [sys.executable, "-c", _child_saving(url, end)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == (0 if end == "exits" else -9), child.stderr
    with CheckpointManager(url) as mgr:
        if end == "exits":
            mgr.save(2, _td(2))
            assert mgr.steps() == [1, 2]
        else:
            with pytest.raises(LockError, match=r"no longer running on this host: it was killed"):
                mgr.save(2, _td(2))
            assert mgr.steps() == [1]
