"""The journals of tdckpt's crash-safe writes, and the file helpers they share.

``tdckpt.save`` (:mod:`tdckpt._write.export`) and ``upgrade`` (:mod:`tdckpt._upgrade.journal`)
record what they are about to do in a journal beside the prefix before they touch it; a
later run reads the journal first, to finish or undo an interrupted one. Both write, read
and remove their journals here, and the upgrade copies and checksums leaves here:

* :func:`write_record`: a journal is written complete under a temporary name - created
  exclusively, never through a link (a stale file of that name is removed first) - and
  fsynced; the caller then publishes it (a link or a rename that never replaces, or a
  replace of its own journal);
* :data:`OPEN_RECORD`: a journal is opened once, without following a link and without
  blocking on a FIFO, then checked through that descriptor;
* :func:`drop_record`: a journal is removed only while its name still is the file the
  caller holds open, and the directory fsynced;
* :func:`fsync_file`, :func:`copy_fd` (a reflink where the file system shares extents,
  else a kernel copy, else chunk by chunk) and :func:`hash_fd`: an open file made durable,
  copied or checksummed, a file that changed size meanwhile refused; :func:`clone` (the
  reflink alone) also gives an incremental step its base's leaves.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Callable
from pathlib import Path

from tdckpt._write.atomic import fsync_dir, fsync_file
from tdckpt._write.checksum import new_hasher
from tdckpt._write.lock import same_file, try_flock

__all__ = [
    "COPY_CHUNK",
    "OPEN_RECORD",
    "clone",
    "copy_fd",
    "drop_record",
    "fsync_file",
    "hash_fd",
    "write_record",
]

#: Flags a journal (or a file checked through its descriptor) is opened with, besides the
#: access mode: never through a link, never blocking on a FIFO, closed on exec.
OPEN_RECORD = (
    getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
)
#: Bytes per read of a copy or a checksum.
COPY_CHUNK = 16 << 20
#: ``ioctl(FICLONE)`` (linux/fs.h): the destination shares the source's extents.
_FICLONE = 0x40049409
#: errno values for which a reflink is impossible here and a real copy is made.
_NO_CLONE = frozenset(
    {errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOTTY, errno.ENOSYS, errno.EXDEV, errno.EINVAL}
    | {errno.EPERM, errno.EBADF, errno.ETXTBSY}
)
#: What a copy or a checksum raises when the source's size is not what it was:
#: ``changed(why)`` returns the caller's error.
Changed = Callable[[str], Exception]


def write_record(tmp: Path, data: bytes, *, fsync: bool = True, flock: bool = False) -> int:
    """Create ``tmp`` holding ``data`` (fsynced unless ``fsync`` is False); return its open
    descriptor (read-write), which the caller closes, or holds: ``flock`` takes the file's
    flock before the first byte is written, so that no one takes a complete journal for
    the leftover of a crash. On an error ``tmp`` is removed."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a stale one (or a planted link): never written through
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_RECORD, 0o644)
    try:
        if flock:
            try_flock(fd)  # a fresh file nobody else has opened: always ours
        os.pwrite(fd, data, 0)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


def drop_record(fd: int, path: Path, *, fsync: bool) -> None:
    """Remove the journal ``path`` if it is still the file open as ``fd`` (not a newer one)."""
    if same_file(fd, path):
        os.unlink(path)
        if fsync:
            fsync_dir(path.parent)


def copy_fd(
    sfd: int, st: os.stat_result, dst: Path, algorithm: str | None, changed: Changed
) -> tuple[str, str | None]:
    """Copy the open file ``sfd`` (of stat ``st``) to the new file ``dst``: a reflink, else
    a kernel copy, else chunk by chunk; fsynced, with the source's mode. Returns how
    (``"reflink"`` or ``"copy"``) and the checksum with ``algorithm`` (None: not computed)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    dfd = os.open(dst, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        digest: str | None = None
        how = "copy"
        if st.st_size and clone(dfd, sfd):
            how = "reflink"
            if algorithm:
                digest = hash_fd(sfd, st.st_size, algorithm, changed)
        elif _copy_range(sfd, dfd, st.st_size, changed):
            if algorithm:  # the bytes as written (read back from the page cache)
                digest = hash_fd(dfd, st.st_size, algorithm, changed)
        else:
            hasher = new_hasher(algorithm) if algorithm else None
            buf = bytearray(min(COPY_CHUNK, max(st.st_size, 1)))
            done = 0
            while True:
                n = os.preadv(sfd, [buf], done)
                if not n:
                    break
                view = memoryview(buf)[:n]
                if hasher is not None:
                    hasher.update(view)
                while view:
                    view = view[os.write(dfd, view) :]
                done += n
            if done != st.st_size:
                raise changed(f"changed size ({done} bytes read, {st.st_size} expected)")
            if hasher is not None:
                digest = f"{algorithm}:{hasher.hexdigest()}"
        os.fchmod(dfd, stat.S_IMODE(st.st_mode))
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return how, digest


def _copy_range(sfd: int, dfd: int, size: int, changed: Changed) -> bool:
    """``copy_file_range``: the kernel copies (no round trip through user space; some file
    systems share extents or copy server-side). False where unsupported (nothing copied)."""
    copy_range = getattr(os, "copy_file_range", None)
    if copy_range is None or not size:
        return False
    done = 0
    while done < size:
        try:
            n = copy_range(sfd, dfd, min(size - done, 1 << 30), done, done)
        except OSError as exc:
            if done == 0 and exc.errno in _NO_CLONE:
                return False
            raise
        if not n:
            raise changed(f"changed size ({done} bytes read, {size} expected)")
        done += n
    return True


def clone(dfd: int, sfd: int) -> bool:
    """``ioctl(FICLONE)``: share the source's extents copy-on-write; False where unsupported."""
    try:
        fcntl.ioctl(dfd, _FICLONE, sfd)
    except OSError as exc:
        if exc.errno in _NO_CLONE:
            return False
        raise
    return True


def hash_fd(fd: int, size: int, algorithm: str, changed: Changed) -> str:
    """The checksum (``"<algorithm>:<hex>"``) of the ``size`` bytes of the open file ``fd``."""
    hasher = new_hasher(algorithm)
    buf = bytearray(min(COPY_CHUNK, max(size, 1)))
    done = 0
    while True:
        n = os.preadv(fd, [buf], done)
        if not n:
            break
        hasher.update(memoryview(buf)[:n])
        done += n
    if done != size:
        raise changed(f"changed size ({done} bytes read, {size} expected)")
    return f"{algorithm}:{hasher.hexdigest()}"
