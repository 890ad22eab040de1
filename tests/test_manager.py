"""CheckpointManager: listing, saving, verify, gc, restore through the engine, the lock."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tree_digest
from tensordict import NonTensorData, TensorDict

from tdckpt._write.atomic import tmp_name
from tdckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    IntegrityError,
    LockError,
    MetadataError,
    RestoreError,
)
from tdckpt.manager import CheckpointManager, VerifyProblem, VerifyReport
from tdckpt.schema import MANIFEST_NAME


def make_td(step: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(step)
    return TensorDict(
        {
            "a": torch.randn(4, 3, generator=g),
            "b": torch.arange(4) + step,
            "nested": TensorDict({"c": torch.randn(4, 2, generator=g)}, batch_size=[4]),
            "s": NonTensorData(f"step {step}", batch_size=[4]),
        },
        batch_size=[4],
    )


@pytest.fixture
def mgr(tmp_path: Path) -> Any:
    with CheckpointManager(tmp_path / "root", fsync=False) as manager:
        yield manager


# -- listing and metadata --------------------------------------------------------------------------


def test_save_and_list(mgr: CheckpointManager) -> None:
    assert mgr.steps() == [] and mgr.latest_step() is None
    for step in (100, 2, 10):
        path = mgr.save(step, make_td(step), metadata={"loss": 1 / step, "tag": f"s{step}"})
        assert path == mgr.root / str(step) and path.is_dir()
    assert mgr.steps() == [2, 10, 100]  # numeric, not lexicographic
    assert mgr.latest_step() == 100
    assert mgr.path(10) == mgr.root / "10"
    assert mgr.metadata(10) == {"loss": 0.1, "tag": "s10"}
    assert mgr.best_step("loss") == 100
    assert mgr.best_step("loss", mode="max") == 2
    assert mgr.best_step("absent") is None
    assert TensorDict.load_memmap(mgr.path(10))["b"].tolist() == [10, 11, 12, 13]
    with pytest.raises(ValueError, match="'min' or 'max'"):
        mgr.best_step("loss", mode="lowest")  # type: ignore[arg-type]


def test_metadata_is_a_copy(mgr: CheckpointManager) -> None:
    mgr.save(1, make_td(), metadata={"cfg": {"lr": 0.1}})
    mgr.metadata(1)["cfg"]["lr"] = 99
    assert mgr.metadata(1) == {"cfg": {"lr": 0.1}}


def test_foreign_and_incomplete_entries_are_never_listed_nor_touched(
    mgr: CheckpointManager,
) -> None:
    mgr.save(1, make_td())
    root = mgr.root
    (root / "notes").mkdir()
    (root / "007").mkdir()
    (root / "3").write_text("a file named like a step")
    (root / "4").mkdir()  # a step folder without a manifest
    (root / "4" / "meta.json").write_text("{}")
    shutil.copytree(root / "1", root / "6")
    (root / "6" / MANIFEST_NAME).write_text("{not json")
    os.symlink(root / "1", root / "7")  # a symlink is not a committed step
    staging = root / tmp_name(8)
    staging.mkdir()
    (staging / "half.memmap").write_bytes(b"x")
    assert mgr.steps() == [1]
    foreign = {"notes", "007", "3", "4", "6", "7"}
    assert [p.name for p in mgr.gc()] == [staging.name]
    assert foreign <= set(os.listdir(root)) and not staging.exists()
    with pytest.raises(IncompleteCheckpointError, match="step 4 is not a committed"):
        mgr.path(4)
    with pytest.raises(
        CheckpointNotFoundError, match=r"no committed step 5 \(committed steps: 1\)"
    ):
        mgr.metadata(5)
    report = mgr.verify(6)
    assert not report.ok and report.problems[0].kind == "manifest"
    assert "invalid" in str(report.problems[0].found)


def test_missing_root_reads_as_empty(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "nowhere")
    assert mgr.steps() == [] and mgr.gc() == [] and mgr.prune() == []
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint yet"):
        mgr.verify()
    assert not (tmp_path / "nowhere").exists()


# -- saving ----------------------------------------------------------------------------------------


def test_an_existing_step_is_refused_unless_overwrite(mgr: CheckpointManager) -> None:
    mgr.save(5, make_td(1), metadata={"v": 1})
    with pytest.raises(CheckpointExistsError, match=r"step 5 already exists.*overwrite=True"):
        mgr.save(5, make_td(2))
    assert mgr.metadata(5) == {"v": 1}
    mgr.save(5, make_td(2), metadata={"v": 2}, overwrite=True)
    assert mgr.metadata(5) == {"v": 2} and mgr.steps() == [5]
    assert sorted(os.listdir(mgr.root)) == [".tdckpt.lock", "5"]
    assert mgr.verify(5).ok


def test_invalid_arguments_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "root")
    with pytest.raises(MetadataError, match="found a tuple"):
        mgr.save(1, make_td(), metadata={"shape": (1, 2)})
    for bad in (-1, 1.5, "1", True):
        with pytest.raises(ValueError, match="non-negative int"):
            mgr.save(bad, make_td())  # type: ignore[arg-type]
    assert not (tmp_path / "root").exists()
    with pytest.raises(ValueError, match="unknown checksum"):
        CheckpointManager(tmp_path, checksum="md4")
    with pytest.raises(TypeError, match="retention policy"):
        CheckpointManager(tmp_path, retention=3)  # type: ignore[arg-type]


def test_sha256_checksums(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, checksum="sha256", fsync=False) as mgr:
        mgr.save(1, make_td())
        manifest = json.loads((tmp_path / "1" / MANIFEST_NAME).read_text())
        assert all(f["checksum"].startswith("sha256:") for f in manifest["files"])
        assert mgr.verify(1).ok


def test_an_unsupported_object_leaves_nothing(mgr: CheckpointManager) -> None:
    from tdckpt._write.save import UnsupportedContentError

    with pytest.raises(UnsupportedContentError, match="'shape'"):
        mgr.save(1, TensorDict(shape=torch.zeros(1)))
    assert mgr.steps() == [] and sorted(os.listdir(mgr.root)) == [".tdckpt.lock"]


# -- verify ----------------------------------------------------------------------------------------


def _saved(mgr: CheckpointManager) -> Path:
    mgr.save(1, make_td(1))
    return mgr.path(1)


def test_verify_ok_and_progress(mgr: CheckpointManager) -> None:
    path = _saved(mgr)
    calls: list[tuple[int, int]] = []
    report = mgr.verify(progress=lambda done, total: calls.append((done, total)))
    assert report.ok and bool(report) and report.step == 1 and report.path == path
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    total = sum(f["size"] for f in manifest["files"])
    assert report.files_checked == len(manifest["files"]) and report.bytes_checked == total
    assert calls and calls[-1] == (total, total)
    assert "OK" in report.summary() and report.to_json()["ok"] is True


def _flip(path: Path, offset: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "want"),
    [
        (lambda p: _flip(p / "a.memmap"), [("a.memmap", ("a",), "changed")]),
        (
            lambda p: (p / "nested" / "c.memmap").write_bytes(
                (p / "nested" / "c.memmap").read_bytes()[:-4]
            ),
            [("nested/c.memmap", ("nested", "c"), "short")],
        ),
        (lambda p: (p / "b.memmap").unlink(), [("b.memmap", ("b",), "missing")]),
        (
            lambda p: (p / "b.memmap").write_bytes((p / "b.memmap").read_bytes() + b"\0"),
            [("b.memmap", ("b",), "long")],
        ),
        (
            lambda p: (p / "nested" / "meta.json").unlink(),
            [("nested/meta.json", ("nested",), "missing")],
        ),
        (lambda p: (p / "stray.memmap").write_bytes(b"x"), [("stray.memmap", ("stray",), "extra")]),
        (lambda p: _flip(p / "s" / "meta.json", 20), [("s/meta.json", ("s",), "changed")]),
    ],
    ids=["flipped", "truncated", "deleted", "appended", "meta-deleted", "extra", "meta-changed"],
)
def test_verify_names_each_damaged_file_and_key(
    damage: Any, want: list[tuple[str, tuple[str, ...], str]], mgr: CheckpointManager
) -> None:
    path = _saved(mgr)
    damage(path)
    report = mgr.verify(1)
    assert not report.ok
    assert [(p.path, p.key, p.kind) for p in report.problems] == want
    assert want[0][0] in report.summary()


def test_verify_catches_two_swapped_leaves(mgr: CheckpointManager) -> None:
    mgr.save(1, TensorDict(x=torch.zeros(8), y=torch.ones(8)))
    path = mgr.path(1)
    os.rename(path / "x.memmap", path / "tmp")
    os.rename(path / "y.memmap", path / "x.memmap")
    os.rename(path / "tmp", path / "y.memmap")
    report = mgr.verify(1)
    assert [(p.path, p.key, p.kind) for p in report.problems] == [
        ("x.memmap", ("x",), "changed"),
        ("y.memmap", ("y",), "changed"),
    ]


def test_verify_reports_a_symlink_or_directory_in_place_of_a_file(mgr: CheckpointManager) -> None:
    path = _saved(mgr)
    (path / "a.memmap").unlink()
    os.symlink("/etc/hostname", path / "a.memmap")
    (path / "b.memmap").unlink()
    (path / "b.memmap").mkdir()
    kinds = {p.path: (p.kind, p.found) for p in mgr.verify(1).problems}
    assert kinds == {
        "a.memmap": ("not_a_file", "a symlink"),
        "b.memmap": ("not_a_file", "a directory"),
    }


def test_verify_report_types() -> None:
    problem = VerifyProblem("a.memmap", ("a",), "short", "12 bytes", "8 bytes")
    assert str(problem) == "short: a.memmap (key ('a',)): expected 12 bytes, found 8 bytes"
    report = VerifyReport(step=3, path=Path("/r/3"), problems=[problem] * 25)
    assert not report.ok and "... and 5 more" in report.summary()
    assert report.to_json()["problems"][0]["key"] == ["a"]


def test_verify_of_a_missing_step(mgr: CheckpointManager) -> None:
    _saved(mgr)
    with pytest.raises(CheckpointNotFoundError, match="no committed step 9"):
        mgr.verify(9)


# -- archives --------------------------------------------------------------------------------------


def test_archive_steps(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, archive=True, fsync=False) as mgr:
        path = mgr.save(3, make_td(3), metadata={"loss": 0.5})
        assert path == tmp_path / "3.tdz" and zipfile.is_zipfile(path)
        assert sorted(os.listdir(tmp_path)) == [".tdckpt.lock", "3.tdz"]
        assert mgr.steps() == [3] and mgr.metadata(3) == {"loss": 0.5}
        assert mgr.verify(3).ok
        assert TensorDict.load_memmap(path)["b"].tolist() == [3, 4, 5, 6]
        with pytest.raises(CheckpointExistsError):
            mgr.save(3, make_td(3))
        (tmp_path / ".3.tdz.0123abcd.tmp").write_bytes(b"PK")  # write_archive's temp file
        assert [p.name for p in mgr.gc()] == [".3.tdz.0123abcd.tmp"]


def test_archive_verify_finds_a_flipped_byte(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, archive=True, fsync=False) as mgr:
        path = mgr.save(1, make_td(1))
        with zipfile.ZipFile(path) as zf:
            info = zf.getinfo("nested/c.memmap")
        data = bytearray(path.read_bytes())
        # the payload follows the local header: 30 bytes + name + (local) extra field
        header = data[info.header_offset : info.header_offset + 30]
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        data[start + 5] ^= 0xFF
        path.write_bytes(bytes(data))
        problems = mgr.verify(1).problems
        assert [(p.path, p.key, p.kind) for p in problems] == [
            ("nested/c.memmap", ("nested", "c"), "changed")
        ]


def test_overwrite_across_forms_leaves_one(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, fsync=False) as mgr:
        mgr.save(1, make_td(1), metadata={"form": "dir"})
    with CheckpointManager(tmp_path, fsync=False, archive=True) as mgr:
        with pytest.raises(CheckpointExistsError):
            mgr.save(1, make_td(1))
        mgr.save(1, make_td(1), metadata={"form": "archive"}, overwrite=True)
        assert mgr.steps() == [1] and mgr.metadata(1) == {"form": "archive"}
    assert sorted(os.listdir(tmp_path)) == ["1.tdz"]


# -- gc --------------------------------------------------------------------------------------------


def test_gc_restores_a_step_an_interrupted_overwrite_set_aside(mgr: CheckpointManager) -> None:
    mgr.save(2, make_td(2))
    aside = mgr.root / tmp_name(2, tag="replaced")
    os.rename(mgr.path(2), aside)
    staged = mgr.root / tmp_name(2)
    staged.mkdir()
    assert mgr.steps() == []
    assert [p.name for p in mgr.gc()] == [staged.name]
    assert mgr.steps() == [2] and mgr.verify(2).ok


# -- the lock --------------------------------------------------------------------------------------


def test_a_second_writer_in_the_process_is_refused_readers_are_not(tmp_path: Path) -> None:
    first = CheckpointManager(tmp_path, fsync=False)
    first.save(1, make_td(1))
    second = CheckpointManager(tmp_path, fsync=False)
    with pytest.raises(LockError, match=rf"pid {os.getpid()} .*manager {first.id}"):
        second.save(2, make_td(2))
    with pytest.raises(LockError):
        second.gc()
    assert second.steps() == [1] and second.verify().ok  # reading takes no lock
    first.close()
    second.save(2, make_td(2))
    assert second.steps() == [1, 2]
    with pytest.raises(LockError):
        first.save(3, make_td(3))  # now first is the second writer
    second.close()
    assert not (tmp_path / ".tdckpt.lock").exists()


# -- restore (through the engine) ------------------------------------------------------------------


def _leaves(td: Any) -> dict[Any, Any]:
    return {k: v.clone() for k, v in td.items(True, True)}


def _same(td: Any, leaves: dict[Any, Any]) -> bool:
    now = dict(td.items(True, True))
    return now.keys() == leaves.keys() and all(torch.equal(now[k], v) for k, v in leaves.items())


def test_restore_into_round_trip(mgr: CheckpointManager) -> None:
    mgr.save(1, make_td(1))
    mgr.save(2, make_td(2))
    target = make_td(0)
    nested = target["nested"]
    out = mgr.restore_into(target, allow_pickle=False)
    assert out is target and target["nested"] is nested  # in place
    assert _same(target, _leaves(make_td(2)))
    assert target["s"] == "step 2"
    mgr.restore_into(target, step=1, allow_pickle=False)
    assert _same(target, _leaves(make_td(1)))


def test_default_mode_is_copy_on_write(mgr: CheckpointManager) -> None:
    mgr.save(1, make_td(1))
    before = tree_digest(mgr.path(1))
    target = mgr.restore_into(make_td(0), allow_pickle=False)
    target["a"].add_(1000.0)  # training writes in place ...
    target["nested", "c"].zero_()
    assert tree_digest(mgr.path(1)) == before  # ... never reach the checkpoint
    assert mgr.verify(1).ok
    fresh = mgr.restore(allow_pickle=False)
    assert _same(fresh, _leaves(make_td(1)))


def test_verified_restore_refuses_a_damaged_step_and_leaves_the_target(
    mgr: CheckpointManager,
) -> None:
    path = _saved(mgr)
    _flip(path / "nested" / "c.memmap")
    target = make_td(0)
    nested = target["nested"]
    leaves = _leaves(target)
    with pytest.raises(IntegrityError, match=r"nested/c\.memmap \(key \('nested', 'c'\)\)") as info:
        mgr.restore_into(target, verify=True, allow_pickle=False)
    assert "target is unchanged" in str(info.value)
    assert info.value.report.problems[0].key == ("nested", "c")  # type: ignore[attr-defined]
    assert _same(target, leaves) and target["nested"] is nested
    with pytest.raises(IntegrityError):
        mgr.restore(verify=True, allow_pickle=False)
    # without verify, the engine restores the (damaged) bytes as they are
    mgr.restore_into(target, allow_pickle=False)


def test_strict_restore_refuses_other_keys_and_leaves_the_target(mgr: CheckpointManager) -> None:
    mgr.save(1, make_td(1))
    target = make_td(0)
    target["extra"] = torch.zeros(4)
    del target["b"]
    leaves = _leaves(target)
    with pytest.raises(RestoreError, match="strict=True") as info:
        mgr.restore_into(target, allow_pickle=False)
    assert info.value.missing == [("extra",)]  # type: ignore[attr-defined]
    assert info.value.unexpected == [("b",)]  # type: ignore[attr-defined]
    assert _same(target, leaves)
    mgr.restore_into(target, strict=False, allow_pickle=False)
    assert "extra" not in target and torch.equal(target["b"], make_td(1)["b"])


def test_restore_a_new_object_and_from_an_archive(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, archive=True, fsync=False) as mgr:
        mgr.save(7, make_td(7))
        restored = mgr.restore(allow_pickle=False, verify=True)
        assert _same(restored, _leaves(make_td(7)))
        assert restored["s"] == "step 7"
        with pytest.raises(CheckpointNotFoundError):
            mgr.restore(8)


def test_restore_of_an_uncommitted_step_is_refused(mgr: CheckpointManager) -> None:
    path = _saved(mgr)
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(IncompleteCheckpointError, match="not a committed tdckpt checkpoint"):
        mgr.restore(1)


def test_a_restore_waits_for_an_overwrite_of_its_step(
    mgr: CheckpointManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from tdckpt._store import local as manager_module  # the local store's step writer

    mgr.save(1, make_td(1), metadata={"v": "old"})
    writing, release = threading.Event(), threading.Event()
    real = manager_module.write_checkpoint

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        writing.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(manager_module, "write_checkpoint", slow_write)
    saver = threading.Thread(
        target=mgr.save, args=(1, make_td(2)), kwargs={"metadata": {"v": "new"}, "overwrite": True}
    )
    saver.start()
    assert writing.wait(30)
    results: list[Any] = []
    reader = threading.Thread(target=lambda: results.append(mgr.restore(1, allow_pickle=False)))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not results  # waiting for the swap, not reading a torn step
    release.set()
    saver.join(30)
    reader.join(30)
    assert _same(results[0], _leaves(make_td(2))) and mgr.metadata(1) == {"v": "new"}


def test_a_step_in_use_cannot_be_overwritten(mgr: CheckpointManager) -> None:
    mgr.save(1, make_td(1))
    with (
        mgr._pins.using(1),
        pytest.raises(CheckpointExistsError, match="being restored or verified"),
    ):
        mgr.save(1, make_td(2), overwrite=True)
    mgr.save(1, make_td(2), overwrite=True)


@pytest.mark.parametrize("how", ["save", "overwrite", "save_async", "memory"])
def test_metadata_with_a_lone_surrogate_is_refused_before_anything_is_written(
    tmp_path: Path, how: str
) -> None:
    """A str UTF-8 cannot encode (``os.fsdecode`` of a non-UTF-8 file name gives one) was
    written into the manifest as a JSON escape that no reader accepts back: the step was
    reported saved and then never listed, an overwrite replaced a good step with it, and in
    object storage retention deleted the last good one. Now refused up front."""
    import uuid

    from tdckpt.errors import MetadataError
    from tdckpt.retention import KeepLast

    root = f"memory://s{uuid.uuid4().hex[:12]}/run" if how == "memory" else tmp_path / "run"
    td = TensorDict(w=torch.arange(3.0))
    with CheckpointManager(root, retention=KeepLast(1), fsync=False) as mgr:
        mgr.save(1, td, metadata={"note": "fine"})
        with pytest.raises(MetadataError, match=r"metadata\['note'\]: .*lone surrogate"):
            if how == "save_async":
                mgr.save_async(2, td, metadata={"note": "\udcff"}).result()
            else:
                step = 1 if how == "overwrite" else 2
                mgr.save(step, td, metadata={"note": "\udcff"}, overwrite=how == "overwrite")
        assert mgr.steps() == [1]
        assert mgr.metadata(1) == {"note": "fine"}
        assert torch.equal(mgr.restore(1)["w"], td["w"])
        assert mgr.verify().ok


def test_a_step_deleted_by_another_writer_while_verified_is_not_found_not_damaged(
    tmp_path: Path,
) -> None:
    """Another process's retention may delete a step this manager is verifying (its pins
    protect the step from its own retention only): verify reported every file missing, and
    restore_into(verify=True) an IntegrityError, as if the step were damaged. Both now say
    the step is no longer committed."""
    from tdckpt.errors import CheckpointNotFoundError
    from tdckpt.retention import KeepLast

    td = TensorDict({f"l{i}": torch.zeros(1000) for i in range(4)})
    with (
        CheckpointManager(tmp_path, retention=KeepLast(1), fsync=False) as writer,
        CheckpointManager(tmp_path) as reader,  # another process, as far as pins go
    ):
        writer.save(1, td)
        fired: list[int] = []

        def progress(done: int, total: int) -> None:
            if not fired:
                fired.append(done)
                writer.save(2, td)  # commits, and KeepLast(1) deletes the step being read

        with pytest.raises(CheckpointNotFoundError, match=r"no committed step 1 \(committed"):
            reader.verify(1, progress=progress)
        assert fired
        assert reader.verify(2).ok
