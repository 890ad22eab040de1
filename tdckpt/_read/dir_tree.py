"""Race-free opening of the names of one directory tree, relative to directory descriptors.

A checkpoint prefix read as a directory (``directory.py``) opens every name through a
:class:`TreeOpener`: each directory component relative to its parent's descriptor with
``O_NOFOLLOW``, each file relative to its directory's descriptor the same way (and
``O_NONBLOCK``: a FIFO planted in place of a leaf opens at once, for ``fstat`` to refuse).
A symlink is followed only when it stays inside the prefix without a cycle, and then by
opening its resolved target from the prefix component by component, following nothing, so
a link swapped in after it was checked is refused rather than followed. What is checked
is what is used: callers ``fstat`` the very descriptor they read or map.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
from pathlib import Path

from tdckpt._read.storage import check_component
from tdckpt.errors import CheckpointNotFoundError, MetadataError, UnsafePathError

__all__ = ["FILE_FLAGS", "TreeOpener", "kind_of"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: A directory component: never through a symlink (a swapped-in link is refused or checked).
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_NOFOLLOW | _O_CLOEXEC
#: A file: never through a symlink; O_NONBLOCK so that a FIFO planted in place of a leaf
#: opens at once (and is then refused by fstat) instead of waiting for a writer forever;
#: O_NOCTTY so that a terminal device never becomes the controlling terminal.
FILE_FLAGS = _O_NOFOLLOW | _O_CLOEXEC | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
#: Directory descriptors kept open per tree (deeper trees reopen from the root).
_MAX_DIR_FDS = 64


class TreeOpener:
    """Opens the names of the tree under ``root`` (a normalised prefix path; ``location``
    is how messages name it) through descriptors it keeps: at most ``_MAX_DIR_FDS``
    directories at a time, the prefix's until :meth:`close` (or until the opener is
    collected). One opener serves one thread at a time, as the read pipeline uses it.

    ``regular`` records the files a listing saw as regular (not links), with their path
    and stat (None: listed without one): opening them needs no new symlink check.
    ``safe_dirs`` records the paths whose every component was checked.
    """

    def __init__(self, root: str, location: str) -> None:
        self.root = root
        self.location = location
        self.regular: dict[str, tuple[str, os.stat_result | None]] = {}
        self.safe_dirs: set[str] = set()
        #: open directory descriptors by relative path ("" is the prefix)
        self.dir_fds: dict[str, int] = {}

    def __del__(self) -> None:
        # An opener never closed releases its descriptors when it is collected (a
        # finalizer object per opener costs more than the rest of a small restore's open).
        fds = self.__dict__.get("dir_fds")
        if fds:
            with contextlib.suppress(OSError, TypeError):  # closed already, or at shutdown
                _close_fds(fds)

    def close(self) -> None:
        """Close every directory descriptor (a later call opens what it needs again)."""
        _close_fds(self.dir_fds)

    def display(self, rel: str) -> str:
        """``rel`` as a user-readable location (as :meth:`Storage.display`)."""
        return str(Path(self.location) / rel) if rel else str(self.location)

    @functools.cached_property
    def real_root(self) -> str:
        # Resolved on first use: only symlinks need it, and most checkpoints have none.
        return os.path.realpath(self.root)

    def resolve(self, rel: str) -> str:
        if not rel:
            return self.root
        for part in rel.split("/"):
            if part in ("", ".", "..") or "\0" in part:
                check_component(part, where=self.display(rel))
        return os.path.join(self.root, rel)

    def check_link(self, path: Path, rel: str) -> str | None:
        """Why the symlink ``path`` must not be followed, or None if it is safe."""
        target = os.path.realpath(path)
        root = self.real_root
        if target != root and not target.startswith(root + os.sep):
            return f"a symlink to {target}, outside the checkpoint"
        holder = os.path.realpath(path.parent)
        if holder == target or holder.startswith(target + os.sep):
            return "a symlink to its own directory or an ancestor (a cycle)"
        return None

    def check_chain(self, rel: str) -> None:
        """Refuse ``rel`` if any component (not only the last) is an unsafe symlink.

        ``out/passwd`` with ``out`` a link out of the prefix must not be read although
        ``passwd`` itself is a regular file.
        """
        if not rel:
            return
        parts = rel.split("/")
        parent = rel.rpartition("/")[0]
        # The usual case: the parent was checked (listed) first, one component is left.
        first = len(parts) - 1 if not parent or parent in self.safe_dirs else 0
        for i in range(first, len(parts)):
            sub = "/".join(parts[: i + 1])
            if sub in self.safe_dirs:
                continue
            cur = os.path.join(self.root, sub)
            if os.path.islink(cur):
                self.refuse_unsafe_link(cur, sub, rel)
            self.safe_dirs.add(sub)

    def refuse_unsafe_link(self, path: str, sub: str, rel: str) -> None:
        """Raise unless the link at ``path`` (``sub`` of the prefix) stays inside it."""
        reason = self.check_link(Path(path), sub)
        if reason is not None:
            raise UnsafePathError(
                f"{self.display(sub)}: {reason}; tdckpt never follows it. Replace the link "
                "with the real file or directory.",
                path=self.display(rel),
            )

    def dir_fd(self, rel: str) -> int:
        """An open descriptor of the directory ``rel``, reached without following a link.

        Each component is opened relative to its parent's descriptor with ``O_NOFOLLOW``; a
        component that is a symlink is followed only when it is safe (as a listing
        decides), by opening its resolved target from the prefix the same way. A directory
        swapped for a symlink out of the prefix after validation is refused, not followed.
        Descriptors are kept per directory (one open per directory, not per leaf), at most
        ``_MAX_DIR_FDS`` at a time; the prefix's is kept until :meth:`close`.
        """
        fds = self.dir_fds
        fd = fds.get(rel)
        if fd is not None:
            return fd
        parts = rel.split("/") if rel else []
        if len(fds) + len(parts) >= _MAX_DIR_FDS:
            # The prefix's own descriptor stays: every directory is reached from the one
            # tree it names, however many the read visits (never the prefix by path again).
            root = fds.pop("", None)
            _close_fds(fds)
            if root is not None:
                fds[""] = root
        base = fds.get("")
        if base is None:
            base = fds[""] = self._open_root()
        sub = ""
        for part in parts:
            sub = f"{sub}/{part}" if sub else part
            fd = fds.get(sub)
            if fd is None:
                fd = fds[sub] = self._open_dir_at(base, part, sub)
            base = fd
        return base

    def _open_root(self) -> int:
        # The prefix itself is the path the user named: a symlink there is the user's own.
        try:
            return os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.location}: no such directory.", path=self.location
            ) from exc
        except NotADirectoryError as exc:
            raise MetadataError(
                f"{self.location}: expected a directory, found a file.", path=self.location
            ) from exc

    def _open_dir_at(self, base: int, part: str, sub: str) -> int:
        if part in ("", ".", "..") or "\0" in part:
            check_component(part, where=self.display(sub))
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=base)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.display(sub)}: no such directory.", path=self.display(sub)
            ) from exc
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP, errno.EMLINK):
                raise
        # Not a directory: a symlink (O_NOFOLLOW refused it) or something else entirely.
        try:
            st = os.stat(part, dir_fd=base, follow_symlinks=False)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.display(sub)}: no such directory.", path=self.display(sub)
            ) from exc
        if stat.S_ISLNK(st.st_mode):
            return self._open_link(sub, None)
        raise MetadataError(
            f"{self.display(sub)}: expected a directory, found {kind_of(st.st_mode)}.",
            path=self.display(sub),
        )

    def _open_link(self, rel: str, flags: int | None) -> int:
        """Open the target of the symlink ``rel`` (a file with ``flags``, else a directory).

        The link is checked as a listing checks one (inside the prefix, no cycle), then its
        resolved target is opened from the prefix component by component following nothing,
        so a link changed in between is refused rather than followed.
        """
        path = os.path.join(self.root, rel)
        self.refuse_unsafe_link(path, rel, rel)
        target = os.path.realpath(path)
        real = target[len(self.real_root) + 1 :].split("/") if target != self.real_root else []
        if not real or any(part in ("", ".", "..") for part in real):
            raise UnsafePathError(
                f"{self.display(rel)}: a symlink to {target}, which is not a file or directory "
                "inside the checkpoint; tdckpt never follows it.",
                path=self.display(rel),
            )
        opened: list[int] = []
        try:
            base = self.dir_fd("")
            for part in real if flags is None else real[:-1]:
                base = os.open(part, _DIR_FLAGS, dir_fd=base)
                opened.append(base)
            if flags is None:
                return opened.pop()
            return os.open(real[-1], flags, dir_fd=base)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.display(rel)}: a symlink to {target}, which does not exist.",
                path=self.display(rel),
            ) from exc
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP, errno.EMLINK):
                raise
            raise UnsafePathError(
                f"{self.display(rel)}: the symlink's target {target} changed while it was "
                "being opened (a link where a directory or file was); tdckpt never follows "
                "it. Read the checkpoint again when nothing is changing it.",
                path=self.display(rel),
            ) from exc
        finally:
            for fd in opened:
                os.close(fd)

    def open_file(self, rel: str, flags: int) -> int:
        """Open the file ``rel`` once, following no link it was not checked to have.

        Opened relative to its directory's descriptor with ``O_NOFOLLOW`` (and
        ``O_NONBLOCK``: a FIFO opens at once, for fstat to refuse); a safe in-prefix symlink
        is opened through its checked target. The caller fstats the descriptor.
        """
        parent, _, name = rel.rpartition("/")
        if rel not in self.regular:
            self.resolve(rel)  # every component a real name
            if not name:
                check_component(name, where=self.display(rel))
        dfd = self.dir_fd(parent)
        try:
            return os.open(name, flags | FILE_FLAGS, dir_fd=dfd)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.display(rel)}: no such file.", path=self.display(rel)
            ) from exc
        except IsADirectoryError as exc:
            raise MetadataError(
                f"{self.display(rel)}: expected a file, found a directory.",
                path=self.display(rel),
            ) from exc
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.EMLINK):
                raise
        return self._open_link(rel, flags | FILE_FLAGS)  # a symlink: only if it is safe

    def checked_stat(self, fd: int, rel: str) -> os.stat_result:
        """fstat the open ``fd``: a regular file, or a clear error (no blocking, no guessing)."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            if stat.S_ISDIR(st.st_mode):
                raise MetadataError(
                    f"{self.display(rel)}: expected a file, found a directory.",
                    path=self.display(rel),
                )
            raise UnsafePathError(
                f"{self.display(rel)}: {kind_of(st.st_mode)} where a regular file belongs; "
                "tdckpt reads and maps only regular files. The checkpoint was changed while "
                "it was read, or is hostile; restore it from a backup.",
                path=self.display(rel),
            )
        return st


def _close_fds(fds: dict[str, int]) -> None:
    """Close every descriptor in ``fds`` and forget them."""
    for fd in fds.values():
        os.close(fd)
    fds.clear()


def kind_of(mode: int) -> str:
    """What a non-regular file is, for messages."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"
