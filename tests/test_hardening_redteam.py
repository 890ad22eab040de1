"""Red-team inputs found after the hardening merge: each one crashed or misbehaved before.

Every case builds a real checkpoint on disk, damages or races it the way an attacker or an
unlucky user would, and asserts a clear TdckptError (or a clean report) and no other effect.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _unprivileged import run_unprivileged
from tensordict import TensorDict

import tdckpt
from tdckpt import CheckpointManager, KeepBest, KeepLast
from tdckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    IntegrityError,
    LockError,
    TdckptError,
    UnsafePathError,
)
from tdckpt.schema import MANIFEST_NAME
from tdckpt.warnings import TdckptWarning


def _td() -> TensorDict:
    return TensorDict(
        {"a": torch.arange(6.0).reshape(2, 3), "n": {"b": torch.ones(2, dtype=torch.int64)}},
        batch_size=[2],
    )


def _patch_entry(path: Path, name: str, *, flags: int = 0, method: int | None = None) -> None:
    """Set general-purpose flag bits and/or the method of entry ``name``, in both headers."""
    data = bytearray(path.read_bytes())
    for sig, flag_at, method_at, name_len_at, name_at in (
        (b"PK\x01\x02", 8, 10, 28, 46),
        (b"PK\x03\x04", 6, 8, 26, 30),
    ):
        i = 0
        while (i := data.find(sig, i)) >= 0:
            (n,) = struct.unpack_from("<H", data, i + name_len_at)
            if data[i + name_at : i + name_at + n].decode() == name:
                (old,) = struct.unpack_from("<H", data, i + flag_at)
                struct.pack_into("<H", data, i + flag_at, old | flags)
                if method is not None:
                    struct.pack_into("<H", data, i + method_at, method)
            i += 4
    path.write_bytes(bytes(data))


# -- step archives whose zip entries zipfile refuses with odd exception types -----------------

_DAMAGE = {
    "encrypted": {"flags": 1},
    "unknown-method": {"method": 99},
    "bad-deflate": {"method": 8},
}


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_a_step_archive_with_an_unreadable_manifest_is_damaged_not_a_crash(
    tmp_path: Path, damage: str
) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, archive=True, fsync=False) as mgr:
        mgr.save(1, _td())
        bad = mgr.save(2, _td())
    _patch_entry(bad, MANIFEST_NAME, **_DAMAGE[damage])
    with CheckpointManager(root, archive=True, fsync=False) as mgr:
        assert mgr.steps() == [1]  # the damaged step is not committed; step 1 still is
        rows = {row.step: row for row in mgr.list_steps()}
        assert rows[2].status == "damaged"
        assert rows[2].detail is not None and "not a readable archive" in rows[2].detail
        with pytest.raises(IncompleteCheckpointError, match="step 2"):
            mgr.restore_into(_td().zero_(), step=2)
        out = _td().zero_()
        mgr.restore_into(out)  # the latest committed step
        assert torch.equal(out["a"], _td()["a"])


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_verify_reports_an_archive_leaf_zipfile_cannot_read(tmp_path: Path, damage: str) -> None:
    with CheckpointManager(tmp_path / "run", archive=True, fsync=False) as mgr:
        path = mgr.save(1, _td())
        _patch_entry(path, "a.memmap", **_DAMAGE[damage])
        report = mgr.verify(1)
    assert not report.ok
    assert [(p.path, p.key, p.kind) for p in report.problems] == [("a.memmap", ("a",), "changed")]
    assert "unreadable" in (report.problems[0].found or "")


# -- step manifests that name files outside the step, twice, or another step ----------------


def _rewrite_manifest(step_dir: Path, change: Callable[[dict[str, Any]], None]) -> None:
    where = step_dir / MANIFEST_NAME
    manifest = json.loads(where.read_text())
    change(manifest)
    where.write_text(json.dumps(manifest))


_HOSTILE_PATHS = {
    "dotdot": lambda m, out: m["files"].append(_record("../outside")),
    "absolute": lambda m, out: m["files"].append(_record(str(out))),
    "empty": lambda m, out: m["files"].append(_record("")),
    "dot": lambda m, out: m["files"].append(_record("n/./b.memmap")),
    "nul": lambda m, out: m["files"].append(_record("a\x00.memmap")),
    "twice": lambda m, out: m["files"].append(dict(m["files"][0], size=1)),
}


def _record(path: str) -> dict[str, Any]:
    return {"path": path, "size": 6, "checksum": None, "key": None}


@pytest.mark.parametrize("case", sorted(_HOSTILE_PATHS))
def test_a_manifest_naming_a_file_outside_the_step_or_twice_is_damaged(
    tmp_path: Path, case: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()  # verify would report "found a directory" if it looked there
    with CheckpointManager(tmp_path / "run", fsync=False) as mgr:
        mgr.save(1, _td())
        step_dir = mgr.save(2, _td())
        _rewrite_manifest(step_dir, lambda m: _HOSTILE_PATHS[case](m, outside))
        assert mgr.steps() == [1]
        report = mgr.verify(2)
        assert [p.kind for p in report.problems] == ["manifest"]
        with pytest.raises(IncompleteCheckpointError, match="step 2"):
            mgr.restore_into(_td().zero_(), step=2)
        assert mgr.gc() == [] and step_dir.is_dir()  # damaged, not garbage


def test_verify_reports_a_manifest_of_another_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run", fsync=False) as mgr:
        step_dir = mgr.save(2, _td())
        _rewrite_manifest(step_dir, lambda m: m.update(step=7))
        report = mgr.verify(2)
        assert [(p.path, p.kind, p.expected, p.found) for p in report.problems] == [
            (MANIFEST_NAME, "manifest", "step 2", "step 7")
        ]
        with pytest.raises(IntegrityError, match="step 7"):
            mgr.restore_into(_td().zero_(), step=2, verify=True)


# -- verify racing a swap of what it walked ---------------------------------------------------


def _swap_fifo(step_dir: Path, outside: Path) -> None:
    (step_dir / "n" / "b.memmap").unlink()
    os.mkfifo(step_dir / "n" / "b.memmap")


def _swap_link(step_dir: Path, outside: Path) -> None:
    (step_dir / "n" / "b.memmap").unlink()
    (step_dir / "n" / "b.memmap").symlink_to(outside / "b.memmap")


def _swap_parent(step_dir: Path, outside: Path) -> None:
    shutil.rmtree(step_dir / "n")
    (step_dir / "n").symlink_to(outside, target_is_directory=True)


@pytest.mark.parametrize(
    "swap", [_swap_fifo, _swap_link, _swap_parent], ids=["fifo", "leaf-link", "dir-link"]
)
def test_verify_never_reads_through_what_was_swapped_in_after_its_walk(
    tmp_path: Path, swap: Callable[[Path, Path], None], no_hang: None
) -> None:
    with CheckpointManager(tmp_path / "run", fsync=False) as mgr:
        step_dir = mgr.save(1, _td())
        outside = tmp_path / "outside"
        shutil.copytree(step_dir / "n", outside)  # the same bytes: a read would pass
        outside_bytes = (outside / "b.memmap").read_bytes()
        swapped: list[bool] = []

        def progress(done: int, total: int) -> None:
            if not swapped:  # after the walk, while the first file (a.memmap) is read
                swapped.append(True)
                swap(step_dir, outside)

        report = mgr.verify(1, progress=progress)
    assert swapped
    assert ("n/b.memmap", "not_a_file") in [(p.path, p.kind) for p in report.problems]
    assert (outside / "b.memmap").read_bytes() == outside_bytes


# -- roots that cannot be one -----------------------------------------------------------------


def test_a_root_that_is_a_file_or_under_one_is_a_lock_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for root in (tmp_path / "file", tmp_path / "file" / "run"):
        with pytest.raises(LockError, match="cannot create the checkpoint root"):
            CheckpointManager(root, fsync=False).save(1, _td())
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("where", ["step", "step/n", "step/new"])
def test_a_root_inside_a_checkpoint_is_refused_and_the_checkpoint_unchanged(
    tmp_path: Path, where: str
) -> None:
    with CheckpointManager(tmp_path / "run", fsync=False) as mgr:
        step_dir = mgr.save(1, _td())
    before = sorted(p.relative_to(step_dir) for p in step_dir.rglob("*"))
    root = step_dir / where.removeprefix("step").lstrip("/")
    inner = CheckpointManager(root, fsync=False)
    with pytest.raises(LockError, match="checkpoint"):
        inner.save(5, _td())
    if root.exists():  # gc of a root that does not exist has nothing to do
        with pytest.raises(LockError, match="checkpoint"):
            inner.gc()
    assert sorted(p.relative_to(step_dir) for p in step_dir.rglob("*")) == before
    with CheckpointManager(tmp_path / "run", fsync=False) as mgr:
        assert mgr.verify(1).ok


# -- a lock file removed or replaced while its holder is alive --------------------------------


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_holder_whose_lock_file_went_away_does_not_write_beside_the_new_holder(
    tmp_path: Path, how: str
) -> None:
    root = tmp_path / "run"
    first = CheckpointManager(root, fsync=False)
    first.save(1, _td())
    lock_path = root / ".tdckpt.lock"
    lock_path.unlink()
    if how == "replaced":
        lock_path.write_text("")  # e.g. a sync tool restoring an old copy
        os.utime(lock_path, (0, 0))  # old and empty: free for the taking
    second = CheckpointManager(root, fsync=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TdckptWarning)  # "took over" the replaced file
        second.save(2, _td())
    try:
        with pytest.raises(LockError, match="another writer holds"):
            first.save(3, _td())
        assert first.steps() == [1, 2]
    finally:
        second.close()
    first.save(3, _td())  # the root is free again: the first manager takes a new lock
    assert first.steps() == [1, 2, 3]
    first.close()
    assert not lock_path.exists()


# -- metadata values past float's range ---------------------------------------------------------


def test_an_integer_metric_past_floats_range_ranks_as_a_number(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, fsync=False, retention=KeepBest(1, "loss")) as mgr:
        mgr.save(1, _td(), metadata={"loss": 10**400})
        mgr.save(2, _td(), metadata={"loss": 0.5})
        mgr.save(3, _td(), metadata={"loss": -(10**400)})
        assert mgr.steps() == [3]  # the lowest loss; every save's retention ran
        assert mgr.best_step("loss") == 3
    with CheckpointManager(root, fsync=False, retention=KeepBest(1, "loss", mode="max")) as mgr:
        mgr.save(4, _td(), metadata={"loss": 10**400})
        mgr.save(5, _td(), metadata={"loss": 1.0})
        assert mgr.steps() == [4, 5]  # 4 is best, 5 the one just saved


# -- tdckpt.save(..., overwrite=True) onto something that is not a checkpoint --------------------


def _not_checkpoints(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("mine")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dataset").mkdir()  # a meta.json that is not tensordict's
    (tmp_path / "dataset" / "meta.json").write_text('{"title": "my dataset"}')
    (tmp_path / "dataset" / "thesis.tex").write_text("mine")
    (tmp_path / "folder.tdz").mkdir()
    (tmp_path / "text.tdz").write_text("mine")
    return {
        "file-for-a-folder": tmp_path / "notes.txt",
        "folder-of-other-files": tmp_path / "home",
        "fifo": tmp_path / "fifo",
        "folder-with-a-foreign-meta-json": tmp_path / "dataset",
        "folder-for-an-archive": tmp_path / "folder.tdz",
        "text-for-an-archive": tmp_path / "text.tdz",
    }


@pytest.mark.parametrize(
    "case",
    [
        "file-for-a-folder",
        "folder-of-other-files",
        "fifo",
        "folder-with-a-foreign-meta-json",
        "folder-for-an-archive",
        "text-for-an-archive",
    ],
)
def test_save_overwrite_refuses_what_is_not_a_checkpoint(
    tmp_path: Path, case: str, no_hang: None
) -> None:
    dest = _not_checkpoints(tmp_path)[case]
    before = sorted((p.name, p.is_dir()) for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointExistsError, match="is not a"):
        tdckpt.save(_td(), dest, overwrite=True, fsync=False)
    assert sorted((p.name, p.is_dir()) for p in tmp_path.rglob("*")) == before
    if case in ("file-for-a-folder", "text-for-an-archive"):
        assert dest.read_text() == "mine"
    if case in ("folder-of-other-files", "folder-with-a-foreign-meta-json"):
        assert (dest / "thesis.tex").read_text() == "mine"


def test_save_overwrite_still_replaces_checkpoints_and_empty_folders(tmp_path: Path) -> None:
    for dest in (tmp_path / "ckpt", tmp_path / "ckpt.tdz"):
        tdckpt.save(_td(), dest, fsync=False)
        tdckpt.save(_td() + 1, dest, overwrite=True, fsync=False)
        assert torch.equal(tdckpt.load_memmap(dest)["a"], _td()["a"] + 1)
    (tmp_path / "empty").mkdir()
    tdckpt.save(_td(), tmp_path / "empty", overwrite=True, fsync=False)
    _td().memmap(tmp_path / "plain")  # a tensordict checkpoint without a manifest
    tdckpt.save(_td() + 2, tmp_path / "plain", overwrite=True, fsync=False)
    assert torch.equal(tdckpt.load_memmap(tmp_path / "plain")["a"], _td()["a"] + 2)


def test_save_under_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UnsafePathError, match="cannot create its parent folder"):
        tdckpt.save(_td(), tmp_path / "notes.txt" / "ckpt", fsync=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# -- retention and gc on a tree this process cannot delete ---------------------------------------


def _retention_on_a_read_only_step(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with CheckpointManager(root, fsync=False, retention=KeepLast(1)) as mgr:
        mgr.save(1, _td())
        os.chmod(root / "1" / "n", 0o555)  # its files cannot be unlinked by this user
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = sys._getframe().f_lineno + 1
            path = mgr.save(2, _td())  # committed: retention's trouble is only a warning
        out["save"] = [(w.category.__name__, str(w.message), w.filename, w.lineno) for w in caught]
        out["save_line"] = line
        out["steps"] = mgr.steps()
        out["restored"] = mgr.restore(2)["a"].tolist()
        out["path"] = str(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = sys._getframe().f_lineno + 1
            out["gc_removed"] = mgr.gc()
        out["gc"] = [(w.category.__name__, str(w.message), w.filename, w.lineno) for w in caught]
        out["gc_line"] = line
        leftovers = [p for p in os.listdir(root) if p.startswith("1.tmp-")]
        for dirpath, _, _ in os.walk(root / leftovers[0]):
            os.chmod(dirpath, 0o755)
        out["gc_after_chmod"] = [p.name for p in mgr.gc()]
        out["left"] = sorted(os.listdir(root))
    return out


def test_retention_that_cannot_delete_a_step_warns_after_the_committed_save() -> None:
    base = Path(tempfile.mkdtemp(prefix="tdckpt-redteam-"))  # tmp_path is private to root
    base.chmod(0o777)
    try:
        out = run_unprivileged(lambda: _retention_on_a_read_only_step(base / "run"))
    finally:
        for dirpath, _, _ in os.walk(base):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(base)
    assert isinstance(out, dict)
    assert out["steps"] == [2] and out["restored"] == _td()["a"].tolist()
    [(category, message, filename, lineno)] = out["save"]
    assert category == "TdckptWarning"
    assert "could not be removed (Permission denied" in message and "gc()" in message
    assert (filename, lineno) == (__file__, out["save_line"])
    [(category, message, filename, lineno)] = out["gc"]
    assert category == "TdckptWarning" and "could not be removed" in message
    assert (filename, lineno) == (__file__, out["gc_line"])
    assert out["gc_removed"] == []
    assert len(out["gc_after_chmod"]) == 1 and out["gc_after_chmod"][0].startswith("1.tmp-")
    assert out["left"] == [".tdckpt.lock", "2"]


# -- a bare prefix read while tdckpt.save(..., overwrite=True) replaces it -------------------------


def test_a_restore_racing_an_overwrite_reads_the_old_or_the_new_tree(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"

    def make(value: int) -> TensorDict:
        leaf = torch.full((64,), float(value))
        return TensorDict({"a": leaf, "n": {"b": leaf.clone()}}, batch_size=[])

    tdckpt.save(make(0), prefix, fsync=False)
    stop = threading.Event()
    failures: list[str] = []
    seen: set[float] = set()

    def reader(in_place: bool) -> None:
        while not stop.is_set():
            try:
                if in_place:
                    out = tdckpt.load_memmap_(make(-1), prefix)
                else:
                    out = tdckpt.load_memmap(prefix)
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                continue
            value = float(out["a"][0])
            if not (torch.all(out["a"] == value) and torch.all(out["n", "b"] == value)):
                failures.append(f"a mix of two trees: {out['a'][0]} / {out['n', 'b'][0]}")
            seen.add(value)

    threads = [threading.Thread(target=reader, args=(flag,)) for flag in (False, True)]
    for thread in threads:
        thread.start()
    try:
        for value in range(1, 61):
            tdckpt.save(make(value), prefix, overwrite=True, fsync=False)
            time.sleep(0.002)  # let the readers through now and then
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert failures == []
    assert len(seen) > 1  # the readers did overlap the overwrites


# -- the latest step read while another process's retention replaces it ---------------------------


def test_the_latest_step_is_found_while_a_writer_retires_the_previous_one(tmp_path: Path) -> None:
    root = tmp_path / "run"
    writer = CheckpointManager(root, fsync=False, retention=KeepLast(1))
    writer.save(0, _td())
    stop = threading.Event()
    failures: list[str] = []
    reads = [0]

    def reader() -> None:
        mgr = CheckpointManager(root, fsync=False)  # another manager: no shared state
        while not stop.is_set():
            try:
                if mgr.latest_step() is None:
                    failures.append("latest_step() is None")
                mgr.restore()
                reads[0] += 1
            except CheckpointNotFoundError as exc:
                if "no committed checkpoint yet" in str(exc):
                    failures.append(str(exc))
            except TdckptError:
                pass  # the step picked was retired under this reader: a clean refusal

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for step in range(1, 101):
            writer.save(step, _td())
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        writer.close()
    assert failures == []
    assert reads[0] > 0
