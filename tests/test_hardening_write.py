"""Hardening of the write side: the writer lock, ``tdckpt.save``'s protocol, gc and retention.

* The lock: the flock is the truth. A held flock is never broken, whatever pid the file
  records (one from another pid namespace, an exited one, garbage); hostile lock files
  (symlink, FIFO, hard link, directory, junk) are refused or read as "unknown holder",
  and nothing outside the root is ever written.
* ``tdckpt.save``: overwrite of a directory or an archive is atomic; a saver SIGKILLed at
  every stage of the protocol leaves the prefix loadable as old or new (or, without
  ``RENAME_EXCHANGE``, a documented state the next save recovers), and the next save
  cleans every leftover - only the names the journal derives, never through a link.
* The manager's gc and retention never delete through a symlink.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _save_crash_child import make_td, value_of
from _unprivileged import run_unprivileged
from conftest import subprocess_env
from tensordict import TensorDict

import tdckpt
from tdckpt._write import atomic as _atomic
from tdckpt._write import export as _export
from tdckpt._write import lock as _lock
from tdckpt._write.export import JOURNAL_SUFFIX
from tdckpt._write.lock import LOCK_NAME, RootLock, read_lock_info
from tdckpt.errors import CheckpointExistsError, LockError, UnsafePathError
from tdckpt.manager import CheckpointManager
from tdckpt.retention import KeepLast
from tdckpt.warnings import TdckptWarning

TESTS = Path(__file__).resolve().parent
REPO = Path(tdckpt.__file__).resolve().parent.parent
#: Children import this checkout's tdckpt (and tests/ for the helpers), not an installed one.
CHILD_ENV = subprocess_env({"PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])})


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _lock_json(**fields: object) -> bytes:
    info: dict[str, object] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "created": "then",
        "manager_id": "m",
    }
    info.update(fields)
    return json.dumps(info).encode()


# -- the lock: a live holder in another process --------------------------------------------

_HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys
    path = sys.argv[1]
    with open(sys.argv[2], "rb") as fh:
        data = fh.read()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    print("locked", flush=True)
    sys.stdin.readline()
    """
)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Any]:
    """Start a process that holds the root's flock and wrote the given lock file bytes."""
    procs: list[subprocess.Popen[str]] = []

    def start(data: bytes) -> subprocess.Popen[str]:
        source = tmp_path.parent / f"{tmp_path.name}-lock-contents"
        source.write_bytes(data)
        proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(tmp_path / LOCK_NAME), str(source)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize(
    "pid", [2**22 + 12345, None], ids=["pid-of-another-namespace", "pid-of-an-exited-process"]
)
def test_a_held_flock_with_an_invisible_pid_is_refused(
    tmp_path: Path, holder: Any, pid: int | None
) -> None:
    # Containers of one pod share the host name but not their pid namespace: the holder's
    # pid is not visible here, yet it is alive and holds the flock.
    recorded = _dead_pid() if pid is None else pid
    holder(_lock_json(pid=recorded, manager_id="other-container"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no takeover warning either
        with pytest.raises(LockError) as info:
            CheckpointManager(tmp_path).save(1, make_td(1))
    message = str(info.value)
    assert f"pid {recorded}" in message and "manager other-container" in message
    assert "not visible from this process" in message and "another pid namespace" in message
    assert (tmp_path / LOCK_NAME).exists()
    assert read_lock_info(tmp_path).manager_id == "other-container"  # type: ignore[union-attr]
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]  # nothing was written


@pytest.mark.parametrize(
    "data",
    [
        _lock_json(pid=10**30),
        _lock_json(pid=-5),
        _lock_json(pid=0),
        _lock_json(pid=True),
        _lock_json(pid=1.5),
        b'{"host": "h", "pid": Infinity, "created": "c", "manager_id": "m"}',
        b"[" * 100_000,
        b"\xff\xfe\x00garbage",
        b"x" * (1 << 20),
        b'["a", "list"]',
        _lock_json(host=["not", "a", "str"]),
    ],
    ids=[
        "huge-pid",
        "negative-pid",
        "pid-0",
        "bool-pid",
        "float-pid",
        "infinite-pid",
        "deep-nesting",
        "non-utf8",
        "one-mib",
        "a-list",
        "host-not-a-str",
    ],
)
def test_hostile_lock_contents_held_are_refused_and_free_are_taken_over(
    tmp_path: Path, holder: Any, data: bytes
) -> None:
    proc = holder(data)
    with pytest.raises(LockError, match="another writer holds this checkpoint root"):
        RootLock(tmp_path, manager_id="new").acquire()
    assert (tmp_path / LOCK_NAME).read_bytes() == data  # never rewritten while held
    proc.kill()
    proc.wait()
    old = time.time() - 60  # past the "being created" grace of a nameless lock file
    os.utime(tmp_path / LOCK_NAME, (old, old))
    with pytest.warns(TdckptWarning, match="took over"), RootLock(tmp_path, manager_id="new"):
        assert read_lock_info(tmp_path).manager_id == "new"  # type: ignore[union-attr]


def test_a_huge_pid_without_flock_is_refused_not_an_overflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_lock, "try_flock", lambda fd: None)  # e.g. NFS without locks
    for pid in (10**30, -5):
        (tmp_path / LOCK_NAME).write_bytes(_lock_json(pid=pid))
        with pytest.raises(LockError, match="does not support flock"):
            RootLock(tmp_path, manager_id="x").acquire()
        assert (tmp_path / LOCK_NAME).read_bytes() == _lock_json(pid=pid)
    assert _lock._pid_alive(10**30) is False and _lock._pid_alive(-1) is False


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "precious.txt"
    root.mkdir()
    outside.write_bytes(_lock_json(manager_id="planted"))
    (root / LOCK_NAME).symlink_to(outside)
    with pytest.raises(LockError, match="symbolic link") as info:
        CheckpointManager(root).save(1, make_td(1))
    assert str(root / LOCK_NAME) in str(info.value)
    assert outside.read_bytes() == _lock_json(manager_id="planted")
    assert (root / LOCK_NAME).is_symlink()
    assert read_lock_info(root) is None  # never read through the link either
    # A dangling link (its target created through it) is refused the same way.
    (root / LOCK_NAME).unlink()
    (root / LOCK_NAME).symlink_to(tmp_path / "created-through-the-link")
    with pytest.raises(LockError, match="symbolic link"):
        RootLock(root, manager_id="x").acquire()
    assert not (tmp_path / "created-through-the-link").exists()


def test_a_hard_linked_lock_file_is_never_written(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "precious.txt"
    root.mkdir()
    outside.write_bytes(b"user data, not a lock")
    os.link(outside, root / LOCK_NAME)
    with pytest.raises(LockError, match="2 hard links"):
        RootLock(root, manager_id="x").acquire()
    assert outside.read_bytes() == b"user data, not a lock"


def test_a_fifo_or_directory_lock_path_is_refused_without_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / LOCK_NAME)

    def hung(signum: int, frame: object) -> None:
        raise AssertionError("acquire blocked on the FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(LockError, match="not a regular file"):
            RootLock(tmp_path, manager_id="x").acquire()
        assert read_lock_info(tmp_path) is None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    (tmp_path / LOCK_NAME).unlink()
    (tmp_path / LOCK_NAME).mkdir()
    with pytest.raises(LockError, match="cannot open the lock file"):
        CheckpointManager(tmp_path).gc()
    assert (tmp_path / LOCK_NAME).is_dir()


def test_a_read_only_root_gets_a_lock_error() -> None:
    base = Path(tempfile.mkdtemp(prefix="tdckpt-ro-root-"))  # tmp_path is private to root
    root = base / "run"
    root.mkdir()
    base.chmod(0o755)
    root.chmod(0o555)

    def refused() -> str:
        try:
            CheckpointManager(root).gc()
        except LockError as exc:
            return str(exc)
        raise AssertionError("a root this user cannot write was locked")

    try:
        message = run_unprivileged(refused)  # as uid 65534: root ignores modes
        assert isinstance(message, str)
        assert re.search("cannot create the lock file .*writable", message, re.S), message
        assert list(root.iterdir()) == []
    finally:
        root.chmod(0o755)
        shutil.rmtree(base)


def test_a_read_only_root_gets_a_lock_error_even_as_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def read_only_open(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(_lock.os, "open", read_only_open)
    with pytest.raises(LockError, match=r"cannot create the lock file .*Permission denied"):
        RootLock(tmp_path, manager_id="x").acquire()


# -- the lock and fork ------------------------------------------------------------------------


def test_a_forked_child_lets_go_of_its_parents_lock(tmp_path: Path) -> None:
    # Writer A forks B (say a data-loader worker) and dies; B lives on. B must not keep
    # the lock: the next writer takes it over (B closed its copy of the descriptor).
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from tdckpt._write.lock import RootLock
        lock = RootLock({str(tmp_path)!r}, manager_id="parent")
        lock.acquire()
        ready_r, ready_w = os.pipe()
        child = os.fork()
        if child == 0:
            assert not lock.held
            os.write(ready_w, b"x")  # the at-fork handler has run: the child let go
            time.sleep(120)
            os._exit(0)
        # Until the child is first scheduled, its inherited descriptor still holds the
        # flock (the kernel's, not ours to close): wait for it, as a loaded machine may not
        # have run the child yet when A dies.
        os.read(ready_r, 1)
        print(child, flush=True)
        sys.stdin.readline()
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=CHILD_ENV,
    )
    child = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        with pytest.raises(LockError, match="manager parent"):
            RootLock(tmp_path, manager_id="new").acquire()
        parent.kill()
        parent.wait()
        os.kill(child, 0)  # the forked child still runs
        with (
            pytest.warns(TdckptWarning, match="took over .*manager parent"),
            RootLock(tmp_path, manager_id="new") as lock,
        ):
            assert lock.held
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for stream in (parent.stdin, parent.stdout):
            if stream is not None:
                stream.close()


def test_a_manager_in_a_forked_child_must_take_the_lock_again(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, fsync=False)
    mgr.gc()  # takes the lock
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            try:
                mgr.gc()
            except LockError:
                code = 0
            else:
                code = 5  # wrote without holding the lock
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert mgr._lock is not None and mgr._lock.held
    mgr.save(1, make_td(1))  # the parent still holds it
    mgr.close()
    assert not (tmp_path / LOCK_NAME).exists()


# -- tdckpt.save: overwrite -----------------------------------------------------------------


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "no-exchange"])
@pytest.mark.parametrize("name", ["ckpt", "ckpt.tdz"])
def test_save_overwrite_replaces_a_directory_or_an_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, exchange: bool
) -> None:
    if not exchange:
        monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)
    prefix = tmp_path / name
    first = tdckpt.save(make_td(1), prefix, metadata={"v": 1})
    assert first.user_metadata == {"v": 1}
    assert value_of(tdckpt.load_memmap(prefix)) == 1
    with pytest.raises(CheckpointExistsError, match="Pass overwrite=True"):
        tdckpt.save(make_td(2), prefix)
    assert value_of(tdckpt.load_memmap(prefix)) == 1
    tdckpt.save(make_td(2), prefix, overwrite=True, metadata={"v": 2})
    assert value_of(tdckpt.load_memmap(prefix)) == 2
    assert value_of(TensorDict.load_memmap(prefix)) == 2  # plain tensordict reads it
    assert tdckpt.validate(prefix).ok
    assert os.listdir(tmp_path) == [name]  # no journal, staging or old tree left


def test_save_overwrite_of_a_symlinked_prefix_leaves_its_target_alone(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    tdckpt.save(make_td(1), outside)
    before = sorted(p.relative_to(outside) for p in outside.rglob("*"))
    (tmp_path / "out").mkdir()
    link = tmp_path / "out" / "ckpt"
    link.symlink_to(outside)
    tdckpt.save(make_td(2), link, overwrite=True)
    assert not link.is_symlink() and value_of(tdckpt.load_memmap(link)) == 2
    assert sorted(p.relative_to(outside) for p in outside.rglob("*")) == before
    assert value_of(tdckpt.load_memmap(outside)) == 1


def test_a_failed_save_leaves_nothing_and_no_journal(tmp_path: Path) -> None:
    from tdckpt.errors import UnsupportedContentError

    prefix = tmp_path / "ckpt"
    tdckpt.save(make_td(1), prefix)
    bad = TensorDict({"shape": torch.zeros(2)})  # a key tensordict would overwrite
    with pytest.raises(UnsupportedContentError):
        tdckpt.save(bad, prefix, overwrite=True)
    assert os.listdir(tmp_path) == ["ckpt"] and value_of(tdckpt.load_memmap(prefix)) == 1


def test_save_refuses_a_prefix_without_a_name_of_its_own(tmp_path: Path) -> None:
    for prefix in (tmp_path / "..", Path("."), Path("")):
        with pytest.raises(UnsafePathError, match="names no file or directory of its own"):
            tdckpt.save(make_td(1), prefix, overwrite=True)
    with pytest.raises(UnsafePathError, match="too long"):
        tdckpt.save(make_td(1), tmp_path / ("x" * 240), overwrite=True)
    assert os.listdir(tmp_path) == []


# -- tdckpt.save: the journal ---------------------------------------------------------------


def _journal(prefix: Path) -> Path:
    return prefix.parent / f".{prefix.name}{JOURNAL_SUFFIX}"


def _plant_journal(prefix: Path, token: str, fields: dict[str, object] | None = None) -> Path:
    record: dict[str, object] = {"tdckpt_save": 1, "prefix": prefix.name, "token": token}
    record.update(fields or {})
    path = _journal(prefix)
    path.write_text(json.dumps(record))
    return path


def test_a_save_in_progress_of_the_same_prefix_is_refused(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    tdckpt.save(make_td(1), prefix)
    journal = _plant_journal(prefix, "0" * 16)
    fd = os.open(journal, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "another save" holds it
        with pytest.raises(LockError, match=r"another tdckpt\.save of this prefix is in progress"):
            tdckpt.save(make_td(2), prefix, overwrite=True)
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", journal.name])
    assert value_of(tdckpt.load_memmap(prefix)) == 1


def test_without_flock_only_an_old_journal_is_recovered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_export, "try_flock", lambda fd: None)  # e.g. NFS without locks
    prefix = tmp_path / "ckpt"
    tdckpt.save(make_td(1), prefix)
    token = "12" * 8
    (tmp_path / f".ckpt.tmp-{token}").mkdir()
    journal = _plant_journal(prefix, token)
    with pytest.raises(LockError, match="is recent and cannot be locked here"):
        tdckpt.save(make_td(2), prefix, overwrite=True)
    assert (tmp_path / f".ckpt.tmp-{token}").is_dir()
    old = time.time() - 3600
    os.utime(journal, (old, old))
    with pytest.warns(TdckptWarning, match=f"removed .ckpt.tmp-{token}"):
        tdckpt.save(make_td(2), prefix, overwrite=True)
    assert os.listdir(tmp_path) == ["ckpt"] and value_of(tdckpt.load_memmap(prefix)) == 2


def test_recovery_warns_at_the_callers_line(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    tdckpt.save(make_td(1), prefix)
    token = "ab" * 8
    staging = tmp_path / f".ckpt.tmp-{token}"
    staging.mkdir()
    (staging / "a.memmap").write_bytes(b"partial")
    _plant_journal(prefix, token)
    with pytest.warns(TdckptWarning) as caught:
        tdckpt.save(make_td(2), prefix, overwrite=True)
    (warning,) = caught
    assert warning.filename == __file__
    assert str(warning.message) == (
        f"{prefix}: an earlier tdckpt.save of this prefix was interrupted; recovered it "
        f"(removed .ckpt.tmp-{token}). {prefix} holds the last checkpoint that was "
        "completely saved."
    )
    assert os.listdir(tmp_path) == ["ckpt"] and value_of(tdckpt.load_memmap(prefix)) == 2


@pytest.mark.parametrize(
    "record",
    [
        {"prefix": "../../etc/passwd"},
        {"prefix": "other"},
        {"token": "../../outside"},
        {"token": "A" * 16},
        {"tdckpt_save": 2},
    ],
    ids=["prefix-path", "other-prefix", "token-path", "token-uppercase", "newer"],
)
def test_a_journal_naming_anything_else_is_refused_and_nothing_removed(
    tmp_path: Path, record: dict[str, object]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    prefix = out / "ckpt"
    tdckpt.save(make_td(1), prefix)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep").write_text("keep")
    journal = _plant_journal(prefix, "0" * 16, record)
    before = sorted(os.listdir(out))
    with pytest.raises(UnsafePathError, match="not a save journal tdckpt wrote") as info:
        tdckpt.save(make_td(2), prefix, overwrite=True)
    assert str(journal) in str(info.value) and "Nothing was changed" in str(info.value)
    assert sorted(os.listdir(out)) == before and (tmp_path / "outside" / "keep").exists()
    assert value_of(tdckpt.load_memmap(prefix)) == 1


def test_a_symlinked_or_junk_journal_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    outside = tmp_path / "precious"
    outside.write_text(json.dumps({"tdckpt_save": 1, "prefix": "ckpt", "token": "0" * 16}))
    _journal(prefix).symlink_to(outside)
    with pytest.raises(UnsafePathError, match="cannot open it"):
        tdckpt.save(make_td(1), prefix)
    assert outside.exists() and _journal(prefix).is_symlink() and not prefix.exists()
    _journal(prefix).unlink()
    _journal(prefix).write_bytes(b"\xff" * 10_000)
    with pytest.raises(UnsafePathError, match="too large for a save journal"):
        tdckpt.save(make_td(1), prefix)
    _journal(prefix).write_bytes(b"[" * 4000)
    with pytest.raises(UnsafePathError, match="not a save journal"):
        tdckpt.save(make_td(1), prefix)
    assert sorted(os.listdir(tmp_path)) == sorted([_journal(prefix).name, "precious"])


def test_recovery_never_follows_links_nor_touches_other_names(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    prefix = out / "ckpt"
    tdckpt.save(make_td(1), prefix)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data").write_text("keep")
    token = "cd" * 8
    (out / f".ckpt.tmp-{token}").symlink_to(victim)  # the staging name, as a link
    (out / f".ckpt.old-{token}").symlink_to(victim)
    (out / f".ckpt.{token}.tmp").symlink_to(victim / "data")
    # Names the journal does not derive: an old tdckpt's leftovers, other tokens, users'.
    foreign = [".ckpt.tmp-0123456789ab", f".ckpt.tmp-{'e' * 16}", ".ckpt.old-x", "notes"]
    for name in foreign:
        (out / name).mkdir()
    _plant_journal(prefix, token)
    with pytest.warns(TdckptWarning, match="interrupted"):
        tdckpt.save(make_td(2), prefix, overwrite=True)
    assert (victim / "data").read_text() == "keep"
    assert sorted(os.listdir(out)) == sorted(["ckpt", *foreign])
    assert value_of(tdckpt.load_memmap(prefix)) == 2


# -- tdckpt.save: SIGKILL at every stage ----------------------------------------------------


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not hasattr(os, "fork"):
        pytest.skip("the crash helper forks savers")
    log = tmp_path_factory.mktemp("zygote") / "stderr"
    stderr = log.open("w")
    child = subprocess.Popen(
        [sys.executable, str(TESTS / "_save_crash_child.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=CHILD_ENV,
    )
    assert child.stdin is not None and child.stdout is not None

    def run(prefix: Path, stage: str, exchange: bool, value: int) -> int:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(f"run {prefix} {stage} {int(exchange)} {value}\n")
        child.stdin.flush()
        line = child.stdout.readline()
        assert line.startswith("exit "), f"zygote died: {log.read_text()[-3000:]}"
        status = int(line.split()[1])
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"the saver did not die at {stage!r} (status {status}): {log.read_text()[-3000:]}"
        )
        return status

    try:
        yield run
    finally:
        child.stdin.write("quit\n")
        child.stdin.close()
        child.wait(timeout=60)
        child.stdout.close()
        stderr.close()


# (stage, exchange, what the prefix holds after the kill: 1 old, 2 new, None missing)
_DIR_STAGES = [
    ("journal-new", True, 1),
    ("journal", True, 1),
    ("partial", True, 1),
    ("written", True, 1),
    ("swapped", True, 2),
    ("cleaned", True, 2),
    ("committed", True, 2),
    ("written", False, 1),
    ("aside", False, None),  # documented: the next save renames the old tree back
    ("renamed", False, 2),
    ("cleaned", False, 2),
]
_ARCHIVE_STAGES = [
    ("journal-new", True, 1),
    ("journal", True, 1),
    ("partial", True, 1),
    ("written", True, 1),
    ("archived", True, 2),
    ("committed", True, 2),
]
_CASES = [("ckpt", *case) for case in _DIR_STAGES] + [
    ("ckpt.tdz", *case) for case in _ARCHIVE_STAGES
]


@pytest.mark.parametrize(
    ("name", "stage", "exchange", "holds"),
    _CASES,
    ids=[f"{n}-{s}-{'x' if x else 'nox'}" for n, s, x, _ in _CASES],
)
def test_sigkill_at_every_stage_of_an_overwrite(
    tmp_path: Path, zygote: Any, name: str, stage: str, exchange: bool, holds: int | None
) -> None:
    prefix = tmp_path / name
    tdckpt.save(make_td(1), prefix, fsync=False)
    zygote(prefix, stage, exchange, 2)
    leftovers = sorted(n for n in os.listdir(tmp_path) if n != name)
    if holds is None:
        assert not os.path.lexists(prefix)
        (old,) = [n for n in leftovers if n.startswith(f".{name}.old-")]
        assert value_of(tdckpt.load_memmap(tmp_path / old)) == 1  # complete, beside
    else:
        assert value_of(tdckpt.load_memmap(prefix)) == holds
    assert leftovers, "a kill inside the save left nothing behind?"
    # The next save of the prefix finishes or undoes the crashed one, then saves.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tdckpt.save(make_td(3), prefix, overwrite=True)
    assert all(issubclass(w.category, TdckptWarning) for w in caught), caught
    if stage not in ("journal-new",):
        assert [str(w.message) for w in caught if "interrupted" in str(w.message)]
    assert os.listdir(tmp_path) == [name]
    assert value_of(tdckpt.load_memmap(prefix)) == 3


def test_a_save_without_overwrite_after_a_crash_restores_the_old_tree(
    tmp_path: Path, zygote: Any
) -> None:
    prefix = tmp_path / "ckpt"
    tdckpt.save(make_td(1), prefix, fsync=False)
    zygote(prefix, "aside", False, 2)
    assert not prefix.exists()
    # The prefix is missing, but the recovery puts the old tree back: not overwritten.
    with (
        pytest.warns(TdckptWarning, match="restored the previous checkpoint"),
        pytest.raises(CheckpointExistsError, match="Pass overwrite=True"),
    ):
        tdckpt.save(make_td(3), prefix)
    assert os.listdir(tmp_path) == ["ckpt"]
    assert value_of(tdckpt.load_memmap(prefix)) == 1


# -- the manager: gc and retention never delete through a link ------------------------------


def test_gc_and_retention_never_delete_through_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    victim = tmp_path / "victim"
    tdckpt.save(make_td(9), victim)
    before = sorted(p.relative_to(victim) for p in victim.rglob("*"))
    with CheckpointManager(root, retention=KeepLast(1), fsync=False) as mgr:
        mgr.save(1, make_td(1))
        hex32 = "f" * 32
        links = {
            "0": victim,  # a step name that is a link: foreign, never listed
            f"2.tmp-{hex32}": victim,
            f"3.tmp-{hex32}.replaced": victim,  # step 3 missing: must not "recover" it
            f"4.tdz.tmp-{hex32}.deleting": victim / "meta.json",
        }
        for name, target in links.items():
            (root / name).symlink_to(target)
        mgr.save(5, make_td(5))
        mgr.save(6, make_td(6))  # retention deletes 1 and 5
        assert mgr.steps() == [6]
        removed = sorted(p.name for p in mgr.gc())
        assert removed == sorted(n for n in links if n != "0")
        assert sorted(os.listdir(root)) == [".tdckpt.lock", "0", "6"]
        assert (root / "0").is_symlink()
        # Overwriting the linked step name replaces the link, never its target.
        mgr.save(0, make_td(0), overwrite=True)
        assert not (root / "0").is_symlink() and mgr.steps() == [0, 6]
    assert sorted(p.relative_to(victim) for p in victim.rglob("*")) == before
    assert value_of(tdckpt.load_memmap(victim)) == 9


def test_remove_never_walks_a_link_to_a_directory(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_text("keep")
    link = tmp_path / f"1.tmp-{'a' * 32}"
    link.symlink_to(victim)
    assert _atomic.recover_or_remove(tmp_path, link.name, fsync=False) == link
    assert not os.path.lexists(link) and (victim / "f").read_text() == "keep"
    assert not _atomic.remove_tree(tmp_path / "missing")  # missing is fine
