"""The single-writer lock of a checkpoint root: ``<root>/.tdckpt.lock``.

One writer (save, retention, gc) per root at a time, across threads, processes and hosts
sharing the directory. Readers never take it.

How it works:

* The lock file is created atomically (``O_CREAT | O_EXCL``) and holds JSON
  ``{"host", "pid", "created", "manager_id"}`` naming its holder.
* The holder also keeps an ``fcntl.flock`` on it for the life of the lock. The kernel drops
  a flock when its holder dies, however it dies, so a lock file whose flock is free was
  left by a dead writer: it is taken over (with a :class:`~tdckpt.warnings.TdckptWarning`).
  flock conflicts between two open file descriptions even in one process, so a second
  manager in the same process is refused too.
* A held flock whose recorded holder is a dead pid on this host was inherited by a forked
  child that outlived its parent: that lock is broken too.
* On file systems without flock (some network mounts), only the pid check on the same host
  remains; a lock of another host is then never broken automatically.
* Release unlinks the file, then closes (and so unlocks) it. A contender that opened the
  old file checks, once it holds the flock, that the path still names the file it locked,
  and starts over otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import warnings
import weakref
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tdckpt.errors import LockError
from tdckpt.warnings import TdckptWarning

__all__ = ["LOCK_NAME", "LockInfo", "RootLock", "read_lock_info"]

#: The lock file's name inside the root.
LOCK_NAME = ".tdckpt.lock"
#: A lock file younger than this with no content yet is being created, not abandoned.
_FRESH_SECONDS = 5.0
_RETRY_SLEEP = 0.02
_MAX_INFO_BYTES = 64 * 1024


@dataclass(frozen=True)
class LockInfo:
    """Who holds (or held) a root's lock."""

    host: str
    pid: int
    created: str
    manager_id: str

    def describe(self) -> str:
        return (
            f"pid {self.pid} on host {self.host!r}, manager {self.manager_id}, since {self.created}"
        )


def _parse_info(data: bytes) -> LockInfo | None:
    try:
        raw = json.loads(data)
        return LockInfo(
            host=str(raw["host"]),
            pid=int(raw["pid"]),
            created=str(raw["created"]),
            manager_id=str(raw["manager_id"]),
        )
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None


def _read_fd(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, _MAX_INFO_BYTES)


def read_lock_info(root: str | os.PathLike[str]) -> LockInfo | None:
    """The holder recorded in ``root``'s lock file, or None (no lock file, or unreadable)."""
    try:
        with open(Path(root) / LOCK_NAME, "rb") as fh:
            return _parse_info(fh.read(_MAX_INFO_BYTES))
    except OSError:
        return None


def _flock(fd: int) -> bool | None:
    """Try to take the flock: True taken, False held elsewhere, None unsupported here."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
            return None
        raise
    return True


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _release(fd: int, path: Path, owner_pid: int) -> None:
    # A forked child inherits the descriptor: only the process that took the lock
    # removes the file, or a child's exit would free its parent's lock.
    try:
        if os.getpid() == owner_pid and _same_file(fd, path):
            path.unlink()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


class RootLock:
    """The lock of one root; :meth:`acquire` it, :meth:`release` it (or use ``with``).

    Args:
        root: the checkpoint root (must exist).
        manager_id: recorded in the lock file, to tell holders apart in messages.
        fsync: fsync the lock file and the root when the lock is created.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, manager_id: str, fsync: bool = True
    ) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_NAME
        self.manager_id = manager_id
        self.fsync = fsync
        self._fd: int | None = None
        self._stacklevel = 1
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def __enter__(self) -> RootLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _info(self) -> LockInfo:
        return LockInfo(
            host=socket.gethostname(),
            pid=os.getpid(),
            created=datetime.now(timezone.utc).isoformat(),
            manager_id=self.manager_id,
        )

    def _write_info(self, fd: int) -> None:
        data = json.dumps(asdict(self._info())).encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        if self.fsync:
            os.fsync(fd)

    def _hold(self, fd: int) -> None:
        self._fd = fd
        self._finalizer = weakref.finalize(self, _release, fd, self.path, os.getpid())

    def acquire(self, *, stacklevel: int = 1) -> None:
        """Take the lock, taking over one left by a dead writer.

        Args:
            stacklevel: where a takeover warning points: 1 is the caller of ``acquire``,
                2 its caller, and so on.

        Raises:
            LockError: a live writer holds it.
        """
        if self._fd is not None:
            return
        self._stacklevel = stacklevel
        deadline = time.monotonic() + _FRESH_SECONDS + 1.0
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        while True:
            try:
                fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                pass
            else:
                if self._take_new(fd, deadline):
                    return
                continue
            try:
                fd = os.open(self.path, flags)
            except FileNotFoundError:
                continue  # released between our two opens: try to create it again
            except OSError as exc:
                raise LockError(
                    f"{self.root}: cannot open the lock file {self.path} ({exc.strerror}). "
                    "Expected a regular file tdckpt created; remove whatever is there if no "
                    "writer is running.",
                    root=str(self.root),
                    path=str(self.path),
                ) from exc
            if self._take_existing(fd, deadline):
                return

    def _take_new(self, fd: int, deadline: float) -> bool:
        """We created the file: lock it and write who we are. False: start over."""
        # A contender may hold the flock for an instant while it reads the (still empty)
        # file; it backs off, as the file is fresh.
        while True:
            got = _flock(fd)
            if got is not False or time.monotonic() > deadline:
                break
            time.sleep(_RETRY_SLEEP)
        if got is False or not _same_file(fd, self.path):
            os.close(fd)
            return False
        self._write_info(fd)
        if self.fsync:
            from tdckpt._write.atomic import fsync_dir

            fsync_dir(self.root)
        self._hold(fd)
        return True

    def _take_existing(self, fd: int, deadline: float) -> bool:
        """The file exists: take it over if stale, retry, or raise. True: we hold it."""
        got = _flock(fd)
        info = _parse_info(_read_fd(fd))
        here = socket.gethostname()
        if got is True and not _same_file(fd, self.path):
            os.close(fd)  # released and maybe re-created meanwhile
            return False
        if info is None and got is not False:
            age = time.time() - os.fstat(fd).st_mtime
            if age < _FRESH_SECONDS and time.monotonic() < deadline:
                # Its creator is between O_EXCL and writing its name: let it finish.
                os.close(fd)
                time.sleep(_RETRY_SLEEP)
                return False
        if got is True or (
            got is None and (info is None or (info.host == here and not _pid_alive(info.pid)))
        ):
            self._write_info(fd)
            self._hold(fd)
            self._warn_takeover(info)
            return True
        if info is not None and info.host == here and not _pid_alive(info.pid):
            # The flock is held through a descriptor a forked child inherited from a
            # writer that died: break the lock (the orphan keeps a file nobody names).
            if _same_file(fd, self.path):
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            os.close(fd)
            self._warn_takeover(info)
            return False
        os.close(fd)
        raise self._busy(info, flock_supported=got is not None)

    def _warn_takeover(self, info: LockInfo | None) -> None:
        who = info.describe() if info is not None else "an unknown writer (empty lock file)"
        warnings.warn(
            f"{self.root}: took over the lock {self.path} left by {who}, which is no longer "
            "running. A save it did not finish left a temporary '<step>.tmp-*' entry that "
            "CheckpointManager.gc() removes; committed steps are intact.",
            TdckptWarning,
            # _warn_takeover <- _take_existing <- acquire <- caller
            stacklevel=3 + self._stacklevel,
        )

    def _busy(self, info: LockInfo | None, *, flock_supported: bool) -> LockError:
        who = info.describe() if info is not None else "an unknown writer"
        hint = "Close that CheckpointManager (or let that process finish), or use another root."
        if info is not None and info.host != socket.gethostname():
            hint += (
                f" The holder runs on another host; if you are sure it is gone, delete {self.path}."
            )
        elif not flock_supported:
            hint += (
                " This file system does not support flock, so a dead holder is only detected "
                f"on its own host; if you are sure it is gone, delete {self.path}."
            )
        facts: dict[str, Any] = {"root": str(self.root), "path": str(self.path)}
        if info is not None:
            facts.update(host=info.host, pid=info.pid, manager_id=info.manager_id)
        return LockError(
            f"{self.root}: another writer holds this checkpoint root ({who}; lock file "
            f"{self.path}). Only one writer may save, delete or gc at a time. {hint}",
            **facts,
        )

    def release(self) -> None:
        """Release the lock (unlink the file, then drop the flock). Idempotent."""
        if self._fd is None:
            return
        self._fd = None
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
