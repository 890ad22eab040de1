"""The commit protocol: names, staging, rename, overwrite swap, retire, recovery, SIGKILL."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import subprocess_env
from tensordict import TensorDict

from tdckpt._store.local import LocalStepStore
from tdckpt._write import atomic as _atomic
from tdckpt._write.atomic import (
    is_tmp_name,
    parse_step_name,
    recover_or_remove,
    retire,
    step_archive_name,
    step_name,
    tmp_name,
)
from tdckpt._write.save import write_checkpoint
from tdckpt.errors import CheckpointExistsError
from tdckpt.manager import CheckpointManager
from tdckpt.warnings import TdckptWarning

TESTS = Path(__file__).resolve().parent


# -- names ----------------------------------------------------------------------------------


def test_step_names() -> None:
    assert step_name(0) == "0" and step_name(1000) == "1000"
    assert step_archive_name(12) == "12.tdz"
    for bad in (-1, True, 1.0, "3", None):
        with pytest.raises(ValueError, match="non-negative int"):
            step_name(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("0", (0, "dir")),
        ("1000", (1000, "dir")),
        ("7.tdz", (7, "archive")),
        ("007", None),
        ("+7", None),
        ("-1", None),
        ("7.tdz.tdz", None),
        ("1e3", None),
        ("٣", None),  # a non-ASCII digit
        ("7 ", None),
        ("notes", None),
        ("7.tmp-" + "a" * 32, None),
        (".tdckpt.lock", None),
    ],
)
def test_parse_step_name(name: str, parsed: Any) -> None:
    assert parse_step_name(name) == parsed


def test_tmp_names() -> None:
    a, b = tmp_name(5), tmp_name(5)
    assert a != b and a.startswith("5.tmp-")
    for name in (a, tmp_name(5, tag="deleting"), tmp_name(5, archive=True), ".5.tdz.0a1b2c.tmp"):
        assert is_tmp_name(name), name
        assert parse_step_name(name) is None  # never listed as a step
    for name in ("5", "notes.tmp-" + "0" * 32, "5.tmp-xyz", "05.tmp-" + "0" * 32, "x.tmp"):
        assert not is_tmp_name(name), name


# -- the local store's commit protocol -------------------------------------------------------


def commit_directory(
    root: Path, step: int, write: Any, *, overwrite: bool = False, archive: bool = False
) -> tuple[Path, Any]:
    """Begin an attempt in the local store, fill it with ``write``, commit it (abort on an
    error) - what the manager and the sharded save do."""
    store = LocalStepStore(
        root,
        state=threading.RLock(),
        manager_id="test",
        archive=archive,
        fsync=True,
        checksum="crc32",
        compression="stored",
        layout="memmap",
    )
    attempt = store.begin(step, overwrite=overwrite)
    try:
        result = write(Path(attempt.where))
    except BaseException:
        store.abort(attempt)
        raise
    return store.commit(attempt, stacklevel=2), result


def _writer(td: TensorDict) -> Any:
    def write(staging: Path) -> Any:
        assert staging.parent.is_dir() and is_tmp_name(staging.name)
        return write_checkpoint(td, staging, fsync=False)

    return write


def test_commit_directory(tmp_path: Path) -> None:
    path, manifest = commit_directory(tmp_path, 3, _writer(TensorDict(a=torch.ones(2))))
    assert path == tmp_path / "3"
    assert sorted(os.listdir(tmp_path)) == ["3"]  # no staging left
    assert TensorDict.load_memmap(path)["a"].tolist() == [1.0, 1.0]
    assert manifest.files


def test_commit_refuses_an_existing_step_before_writing(tmp_path: Path) -> None:
    commit_directory(tmp_path, 3, _writer(TensorDict(a=torch.ones(2))))
    called = []
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        commit_directory(tmp_path, 3, called.append)
    assert called == [] and sorted(os.listdir(tmp_path)) == ["3"]


def test_commit_refuses_a_step_that_appears_while_writing(tmp_path: Path) -> None:
    def write(staging: Path) -> None:
        write_checkpoint(TensorDict(a=torch.ones(2)), staging, fsync=False)
        (tmp_path / "3").mkdir()
        (tmp_path / "3" / "foreign").write_text("x")

    with pytest.raises(CheckpointExistsError):
        commit_directory(tmp_path, 3, write)
    assert sorted(os.listdir(tmp_path)) == ["3"]
    assert os.listdir(tmp_path / "3") == ["foreign"]


def test_a_failing_write_leaves_nothing(tmp_path: Path) -> None:
    def write(staging: Path) -> None:
        (staging / "partial").write_bytes(b"x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        commit_directory(tmp_path, 3, write)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_overwrite_swaps_the_step(
    exchange: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not exchange:
        monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)
    commit_directory(tmp_path, 3, _writer(TensorDict(a=torch.zeros(2))))
    commit_directory(tmp_path, 3, _writer(TensorDict(b=torch.ones(2))), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["3"]
    assert list(TensorDict.load_memmap(tmp_path / "3").keys()) == ["b"]


def test_crash_between_the_two_renames_is_recovered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without RENAME_EXCHANGE, a crash after the old step went aside: gc puts it back."""
    commit_directory(tmp_path, 3, _writer(TensorDict(a=torch.zeros(2))))
    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)
    real_rename = os.rename
    calls = []

    def crashing_rename(src: Any, dst: Any) -> None:
        calls.append((src, dst))
        if len(calls) == 2:  # staging -> 3: the process "dies" here
            raise KeyboardInterrupt
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crashing_rename)
    # Simulate the crash: neither the except-clause rename-back nor the cleanup may run.
    monkeypatch.setattr(_atomic.shutil, "rmtree", lambda *a, **k: None)
    with pytest.raises(KeyboardInterrupt):
        commit_directory(tmp_path, 3, _writer(TensorDict(b=torch.ones(2))), overwrite=True)
    monkeypatch.undo()
    names = os.listdir(tmp_path)
    assert "3" in names  # the except clause renamed it back already
    # Now the harder case: the rename-back never ran (SIGKILL). Recreate that state.
    aside = tmp_path / tmp_name(3, tag="replaced")
    os.rename(tmp_path / "3", aside)
    assert parse_step_name(aside.name) is None
    for name in sorted(os.listdir(tmp_path)):
        recover_or_remove(tmp_path, name)
    assert sorted(os.listdir(tmp_path)) == ["3"]
    assert list(TensorDict.load_memmap(tmp_path / "3").keys()) == ["a"]


def test_a_replaced_folder_is_removed_when_the_step_exists(tmp_path: Path) -> None:
    (tmp_path / "3").mkdir()
    aside = tmp_path / tmp_name(3, tag="replaced")
    aside.mkdir()
    assert recover_or_remove(tmp_path, aside.name) == aside
    assert sorted(os.listdir(tmp_path)) == ["3"]


def test_rename_noreplace_without_renameat2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_atomic, "_renameat2", None)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        _atomic.rename_noreplace(tmp_path / "a", tmp_path / "b")
    _atomic.rename_noreplace(tmp_path / "a", tmp_path / "c")
    assert sorted(os.listdir(tmp_path)) == ["b", "c"]


def test_rename_noreplace_refuses_even_an_empty_directory(tmp_path: Path) -> None:
    # plain os.rename would silently replace an empty directory
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(CheckpointExistsError):
        _atomic.rename_noreplace(tmp_path / "a", tmp_path / "b")


def test_commit_fsyncs_the_root_after_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real = _atomic.fsync_dir
    real_rename = _atomic.rename_noreplace

    def fsync_dir(path: Any) -> None:
        events.append(f"fsync {Path(path).name}")
        real(path)

    def rename(src: Path, dst: Path) -> None:
        events.append(f"rename {dst.name}")
        real_rename(src, dst)

    monkeypatch.setattr(_atomic, "fsync_dir", fsync_dir)
    monkeypatch.setattr(_atomic, "rename_noreplace", rename)
    commit_directory(tmp_path, 4, _writer(TensorDict(a=torch.ones(1))))
    assert events == ["rename 4", f"fsync {tmp_path.name}"]


def test_retire_then_remove(tmp_path: Path) -> None:
    commit_directory(tmp_path, 3, _writer(TensorDict(a=torch.ones(2))))
    aside = retire(tmp_path, tmp_path / "3", 3)
    assert is_tmp_name(aside.name) and not (tmp_path / "3").exists()
    _atomic.remove_retired(aside)
    assert os.listdir(tmp_path) == []


def test_commit_archive(tmp_path: Path) -> None:
    path, _ = commit_directory(tmp_path, 5, _writer(TensorDict(a=torch.arange(3))), archive=True)
    assert path == tmp_path / "5.tdz" and sorted(os.listdir(tmp_path)) == ["5.tdz"]
    assert TensorDict.load_memmap(path)["a"].tolist() == [0, 1, 2]
    with pytest.raises(CheckpointExistsError):
        commit_directory(tmp_path, 5, _writer(TensorDict(a=torch.arange(3))), archive=True)
    commit_directory(
        tmp_path, 5, _writer(TensorDict(b=torch.ones(1))), overwrite=True, archive=True
    )
    assert list(TensorDict.load_memmap(path).keys()) == ["b"]
    assert sorted(os.listdir(tmp_path)) == ["5.tdz"]


# -- SIGKILL at random instants ------------------------------------------------------------------


def _check_root(root: Path, known: set[int]) -> list[int]:
    """Every listed step verifies and holds its own content; recent commits survived.

    ``known`` holds steps known to have been committed (logged by a writer after its save
    returned, or listed by an earlier check). KeepLast(3) deletes a step only once three
    higher ones are committed, so the highest known step is listed unless three higher
    steps are.
    """
    from _crash_child import make_td

    mgr = CheckpointManager(root)  # reading: no lock taken
    steps = mgr.steps()
    if known:
        high = max(known)
        assert high in steps or sum(s > high for s in steps) >= 3, (sorted(known)[-5:], steps)
    for step in steps:
        report = mgr.verify(step)
        assert report.ok, report.summary()
        loaded = TensorDict.load_memmap(mgr.path(step))
        want = make_td(step)
        for key in ("a", "b", ("nested", "c")):
            assert torch.equal(loaded[key], want[key]), (step, key)
        assert loaded["s"] == f"step {step}"
        assert mgr.metadata(step) == {"step": step}
    return steps


def test_sigkill_during_saves_never_damages_committed_steps(tmp_path: Path) -> None:
    if not hasattr(os, "fork"):
        pytest.skip("the crash helper forks writers")
    trials = int(os.environ.get("TDCKPT_FAULT_TRIALS", "10"))
    seed = int(os.environ.get("TDCKPT_FAULT_SEED", str(random.randrange(2**32))))
    rng = random.Random(seed)
    root, log = tmp_path / "root", tmp_path / "committed.log"
    stderr = (tmp_path / "child.stderr").open("w")
    child = subprocess.Popen(
        [sys.executable, str(TESTS / "_crash_child.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=subprocess_env(),
    )
    assert child.stdin is not None and child.stdout is not None
    interrupted = 0
    known: set[int] = set()
    try:
        for trial in range(trials):
            archive = int(trial % 3 == 2)
            child.stdin.write(f"run {root} {archive} {log}\n")
            child.stdin.flush()
            pid = int(child.stdout.readline().split()[1])
            time.sleep(rng.uniform(0.02, 0.6))
            os.kill(pid, signal.SIGKILL)
            status = int(child.stdout.readline().split()[1])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"trial {trial} (seed {seed}): the writer died by itself; see "
                f"{tmp_path / 'child.stderr'}: {(tmp_path / 'child.stderr').read_text()[-2000:]}"
            )
            if not root.exists():
                # Killed before its first save made the root (a loaded machine): nothing
                # was committed (the writer may have opened its log, the root comes with
                # the first save), so there is nothing to check in this trial.
                assert not log.exists() or not log.read_text().strip()
                continue
            if log.exists():
                known.update(int(x) for x in log.read_text().split())
            known.update(_check_root(root, known))
            leftovers = [n for n in os.listdir(root) if is_tmp_name(n)]
            interrupted += bool(leftovers)
            listed = CheckpointManager(root).steps()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with CheckpointManager(root) as mgr:
                    removed = mgr.gc()
            # The killed writer's lock is taken over, with a warning saying so.
            assert all(issubclass(w.category, TdckptWarning) for w in caught), caught
            assert all("took over the lock" in str(w.message) for w in caught)
            assert sorted(p.name for p in removed) == sorted(leftovers)
            assert not [n for n in os.listdir(root) if is_tmp_name(n)]
            assert ".tdckpt.lock" not in os.listdir(root)
            assert CheckpointManager(root).steps() == listed
    finally:
        child.stdin.write("quit\n")
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()
        stderr.close()
    if trials >= 5:
        # Nearly all of a writer's time is spent inside a save: most kills interrupt one.
        assert interrupted >= 1, f"no kill landed inside a save (seed {seed})"


_OVERWRITE_KILLED = r"""
import os, sys, torch
from tensordict import TensorDict
from tdckpt import CheckpointManager
from tdckpt._store import local
def die(*a, **k):
    os._exit(9)  # the instant after the new form's commit, before the old one is retired
local.LocalStepStore._retire_paths = die
with CheckpointManager(sys.argv[1], archive=sys.argv[2] == "archive", fsync=False) as m:
    m.save(5, TensorDict(w=torch.ones(3)), overwrite=True, metadata={"v": "new"})
"""


@pytest.mark.parametrize("new_form", ["archive", "dir"])
def test_an_overwrite_that_changes_the_form_and_is_killed_reads_one_way(
    tmp_path: Path, new_form: str
) -> None:
    """An overwrite from a folder to an archive (or back) commits the new form, then removes
    the old one: killed in between, both were listed as committed, each reader read the
    form its own manager writes, and gc kept both. Every reader now reads the newer one,
    and gc removes the older."""
    import subprocess
    import sys

    import torch
    from conftest import subprocess_env
    from tensordict import TensorDict

    from tdckpt import CheckpointManager

    with CheckpointManager(tmp_path, archive=new_form == "dir", fsync=False) as mgr:
        mgr.save(5, TensorDict(w=torch.zeros(3)), metadata={"v": "old"})
    child = subprocess.run(
        [sys.executable, "-c", _OVERWRITE_KILLED, str(tmp_path), new_form],
        env=subprocess_env(),
        capture_output=True,
        timeout=120,
    )
    assert child.returncode == 9, child.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "5",
        "5.tdz",
    ]
    for archive in (False, True):
        with CheckpointManager(tmp_path, archive=archive) as reader:
            assert reader.metadata(5) == {"v": "new"}
            assert reader.restore(5)["w"].tolist() == [1.0, 1.0, 1.0]
    with CheckpointManager(tmp_path) as mgr:
        with pytest.warns(TdckptWarning, match="took over the lock .* no longer running"):
            (gone,) = mgr.gc()  # (the killed writer's lock is taken over, with a warning)
        assert gone.name == ("5" if new_form == "archive" else "5.tdz")
        assert [(s.step, s.status) for s in mgr.list_steps()] == [(5, "committed")]
        assert mgr.verify(5).ok and mgr.metadata(5) == {"v": "new"}
