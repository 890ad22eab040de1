"""The commit protocol: stage beside the target, make it durable, then one atomic rename.

A step of a checkpoint root is committed when, and only when, its final name exists:

* a directory step ``<root>/<step>/`` is staged in ``<root>/<step>.tmp-<uuid>/``; the writer
  fsyncs every file, then the directories bottom-up, writes the manifest last and fsyncs it;
  then the staging folder is renamed to ``<root>/<step>`` and ``<root>`` is fsynced;
* an archive step ``<root>/<step>.tdz`` is staged the same way, then packed by
  :func:`tdckpt._write.archive_write.write_archive`, whose own ``os.replace`` is the commit.

:class:`tdckpt._store.local.LocalStepStore` drives these steps (begin, commit, abort,
retire, gc); this module holds the file-system acts themselves.

So a crash at any instant leaves either the old state or the new one, plus names that
:func:`is_tmp_name` recognises and ``gc`` removes. Names are plain decimal step numbers
(``"1000"``, never ``"01000"``); anything else in a root is foreign and never touched.

Overwriting a committed step swaps the two folders with ``renameat2(RENAME_EXCHANGE)``
where the kernel and file system offer it, so the step never disappears. Elsewhere the old
folder is renamed aside to ``<step>.tmp-<uuid>.replaced`` first; if a crash then hits
before the new folder is renamed in, :func:`recover_or_remove` (``gc``) renames the old
one back instead of deleting it.

Deleting a step renames it to a temporary name first (:func:`retire`), so a crash in the
middle of ``rmtree`` never leaves a half-deleted step listed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import stat
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from tdckpt.errors import CheckpointExistsError

__all__ = [
    "ARCHIVE_SUFFIX",
    "MAX_STEP",
    "TMP_MARKER",
    "StepKind",
    "fsync_dir",
    "fsync_file",
    "is_tmp_name",
    "parse_step_name",
    "raise_exists",
    "recover_or_remove",
    "remove_tree",
    "replace_step",
    "retire",
    "staging_dir",
    "start_writeback",
    "step_archive_name",
    "step_name",
    "tmp_name",
]

#: Flags that create a new file for writing: never an existing one, never through a link.
CREATE_NEW = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NOFOLLOW", 0)
)
#: The suffix of an archive step (tensordict's archive suffix).
ARCHIVE_SUFFIX = ".tdz"
#: What every temporary name of a root holds after the step number.
TMP_MARKER = ".tmp-"
#: The suffix of a committed step renamed aside while an overwrite is in flight.
REPLACED_SUFFIX = ".replaced"

StepKind = str  # "dir" | "archive"

_STEP_RE = re.compile(r"(0|[1-9][0-9]*)")
# <step>[.tdz].tmp-<32 hex>[.<tag>]: staging, retired and replaced folders of this module.
_TMP_RE = re.compile(r"(0|[1-9][0-9]*)(\.tdz)?\.tmp-[0-9a-f]{32}(\.[a-z]+)?")
# .<step>.tdz.<hex>.tmp: the temporary file of tdckpt._write.archive_write.write_archive.
_ARCHIVE_TMP_RE = re.compile(r"\.(0|[1-9][0-9]*)\.tdz\.[0-9a-f]+\.tmp")


# -- names -------------------------------------------------------------------------------------


def step_name(step: int) -> str:
    """The folder name of a directory step.

    >>> step_name(1000)
    '1000'
    """
    return str(check_step(step))


def step_archive_name(step: int) -> str:
    """The file name of an archive step.

    >>> step_archive_name(7)
    '7.tdz'
    """
    return f"{check_step(step)}{ARCHIVE_SUFFIX}"


#: The largest step number: 19 digits name a folder on every file system, and every reader of
#: a manifest's ``step`` (JSON tools, int64 columns) holds it.
MAX_STEP = 2**63 - 1


def check_step(step: object) -> int:
    """Return ``step`` if it is a valid step number (an ``int`` in 0 .. :data:`MAX_STEP`,
    not a bool)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        bits = step.bit_length() if isinstance(step, int) else 0
        shown = f"an int of {bits} bits" if bits > 64 else repr(step)[:80]
        raise ValueError(
            f"a step must be a non-negative int, got {shown} ({type(step).__name__}); "
            "steps name folders as plain decimal numbers."
        )
    if step > MAX_STEP:
        # not the number itself: a 301-digit int fills a screen, and past 4300 digits
        # Python refuses to print it at all
        raise ValueError(
            f"a step must be at most 2**63 - 1 ({MAX_STEP}), got an int of "
            f"{step.bit_length()} bits: steps name folders as decimal numbers and are "
            "recorded in manifests as 64-bit ints (a 300-digit name does not even fit a file "
            "name). Number steps by iteration, epoch or a counter."
        )
    return int(step)


def parse_step_name(name: str) -> tuple[int, StepKind] | None:
    """The step and kind a root entry name commits, or None for any other name.

    Only canonical decimal names count: ``"007"``, ``"+7"`` or ``"7.tmp-..."`` are not steps.

    >>> parse_step_name("1000"), parse_step_name("12.tdz"), parse_step_name("007")
    ((1000, 'dir'), (12, 'archive'), None)
    """
    if name.endswith(ARCHIVE_SUFFIX):
        base, kind = name[: -len(ARCHIVE_SUFFIX)], "archive"
    else:
        base, kind = name, "dir"
    if _STEP_RE.fullmatch(base) is None:
        return None
    return int(base), kind


def tmp_name(step: int, *, archive: bool = False, tag: str = "") -> str:
    """A fresh temporary name for ``step`` (unique: a uuid4), optionally tagged.

    >>> is_tmp_name(tmp_name(5, tag="replaced"))
    True
    """
    base = step_archive_name(step) if archive else step_name(step)
    suffix = f".{tag}" if tag else ""
    return f"{base}{TMP_MARKER}{uuid.uuid4().hex}{suffix}"


def is_tmp_name(name: str) -> bool:
    """Whether ``name`` is a temporary entry a save, delete or archive write left behind.

    >>> is_tmp_name("1000.tmp-" + "0" * 32), is_tmp_name("1000"), is_tmp_name("notes.tmp-x")
    (True, False, False)
    """
    return _TMP_RE.fullmatch(name) is not None or _ARCHIVE_TMP_RE.fullmatch(name) is not None


def tmp_step(name: str) -> int | None:
    """The step a temporary name belongs to, or None if it is not one."""
    match = _TMP_RE.fullmatch(name) or _ARCHIVE_TMP_RE.fullmatch(name)
    return int(match.group(1)) if match else None


# -- durability --------------------------------------------------------------------------------


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so the names created or removed in it survive a power loss."""
    _fsync(path, getattr(os, "O_DIRECTORY", 0))


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync the file ``path`` (never through a link)."""
    _fsync(path, getattr(os, "O_NOFOLLOW", 0))


def _fsync(path: str | os.PathLike[str], flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | flags | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: sync_file_range(2)'s flag: start writing the range's dirty pages, do not wait.
_SYNC_FILE_RANGE_WRITE = 2
#: Errors after which a writeback hint is simply not taken (the fsync still does the work).
_NO_HINT_ERRNOS = frozenset(
    {errno.EINVAL, errno.ENOSYS, errno.ESPIPE, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOMEM}
)


def _libc(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """The C library's function ``name`` (returning an int, errno kept), or None where the
    library does not export it."""
    try:
        func = getattr(ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    func.argtypes = argtypes
    func.restype = ctypes.c_int
    return func  # type: ignore[no-any-return]


# Linux only (glibc and musl export it); elsewhere fsync alone does the work.
_sync_file_range = (
    _libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
    if sys.platform.startswith("linux")
    else None
)


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> bool:
    """Start writing ``fd``'s dirty pages in ``[offset, offset + nbytes)`` to disk; no wait.

    ``nbytes=0`` means to the end of the file. This is ``sync_file_range(2)`` with
    ``SYNC_FILE_RANGE_WRITE`` (Linux): it only queues the pages for writeback and returns, so
    the disk works while the caller writes the next bytes or files. It makes nothing durable
    by itself (no metadata, no disk cache flush): the ``fsync`` that must still follow finds
    the data already on its way, or on disk. A save that calls it right after writing each
    part of a file, then fsyncs the file, is exactly as durable as one that only fsyncs.

    Returns:
        True when writeback was started; False where the call does not exist (not Linux, no
        such libc symbol) or the file system does not take the hint - then the fsync alone
        writes the data, as without this call.

    Raises:
        OSError: the kernel reports a write error (``EIO``, ``ENOSPC``, ``EBADF``...).
    """
    func = _sync_file_range
    if func is None:
        return False
    if func(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_HINT_ERRNOS:
        return False
    raise OSError(err, os.strerror(err))


# -- renames -----------------------------------------------------------------------------------

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


# glibc >= 2.28 exports renameat2; elsewhere (macOS, musl without it) fall back.
_renameat2 = _libc(
    "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
)


def _rename2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2 with ``flags``; False when the kernel or file system cannot do it."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``, refusing (CheckpointExistsError) if ``dst`` exists.

    Atomic where ``RENAME_NOREPLACE`` exists; elsewhere a check then a rename, which the
    root's single-writer lock makes safe.
    """
    try:
        if _rename2(src, dst, _RENAME_NOREPLACE):
            return
    except FileExistsError:
        raise_exists(dst)
    if os.path.lexists(dst):
        raise_exists(dst)
    os.rename(src, dst)


def raise_exists(dst: Path) -> NoReturn:
    """Refuse to overwrite ``dst``, a committed step (CheckpointExistsError)."""
    raise CheckpointExistsError(
        f"{dst}: already exists; a committed step is never overwritten unless asked. "
        "Pass overwrite=True to replace it, or save under another step.",
        path=str(dst),
    )


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two names (both must exist); False when unsupported."""
    return _rename2(a, b, _RENAME_EXCHANGE)


def remove_tree(path: str | os.PathLike[str], *, ignore_errors: bool = False) -> bool:
    """Remove a file, a link or a directory tree, never following a link; missing is fine.

    The one tree-removal helper of tdckpt. Decided from ``lstat``: a link (even one to a
    directory) is unlinked, never walked. If the entry is swapped for a link after that,
    ``shutil.rmtree`` refuses it (it works on directory descriptors and never follows links
    inside the tree either). ``ignore_errors`` is for clean-ups after a failure: an
    ``OSError`` then leaves what it could not remove instead of hiding the first error.

    Returns:
        True when something was there (and is now removed), False when nothing was.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        if ignore_errors:
            return False
        raise
    try:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=ignore_errors)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    except OSError:
        if not ignore_errors:
            raise
    return True


# -- commits -----------------------------------------------------------------------------------


def staging_dir(root: Path, step: int) -> Path:
    """Create the staging folder of ``step`` in ``root`` (a temporary name ``gc`` knows)."""
    staging = root / tmp_name(step)
    staging.mkdir()
    return staging


def replace_step(root: Path, step: int, staging: Path, final: Path, *, fsync: bool) -> None:
    """Swap the staged folder in for the committed ``final``, then delete the old one.

    Atomic where ``renameat2(RENAME_EXCHANGE)`` is offered; elsewhere a crash between the
    two renames leaves the old step aside, which :func:`recover_or_remove` renames back."""
    if _exchange(staging, final):
        # Whatever ``final`` was (folder, file, link), it is now at the staging name; a
        # link is unlinked below, never followed.
        aside = staging
    elif final.is_symlink() or not final.is_dir():
        # A file (or link) where the step folder belongs: retire it like any step.
        aside = root / tmp_name(step, tag="retired")
        os.rename(final, aside)
        os.rename(staging, final)
    else:
        aside = root / tmp_name(step, tag=REPLACED_SUFFIX[1:])
        os.rename(final, aside)
        # A crash here leaves no <step>; gc renames <aside> back (recover_or_remove).
        try:
            os.rename(staging, final)
        except BaseException:
            os.rename(aside, final)
            raise
    if fsync:
        fsync_dir(root)
    remove_tree(aside)


def retire(root: Path, path: Path, step: int) -> Path:
    """Rename a committed step to a temporary name; the caller removes it afterwards.

    After this returns (and the caller has fsynced ``root``, once for all the steps it
    retires) the step is no longer listed, whatever happens to the deletion that follows.
    """
    aside = root / tmp_name(step, archive=path.name.endswith(ARCHIVE_SUFFIX), tag="deleting")
    os.rename(path, aside)
    return aside


def remove_retired(path: Path) -> None:
    """Delete what :func:`retire` set aside."""
    remove_tree(path)


def recover_or_remove(root: Path, name: str, *, fsync: bool = True) -> Path | None:
    """Clean one temporary entry of ``root``: remove it, or restore an interrupted overwrite.

    A ``<step>.tmp-<uuid>.replaced`` folder whose step is missing is the committed step an
    overwrite had renamed aside when the process died: it is renamed back and None is
    returned. Every other temporary entry is removed and its path returned.
    """
    path = root / name
    step = tmp_step(name)
    if (
        step is not None
        and name.endswith(REPLACED_SUFFIX)
        and not os.path.lexists(root / step_name(step))
        and path.is_dir()
        and not path.is_symlink()
    ):
        os.rename(path, root / step_name(step))
        if fsync:
            fsync_dir(root)
        return None
    remove_tree(path)
    return path
