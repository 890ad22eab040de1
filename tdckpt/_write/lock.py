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
* The flock is the truth: a lock whose flock is held is never taken over or unlinked,
  whatever the file records. The recorded pid and host only name the holder in the error
  message: a pid that is not visible here (another pid namespace - containers of one pod
  share a host name, not their pids) or that is garbage says nothing about the holder.
* A forked child does not keep its parent's lock: right after ``fork`` the child closes
  its copy of every held lock's descriptor (so the flock lives exactly as long as the
  process that took it) and a manager in the child must take the lock again.
* The lock file is opened without following links and must be a regular file with a
  single link; tdckpt writes into it only while it holds its flock. Anything else there
  (a symlink, a directory, a FIFO, a hard link to another file) is refused, untouched.
* On file systems without flock (some network mounts), only the pid check on the same host
  remains; a lock of another host, or with an unusable pid, is then never broken
  automatically.
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
import stat
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
#: pid_t is a 32-bit signed int on every platform tdckpt runs on.
_MAX_PID = 2**31 - 1
#: Longest host / manager id kept from a lock file (they only appear in messages).
_MAX_FIELD = 256


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


def _field(value: object) -> str | None:
    """A printable string field of a lock file (shortened), or None if it is not a str."""
    if type(value) is not str:
        return None
    text = "".join(ch if ch.isprintable() else "?" for ch in value[:_MAX_FIELD])
    return text + ("..." if len(value) > _MAX_FIELD else "")


def _parse_info(data: bytes) -> LockInfo | None:
    """The holder a lock file names, or None for anything but tdckpt's own JSON.

    The file may hold anything (it lies in a shared directory): garbage, non-UTF-8, deep
    nesting, a float or a huge, negative or boolean pid are all "unknown holder".
    """
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    if type(raw) is not dict:
        return None
    pid = raw.get("pid")
    if type(pid) is not int or not 0 < pid <= _MAX_PID:
        return None
    host, created, manager_id = (
        _field(raw.get("host")),
        _field(raw.get("created")),
        _field(raw.get("manager_id")),
    )
    if host is None or created is None or manager_id is None:
        return None
    return LockInfo(host=host, pid=pid, created=created, manager_id=manager_id)


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, _MAX_INFO_BYTES, 0)


def _open_flags() -> int:
    return (
        getattr(os, "O_CLOEXEC", 0)
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_NONBLOCK", 0)  # a FIFO planted there must not block the open
        | getattr(os, "O_NOCTTY", 0)
    )


def read_lock_info(root: str | os.PathLike[str]) -> LockInfo | None:
    """The holder recorded in ``root``'s lock file, or None (no lock file, or unreadable).

    Never follows a symlink and reads only a regular file.
    """
    try:
        fd = os.open(Path(root) / LOCK_NAME, os.O_RDONLY | _open_flags())
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return _parse_info(_read_fd(fd))
    except OSError:
        return None
    finally:
        os.close(fd)


def try_flock(fd: int) -> bool | None:
    """Take the flock without waiting: True taken, False held elsewhere, None unsupported."""
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
    """Whether ``pid`` runs in this pid namespace (only used where flock is unsupported)."""
    if not 0 < pid <= _MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except (OverflowError, OSError):
        return False
    return True


def same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


#: Every lock held by this process, so that a forked child can let go of them.
_HELD: weakref.WeakSet[RootLock] = weakref.WeakSet()


def _forget_in_child() -> None:
    """After ``fork``, in the child: close the inherited descriptors of held locks.

    The flock stays with the parent's descriptor, so it is released when the process that
    took it ends, not when its last forked child does; the child's locks read as not held.
    """
    for lock in list(_HELD):
        lock._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _release(fd: int, path: Path, owner_pid: int) -> None:
    # A forked child inherits the descriptor: only the process that took the lock
    # removes the file, or a child's exit would free its parent's lock.
    try:
        if os.getpid() == owner_pid and same_file(fd, path):
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

    def still_ours(self) -> bool:
        """Whether the lock file at the path is still the one this object holds.

        False when someone removed or replaced it meanwhile: another writer may then have
        created and taken a new one, so this object must not write on its strength.
        """
        return self._fd is not None and same_file(self._fd, self.path)

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
        _HELD.add(self)

    def _forget(self) -> None:
        """Drop this (inherited) lock without touching the file: see _forget_in_child."""
        fd, self._fd = self._fd, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        _HELD.discard(self)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _unusable(self, fd: int, what: str, exc: OSError | None = None) -> LockError:
        os.close(fd)
        return self._cannot_open(what, exc)

    def _cannot_open(self, what: str, exc: OSError | None = None) -> LockError:
        detail = f" ({exc.strerror})" if exc is not None and exc.strerror else ""
        return LockError(
            f"{self.root}: cannot open the lock file {self.path}: {what}{detail}. Expected a "
            "regular file tdckpt created; it was left untouched. Remove whatever is there "
            "if no writer is running.",
            root=str(self.root),
            path=str(self.path),
        )

    def _check_file(self, fd: int) -> None:
        """Refuse (closing ``fd``) anything but a regular file with one link."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise self._unusable(fd, "it is not a regular file")
        if st.st_nlink != 1:
            # Writing our name into it would also change the other name(s) of the file.
            raise self._unusable(fd, f"it has {st.st_nlink} hard links")

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
        flags = os.O_RDWR | _open_flags()
        while True:
            try:
                fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                pass
            except OSError as exc:
                if not os.path.lexists(self.path):  # e.g. a read-only root
                    raise LockError(
                        f"{self.root}: cannot create the lock file {self.path} "
                        f"({exc.strerror}). A writer needs a writable checkpoint root; "
                        "reading (restore, verify, ls) does not.",
                        root=str(self.root),
                        path=str(self.path),
                    ) from exc
            else:
                if self._take_new(fd, deadline):
                    return
                continue
            try:
                fd = os.open(self.path, flags)
            except FileNotFoundError:
                continue  # released between our two opens: try to create it again
            except OSError as exc:
                what = (
                    "it is a symbolic link"
                    if exc.errno == errno.ELOOP or os.path.islink(self.path)
                    else "cannot open it for writing"
                )
                raise self._cannot_open(what, exc) from exc
            self._check_file(fd)
            if self._take_existing(fd, deadline):
                return

    def _take_new(self, fd: int, deadline: float) -> bool:
        """We created the file: lock it and write who we are. False: start over."""
        # A contender may hold the flock for an instant while it reads the (still empty)
        # file; it backs off, as the file is fresh.
        while True:
            got = try_flock(fd)
            if got is not False or time.monotonic() > deadline:
                break
            time.sleep(_RETRY_SLEEP)
        if got is False or not same_file(fd, self.path):
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
        got = try_flock(fd)
        info = _parse_info(_read_fd(fd))
        if got is True and not same_file(fd, self.path):
            os.close(fd)  # released and maybe re-created meanwhile
            return False
        if info is None and got is not False and os.fstat(fd).st_size == 0:
            # (A creator writes its name in one small pwrite: only an empty file is young.)
            age = time.time() - os.fstat(fd).st_mtime
            if age < _FRESH_SECONDS and time.monotonic() < deadline:
                # Its creator is between O_EXCL and writing its name: let it finish.
                os.close(fd)
                time.sleep(_RETRY_SLEEP)
                return False
        # Nobody holds the flock: whoever wrote the file is gone, whatever it records
        # (without flock: a stale file, see _stale_without_flock).
        if got is True or (got is None and self._stale_without_flock(fd, info)):
            self._write_info(fd)
            self._hold(fd)
            self._warn_takeover(info)
            return True
        # The flock is held (or, without flock, the holder may be alive): never break it.
        os.close(fd)
        raise self._busy(info, flock_supported=got is not None)

    def _stale_without_flock(self, fd: int, info: LockInfo | None) -> bool:
        """Without flock: stale only if empty (and not fresh) or a dead pid of this host."""
        if info is None:
            # An empty file past its creation grace is abandoned; garbage is not ours to judge.
            return os.fstat(fd).st_size == 0
        return info.host == socket.gethostname() and not _pid_alive(info.pid)

    def _warn_takeover(self, info: LockInfo | None) -> None:
        who = (
            info.describe()
            if info is not None
            else "an unknown writer (the lock file was empty or named no holder)"
        )
        warnings.warn(
            f"{self.root}: took over the lock {self.path} left by {who}, which is no longer "
            "running. A save it did not finish left a temporary '<step>.tmp-*' entry that "
            "CheckpointManager.gc() removes; committed steps are intact.",
            TdckptWarning,
            # _warn_takeover <- _take_existing <- acquire <- caller
            stacklevel=3 + self._stacklevel,
        )

    def _busy(self, info: LockInfo | None, *, flock_supported: bool) -> LockError:
        who = (
            info.describe()
            if info is not None
            else "an unknown writer: the lock file does not name it"
        )
        hint = "Close that CheckpointManager (or let that process finish), or use another root."
        if flock_supported and info is not None and not _pid_alive(info.pid):
            hint += (
                f" The lock's flock is held although pid {info.pid} is not visible from this "
                "process: the holder runs in another pid namespace (another container or "
                "host sharing this directory), or is a process that inherited the lock's "
                "descriptor. The lock is released when that process ends."
            )
        elif info is not None and info.host != socket.gethostname():
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
        _HELD.discard(self)
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
