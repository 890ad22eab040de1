# ruff: noqa: F811  (pytest fixtures imported from _remote_fixtures are parameters here)
"""Verify and ``cache_dir`` downloads of a step in object storage read through
:class:`~tdckpt._read.object_storage.ObjectStorage`: every file checked as it arrives,
problems named by the file and the URL (never a local path), against memory:// and moto S3."""

from __future__ import annotations

import json
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
from tdckpt._read import object_storage
from tdckpt.errors import IntegrityError, RemoteError

tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict


def _td() -> Any:
    return TensorDict(
        w=torch.arange(256, dtype=torch.float32),  # small: packed with the others
        big=torch.arange(300_000, dtype=torch.float32),  # 1.2 MB: an object of its own
        sub=TensorDict(i=torch.arange(8), batch_size=[]),
        batch_size=[],
    )


def _mgr(r: Remote, **kw: Any) -> CheckpointManager:
    return CheckpointManager(r.url, storage_options=r.storage_options, **kw)


def _object_of(remote: Remote, step: int, rel: str) -> tuple[str, int]:
    """The store path of the object holding ``rel``, and ``rel``'s offset in it."""
    record = json.loads(remote.fs().cat_file(remote.path(f"{step}.tdckpt.json")))
    loc = record["locations"][rel]
    name = record["objects"][loc["object"]]["name"]
    return remote.path(f"{step}.attempt-{record['attempt']}/{name}"), loc["offset"]


def _sizes(remote: Remote, step: int) -> dict[str, int]:
    """Each file of the step's manifest -> its size."""
    record = json.loads(remote.fs().cat_file(remote.path(f"{step}.tdckpt.json")))
    return {f["path"]: f["size"] for f in record["manifest"]["files"]}


def _flip(remote: Remote, step: int, rel: str) -> None:
    obj, offset = _object_of(remote, step, rel)
    fs = remote.fs()
    data = bytearray(fs.cat_file(obj))
    data[offset + 3] ^= 0x10
    fs.pipe_file(obj, bytes(data))


def test_a_clean_verify_reads_every_file_once(remote: Remote, tmp_path: Path) -> None:
    with _mgr(remote) as mgr:
        mgr.save(1, _td())
        seen: list[tuple[int, int]] = []
        report = mgr.verify(1, progress=lambda done, total: seen.append((done, total)))
        sizes = _sizes(remote, 1)
        assert report.ok and report.path == mgr.path(1)
    assert report.files_checked == len(sizes)
    assert report.bytes_checked == sum(sizes.values())
    assert seen[-1] == (sum(sizes.values()), sum(sizes.values()))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # progress only grows
    assert not list(tmp_path.iterdir())  # nothing was written anywhere


def test_a_flipped_byte_is_reported_and_a_download_names_the_url(
    remote: Remote, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    with _mgr(remote, cache_dir=cache) as mgr:
        mgr.save(1, _td())
        step_url = mgr.path(1)
    _flip(remote, 1, "big.memmap")
    with _mgr(remote, cache_dir=cache) as mgr:
        report = mgr.verify(1)
        assert [(p.path, p.kind, p.key) for p in report.problems] == [
            ("big.memmap", "changed", ("big",))
        ]
        assert report.files_checked == len(_sizes(remote, 1)) - 1
        # the cache_dir download refuses the step, naming the object's URL, not a local path
        with pytest.raises(IntegrityError) as info:
            mgr.restore(1)
    err = info.value
    assert err.path == f"{step_url}/big.memmap"  # type: ignore[attr-defined]
    assert str(err).startswith(f"{step_url}: step 1 is damaged in the store: changed: ")
    assert str(cache) not in str(err) and str(tmp_path) not in str(err)
    assert [p.name for p in cache.iterdir()] == []  # no partial copy is left behind


def test_a_missing_object_is_reported_from_the_listing(remote: Remote, tmp_path: Path) -> None:
    with _mgr(remote) as mgr:
        mgr.save(1, _td())
        step_url = mgr.path(1)
    obj, _ = _object_of(remote, 1, "big.memmap")
    remote.fs().rm(obj)
    with _mgr(remote) as mgr:
        report = mgr.verify(1)
        (problem,) = report.problems
        assert (problem.path, problem.kind) == ("big.memmap", "missing")
        assert problem.found is not None and problem.found.startswith("no object data-")
        assert report.files_checked == len(_sizes(remote, 1)) - 1
    with (
        _mgr(remote, cache_dir=tmp_path / "cache") as mgr,
        pytest.raises(IntegrityError, match="missing") as info,
    ):
        mgr.restore(1)
    assert info.value.path == f"{step_url}/big.memmap"  # type: ignore[attr-defined]


def test_verify_stops_on_a_failure_while_reading(
    remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object deleted after the listing vouched for it (a concurrent prune) and a
    progress callback that raises both stop the verification with their error."""
    td = TensorDict({f"x{i}": torch.full((300_000,), float(i)) for i in range(4)}, [])
    with _mgr(remote) as mgr:
        mgr.save(1, td)
    monkeypatch.setattr(object_storage, "BATCH_BYTES", 1)  # one object a batch
    objects = [_object_of(remote, 1, f"x{i}.memmap")[0] for i in range(4)]

    def prune(done: int, total: int) -> None:
        for obj in objects:
            if remote.fs().exists(obj):
                remote.fs().rm(obj)

    with _mgr(remote) as mgr, pytest.raises(IntegrityError, match="an object it names is gone"):
        mgr.verify(1, progress=prune)
    with _mgr(remote) as mgr:
        mgr.save(2, td)

        def stop(done: int, total: int) -> None:
            raise RuntimeError("stopped by the caller")

        with pytest.raises(RuntimeError, match="stopped by the caller"):
            mgr.verify(2, progress=stop)
        assert mgr.verify(2).ok


def test_verify_stops_on_a_failing_store(
    s3_remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ranged read of the step fails (a 500 each time): verify raises the store's
    error instead of reporting the step damaged; the step verifies once the store is back."""
    s3 = s3_remote.s3
    assert s3 is not None
    options = fast_failures(s3_remote, monkeypatch).storage_options
    with CheckpointManager(s3_remote.url, storage_options=options) as mgr:
        mgr.save(1, _td())
        s3.failing = lambda method, path: method == "GET" and ".attempt-" in path
        with pytest.raises(RemoteError, match="ranged read"):
            mgr.verify(1)
        s3.failing = None
        assert mgr.verify(1).ok
