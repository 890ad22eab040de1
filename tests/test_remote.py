# ruff: noqa: F811  (pytest fixtures imported from _remote_fixtures are parameters here)
"""Object storage (issue 15): save / ls / restore / restore_into / verify / retention / gc
through fsspec, against memory:// and a local moto S3 server (no network)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("fsspec")
from _remote_fixtures import Remote, _timeout, moto_s3, remote, s3_remote  # noqa: F401

from tdckpt import CheckpointManager, KeepLast, load_memmap, load_memmap_
from tdckpt._remote.store import Store
from tdckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    LockError,
    PickleNotAllowedError,
    RestoreError,
)

tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict


def _td(seed: int = 0) -> object:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        w=torch.randn(64, 32, generator=g),
        big=torch.randn(64, 5000, generator=g),  # 1.28 MB: an object of its own
        sub=TensorDict(
            i=torch.arange(64, dtype=torch.int64) + seed,
            b=torch.rand(64, 3, generator=g) > 0.5,
            batch_size=[64],
        ),
        batch_size=[64],
    )


def _equal(a: object, b: object) -> bool:
    return all(
        torch.equal(a.get(k), b.get(k))  # type: ignore[attr-defined]
        for k in a.keys(include_nested=True, leaves_only=True)  # type: ignore[attr-defined]
    ) and set(a.keys(True, True)) == set(b.keys(True, True))  # type: ignore[attr-defined]


def _mgr(r: Remote, **kw: object) -> CheckpointManager:
    return CheckpointManager(r.url, storage_options=r.storage_options, **kw)  # type: ignore[arg-type]


def test_url_dispatches_to_the_object_store_and_paths_do_not(
    remote: Remote, tmp_path: Path
) -> None:
    with _mgr(remote) as mgr:  # one class: the URL picks the step store underneath
        assert type(mgr) is CheckpointManager and isinstance(mgr.store, Store)
    local = CheckpointManager(tmp_path / "r")
    assert type(local) is CheckpointManager and not isinstance(local.store, Store)
    # a str path without a scheme is local too, and storage_options are refused there
    assert type(CheckpointManager(str(tmp_path / "r"))) is CheckpointManager
    with pytest.raises(ValueError, match="storage_options are for fsspec URLs"):
        CheckpointManager(tmp_path / "r", storage_options={"anon": True})


def test_save_ls_restore_round_trip(remote: Remote) -> None:
    td1, td2 = _td(1), _td(2)
    with _mgr(remote) as mgr:
        url = mgr.save(10, td1, metadata={"loss": 0.5})
        assert url.startswith(remote.url + "/10.attempt-")
        mgr.save(20, td2, metadata={"loss": 0.25})
        assert mgr.steps() == [10, 20]
        assert mgr.latest_step() == 20
        assert mgr.best_step("loss") == 20
        assert mgr.metadata(10) == {"loss": 0.5}
        rows = mgr.list_steps()
        assert [(r.step, r.status) for r in rows] == [(10, "committed"), (20, "committed")]
        assert rows[0].size > 1_200_000 and rows[0].metadata == {"loss": 0.5}
        assert _equal(mgr.restore(), td2)
        assert _equal(mgr.restore(10), td1)
        with pytest.raises(CheckpointExistsError, match="already exists"):
            mgr.save(10, td2)
        with pytest.raises(ValueError, match="overwrite=True is not supported"):
            mgr.save(10, td2, overwrite=True)
        with pytest.raises(CheckpointNotFoundError, match="no committed step 15"):
            mgr.restore(15)
    # a second manager (a reader) sees the same steps
    reader = _mgr(remote)
    assert reader.steps() == [10, 20]
    assert _equal(reader.restore(10), td1)


def test_restore_into_in_place_all_or_nothing(remote: Remote) -> None:
    td = _td(3)
    with _mgr(remote) as mgr:
        mgr.save(1, td)
        target = _td(9)
        sub = target["sub"]
        out = mgr.restore_into(target)
        assert out is target and target["sub"] is sub
        assert _equal(target, td)
        # strict: a target with other keys is refused and left exactly as it was
        other = _td(9)
        other["extra"] = torch.zeros(64)
        before = other.clone()
        with pytest.raises(RestoreError, match="does not have the target's keys") as info:
            mgr.restore_into(other)
        assert info.value.unexpected == [] and ("extra",) in info.value.missing
        assert _equal(other, before)
        with pytest.raises(ValueError, match="r\\+"):
            mgr.restore_into(other, mode="r+")


def test_verify_reports_ok_then_every_changed_object(remote: Remote) -> None:
    with _mgr(remote) as mgr:
        mgr.save(5, _td(5))
        report = mgr.verify()
        assert report.ok and report.files_checked >= 5 and report.bytes_checked > 1_200_000
        # flip one byte of the packed object holding the small leaves
        fs = remote.fs()
        name = [p for p in fs.find(remote.path()) if "/5.attempt-" in p]
        record = json.loads(fs.cat_file(remote.path("5.tdckpt.json")))
        loc = record["locations"]["w.memmap"]
        obj = next(p for p in name if p.endswith("/" + record["objects"][loc["object"]]["name"]))
        data = bytearray(fs.cat_file(obj))
        data[loc["offset"] + 7] ^= 0x40
        fs.pipe_file(obj, bytes(data))
        report = mgr.verify(5)
        assert not report.ok
        assert [(p.path, p.kind, p.key) for p in report.problems] == [
            ("w.memmap", "changed", ("w",))
        ]


def test_retention_deletes_record_then_data(remote: Remote) -> None:
    with _mgr(remote, retention=KeepLast(2)) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, _td(step))
        assert mgr.steps() == [3, 4]
        fs = remote.fs()
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(remote.path(), detail=False))
        assert [n for n in names if n.endswith(".tdckpt.json")] == [
            "3.tdckpt.json",
            "4.tdckpt.json",
        ]
        assert sorted(n.split(".")[0] for n in names if ".attempt-" in n) == ["3", "4"]
        assert _equal(mgr.restore(3), _td(3))


def test_gc_removes_unnamed_attempts_after_the_grace_period(remote: Remote) -> None:
    with _mgr(remote) as mgr:
        mgr.save(1, _td(1))
        fs = remote.fs()
        stale = remote.path("7.attempt-" + "a" * 32)
        fs.pipe_file(stale + "/data-0", b"leftover of a killed save")
        rows = mgr.list_steps()
        assert [(r.step, r.status, r.kind) for r in rows] == [
            (1, "committed", "remote"),
            (7, "incomplete", "tmp"),
        ]
        assert mgr.steps() == [1]
        assert mgr.gc() == []  # younger than the default grace period: a save may be running
        removed = mgr.gc(grace_period=0)
        assert removed == [remote.url + "/7.attempt-" + "a" * 32]
        assert [r.step for r in mgr.list_steps()] == [1]
        assert _equal(mgr.restore(), _td(1))
        with pytest.raises(ValueError, match="grace_period"):
            mgr.gc(grace_period=-1)


def test_damaged_commit_record_is_listed_not_restored(remote: Remote) -> None:
    with _mgr(remote) as mgr:
        mgr.save(1, _td(1))
        remote.fs().pipe_file(remote.path("2.tdckpt.json"), b"{not json")
        assert mgr.steps() == [1]
        rows = {r.step: r for r in mgr.list_steps()}
        assert rows[2].status == "damaged" and "not a valid tdckpt commit record" in rows[2].detail
        with pytest.raises(IncompleteCheckpointError, match="step 2 is not a committed"):
            mgr.restore(2)
        assert not mgr.verify(2).ok
        assert mgr.latest_step() == 1


def test_second_writer_is_refused_by_the_lease(remote: Remote) -> None:
    with _mgr(remote) as first:
        first.save(1, _td(1))
        second = _mgr(remote)
        with pytest.raises(LockError, match="another writer holds this root's lease"):
            second.save(2, _td(2))
        assert second.steps() == [1]  # reading needs no lease
    # once the first closed, the second can write
    with second:
        second.save(2, _td(2))
        assert second.steps() == [1, 2]


def test_expired_lease_is_taken_over(remote: Remote) -> None:
    crashed = _mgr(remote, lease_ttl=0.2)
    crashed.save(1, _td(1))  # never closed: as if the process died
    import time

    time.sleep(0.3)
    with _mgr(remote) as mgr:
        mgr.save(2, _td(2))
        assert mgr.steps() == [1, 2]
    # the crashed one finds out before committing anything
    with pytest.raises(LockError, match="lease"):
        crashed.save(3, _td(3))
    assert _mgr(remote).steps() == [1, 2]


def test_cache_dir_keeps_a_verified_copy(remote: Remote, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with _mgr(remote, cache_dir=cache) as mgr:
        mgr.save(1, _td(1))
        assert _equal(mgr.restore(), _td(1))
        (folder,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
        assert folder.name.startswith("1.attempt-") and (folder / "tdckpt.manifest.json").is_file()
        # a damaged cached file is noticed (re-verified) and fetched again
        leaf = folder / "w.memmap"
        raw = bytearray(leaf.read_bytes())
        raw[0] ^= 1
        leaf.write_bytes(bytes(raw))
        assert _equal(mgr.restore(), _td(1))


def test_plain_tensordict_prefix_at_a_url(remote: Remote, tmp_path: Path) -> None:
    """load_memmap / load_memmap_ / validate / inspect / upgrade --dry-run accept URLs."""
    import tdckpt

    td = _td(4)
    local = tmp_path / "plain"
    td.memmap(local)
    fs = remote.fs()
    fs.put(str(local), remote.path("plain"), recursive=True)
    url = remote.url + "/plain"
    so = remote.storage_options
    out = load_memmap(url, storage_options=so)
    assert _equal(out, td)
    target = _td(0)
    assert load_memmap_(target, url, storage_options=so) is target and _equal(target, td)
    report = tdckpt.validate(url, storage_options=so)
    assert report.ok and report.prefix == url
    info = tdckpt.inspect(url, storage_options=so)
    assert info.leaf_count == 4 and info.prefix == url
    plan = tdckpt.upgrade(url, dry_run=True, storage_options=so)
    assert plan.dry_run
    with pytest.raises(tdckpt.errors.TdckptError, match="not supported"):
        tdckpt.upgrade(url, storage_options=so)
    missing = tdckpt.validate(remote.url + "/nothing", storage_options=so)
    assert not missing.ok and "no objects under this prefix" in missing.problems[0].message
    # a truncated leaf is an error that names the file, and nothing is loaded
    fs.pipe_file(remote.path("plain/w.memmap"), b"\0" * 10)
    assert not tdckpt.validate(url, storage_options=so).ok
    with pytest.raises(tdckpt.errors.TdckptError):
        load_memmap_(target, url, storage_options=so)
    assert _equal(target, td)


def test_importing_tdckpt_does_not_import_fsspec() -> None:
    code = (
        "import sys, tdckpt, tdckpt.manager, tdckpt.cli\n"
        "from tdckpt import CheckpointManager\n"
        "assert tdckpt._remote.is_url('s3://b/x')\n"
        "bad = [m for m in ('fsspec', 's3fs', 'botocore', 'aiobotocore') if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_file_url_commits_with_an_exclusive_create(tmp_path: Path) -> None:
    """file:// goes through the object-store path too (O_EXCL commit, no rename)."""
    url = (tmp_path / "store").as_uri()
    td = _td(6)
    with CheckpointManager(url) as mgr:
        assert isinstance(mgr.store, Store)  # the object-store steps, not a local folder
        mgr.save(1, td)
        assert mgr.steps() == [1]
        assert (tmp_path / "store" / "1.tdckpt.json").is_file()
        assert _equal(mgr.restore(), td)
        assert mgr.verify().ok
        # the commit record exists: a second create of it fails, whoever tries
        with pytest.raises(FileExistsError):
            mgr.store.create("1.tdckpt.json", b"{}")


def test_pickle_warning_names_the_url_and_the_callers_line(remote: Remote) -> None:
    from tdckpt.warnings import TdckptDeprecationWarning

    td = TensorDict(a=torch.zeros(2), obj=tensordict.NonTensorData(data={1, 2}))
    with _mgr(remote) as mgr:
        mgr.save(1, td)
        with pytest.warns(TdckptDeprecationWarning, match="loading pickled non-tensor") as caught:
            out = mgr.restore()
        assert out["obj"] == {1, 2}
        (w,) = caught
        assert w.filename == __file__
        assert remote.url + "/1.attempt-" in str(w.message)
        assert "tdckpt-restore-" not in str(w.message)
        target = td.clone()
        with pytest.warns(TdckptDeprecationWarning) as caught:
            mgr.restore_into(target)
        assert caught[0].filename == __file__ and remote.url in str(caught[0].message)
        # allow_pickle=False refuses before touching the target
        with pytest.raises(PickleNotAllowedError):
            mgr.restore_into(target, allow_pickle=False)
