"""The single-writer lock: refusal of live holders, takeover of dead ones, release."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import subprocess_env

from tdckpt._write import lock as _lock
from tdckpt._write.lock import LOCK_NAME, LockInfo, RootLock, read_lock_info
from tdckpt.errors import LockError, TdckptError
from tdckpt.warnings import TdckptWarning


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(root: Path, **fields: object) -> Path:
    info = {"host": socket.gethostname(), "pid": os.getpid(), "created": "then", "manager_id": "m"}
    info.update(fields)
    path = root / LOCK_NAME
    path.write_text(json.dumps(info))
    return path


def test_acquire_writes_who_holds_it_and_release_removes_it(tmp_path: Path) -> None:
    lock = RootLock(tmp_path, manager_id="abc")
    assert not lock.held
    lock.acquire()
    assert lock.held
    info = read_lock_info(tmp_path)
    assert info == LockInfo(
        host=socket.gethostname(), pid=os.getpid(), created=info.created, manager_id="abc"
    )
    lock.release()
    lock.release()  # idempotent
    assert not (tmp_path / LOCK_NAME).exists() and not lock.held
    assert read_lock_info(tmp_path) is None


def test_second_lock_in_the_same_process_is_refused(tmp_path: Path) -> None:
    with RootLock(tmp_path, manager_id="first"):
        second = RootLock(tmp_path, manager_id="second")
        with pytest.raises(LockError) as info:
            second.acquire()
        message = str(info.value)
        assert f"pid {os.getpid()}" in message and socket.gethostname() in message
        assert str(tmp_path / LOCK_NAME) in message and "manager first" in message
        assert "Close that CheckpointManager" in message
        assert info.value.pid == os.getpid()  # type: ignore[attr-defined]
        assert isinstance(info.value, TdckptError)
        assert not second.held
    # released: now it can be taken
    with RootLock(tmp_path, manager_id="second") as again:
        assert again.held


def test_acquire_twice_is_a_no_op(tmp_path: Path) -> None:
    with RootLock(tmp_path, manager_id="a") as lock:
        lock.acquire()
        assert lock.held


def test_a_stale_lock_of_a_dead_pid_is_taken_over(tmp_path: Path) -> None:
    dead = _dead_pid()
    _write_lock(tmp_path, pid=dead, manager_id="gone")
    lock = RootLock(tmp_path, manager_id="new")
    with pytest.warns(TdckptWarning, match=rf"took over the lock .* pid {dead} .*manager gone"):
        lock.acquire()
    assert read_lock_info(tmp_path).manager_id == "new"  # type: ignore[union-attr]
    lock.release()


def test_a_lock_file_whose_flock_is_free_is_stale_even_with_a_live_pid(tmp_path: Path) -> None:
    # The recorded pid is alive (ours), but nobody holds the flock: its writer is gone
    # (pid reuse, or a manager that was garbage-collected without unlinking).
    _write_lock(tmp_path, pid=os.getpid(), manager_id="old")
    with pytest.warns(TdckptWarning, match="took over"), RootLock(tmp_path, manager_id="new"):
        pass


def test_a_held_flock_is_never_broken_even_if_the_recorded_pid_is_dead(tmp_path: Path) -> None:
    # The flock is the truth: a holder whose pid is not visible here (another pid
    # namespace, or a descriptor inherited by another process) still holds the lock.
    path = _write_lock(tmp_path, pid=_dead_pid(), manager_id="parent")
    fd = os.open(path, os.O_RDWR)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(LockError, match="not visible from this process"):
            RootLock(tmp_path, manager_id="new").acquire()
        assert path.exists()
        assert read_lock_info(tmp_path).manager_id == "parent"  # type: ignore[union-attr]
    finally:
        os.close(fd)
    with (
        pytest.warns(TdckptWarning, match="took over"),
        RootLock(tmp_path, manager_id="new") as lock,
    ):
        assert lock.held


def test_a_fresh_empty_lock_file_is_being_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its creator is between O_EXCL and writing its name: wait, then (if it never
    # finishes) treat it as abandoned.
    monkeypatch.setattr(_lock, "_FRESH_SECONDS", 0.3)
    (tmp_path / LOCK_NAME).write_bytes(b"")
    with (
        pytest.warns(TdckptWarning, match="unknown writer"),
        RootLock(tmp_path, manager_id="new") as lock,
    ):
        assert lock.held


def test_without_flock_a_live_pid_holds_and_a_dead_one_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_lock, "try_flock", lambda fd: None)  # e.g. an NFS mount without locks
    _write_lock(tmp_path, pid=os.getpid())
    with pytest.raises(LockError, match="does not support flock"):
        RootLock(tmp_path, manager_id="x").acquire()
    _write_lock(tmp_path, host="elsewhere.example", pid=1)
    with pytest.raises(LockError, match="another host; if you are sure it is gone, delete"):
        RootLock(tmp_path, manager_id="x").acquire()
    _write_lock(tmp_path, pid=_dead_pid())
    with pytest.warns(TdckptWarning, match="took over"), RootLock(tmp_path, manager_id="x"):
        pass


def test_release_in_a_forked_child_keeps_the_parents_lock(tmp_path: Path) -> None:
    with RootLock(tmp_path, manager_id="parent") as lock:
        fd = os.open(lock.path, os.O_RDONLY)
        _lock._release(fd, lock.path, owner_pid=os.getpid() + 1)  # "another" process
        assert lock.path.exists()


def test_a_second_process_is_refused_and_its_death_frees_the_lock(tmp_path: Path) -> None:
    from tdckpt.manager import CheckpointManager

    script = textwrap.dedent(
        f"""
        import sys
        from tdckpt.manager import CheckpointManager
        mgr = CheckpointManager({str(tmp_path)!r})
        mgr.gc()  # a write: takes the lock and keeps it until close()
        print("locked", mgr.id, flush=True)
        sys.stdin.readline()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert child.stdout is not None
        word, child_id = child.stdout.readline().split()
        assert word == "locked"
        with pytest.raises(LockError, match=rf"pid {child.pid} on host") as info:
            CheckpointManager(tmp_path).gc()
        assert info.value.manager_id == child_id  # type: ignore[attr-defined]
        with pytest.raises(LockError, match=str(tmp_path / LOCK_NAME)):
            RootLock(tmp_path, manager_id="parent").acquire()
        assert CheckpointManager(tmp_path).steps() == []  # reading needs no lock
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
    assert (tmp_path / LOCK_NAME).exists()  # SIGKILL: no cleanup ran
    with (
        pytest.warns(TdckptWarning, match=rf"pid {child.pid}"),
        RootLock(tmp_path, manager_id="parent") as lock,
    ):
        assert lock.held


def test_an_unopenable_lock_path_is_reported(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).mkdir()
    with pytest.raises(LockError, match="cannot open the lock file"):
        RootLock(tmp_path, manager_id="x").acquire()
