"""The journal of an upgrade in progress, ``<prefix>.tdckpt-upgrade.journal``: its names, the
upgrade lock it is, and its record, written before each phase (``execute.py`` carries the
upgrade out) and read back by the next upgrade to finish or undo an interrupted one.

The journal is never trusted (:func:`read_journal`, :func:`check_journal`): it must be a
small regular JSON file that names only what tdckpt derives from the prefix (its staging,
archive and backup names), or nothing is renamed or removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tdckpt._write.atomic import fsync_dir
from tdckpt._write.journal import (
    OPEN_RECORD,
    write_record,
)
from tdckpt._write.lock import try_flock
from tdckpt.errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    LockError,
    MigrationError,
    TdckptError,
    UnsafePathError,
)

__all__ = [
    "BACKUP_MARK",
    "JOURNAL_SUFFIX",
    "JOURNAL_VERSION",
    "MAX_JOURNAL_BYTES",
    "STAGING_MARK",
    "backup_name",
    "check_journal",
    "ino_of",
    "journal_path",
    "journal_tmp",
    "read_journal",
    "refuse",
    "remove_journal",
    "upgrade_lock",
    "write_journal",
]

#: ``<prefix><JOURNAL_SUFFIX>``: the journal of an upgrade in progress.
JOURNAL_SUFFIX = ".tdckpt-upgrade.journal"
#: ``<prefix><STAGING_MARK><id>`` (``.tdz``): the tree (archive) being staged.
STAGING_MARK = ".tdckpt-upgrade-"
#: ``<prefix><BACKUP_MARK><UTC time>``: the old tree, kept after the swap.
BACKUP_MARK = ".tdckpt-backup-"
JOURNAL_VERSION = 1
_JOURNAL_KEYS = frozenset(
    {"version", "kind", "prefix", "staging", "new_archive", "backup", "keep_backup", "phase"}
    | {"old", "new"}
)
#: A journal is a few hundred bytes; a larger file is not one tdckpt wrote.
MAX_JOURNAL_BYTES = 64 * 1024


@contextlib.contextmanager
def upgrade_lock(prefix: Path) -> Iterator[None]:
    """One upgrade at a time in the prefix's directory (``flock`` on the directory).

    The kernel drops the lock when its holder dies, so a crashed upgrade never blocks the
    re-run that recovers it. Without flock (some network file systems) the journal's
    create-if-absent still refuses a second upgrade of the same prefix.
    """
    parent = prefix.parent if str(prefix.parent) else Path(".")
    try:
        fd = os.open(
            parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
        )
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{prefix}: its directory does not exist.", path=str(prefix)
        ) from exc
    except OSError as exc:
        raise MigrationError(
            f"{prefix}: cannot upgrade: its directory {parent} cannot be opened "
            f"({exc.strerror}). Nothing was changed.",
            script=None,
            path=str(prefix),
        ) from exc
    try:
        try:
            got = try_flock(fd)  # None: no flock here; the journal still refuses a second
        except OSError as exc:
            raise MigrationError(
                f"{prefix}: cannot lock {parent} for the upgrade ({exc.strerror}). "
                "Nothing was changed.",
                script=None,
                path=str(prefix),
            ) from exc
        if got is False:
            raise LockError(
                f"{prefix}: another tdckpt upgrade is running in {parent}; wait for it to "
                "finish, then run this one again.",
                path=str(prefix),
            )
        yield
    finally:
        os.close(fd)  # releases the flock


# -- the journal -------------------------------------------------------------------------------


def journal_path(prefix: Path) -> Path:
    """The journal of an upgrade of ``prefix`` (present while one is in progress)."""
    return prefix.parent / f"{prefix.name}{JOURNAL_SUFFIX}"


def journal_tmp(prefix: Path) -> Path:
    """Where the journal is written before it is linked or renamed into place."""
    return prefix.parent / f".{prefix.name}{JOURNAL_SUFFIX}.tmp"


def backup_name(prefix: Path) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = f"{prefix.name}{BACKUP_MARK}{stamp}"
    candidate, n = prefix.parent / base, 1
    while os.path.lexists(candidate):
        candidate = prefix.parent / f"{base}-{n}"
        n += 1
    return candidate


def write_journal(prefix: Path, state: dict[str, Any], *, create: bool) -> None:
    """Write the journal durably; ``create`` refuses an existing one (the lock)."""
    tmp = journal_tmp(prefix)
    os.close(write_record(tmp, json.dumps(state, indent=1).encode("utf-8")))
    journal = journal_path(prefix)
    if create:
        try:
            os.link(tmp, journal)  # atomic create-if-absent, with the content already there
        except FileExistsError as exc:
            tmp.unlink(missing_ok=True)
            raise IncompleteCheckpointError(
                f"{prefix}: another upgrade holds {journal.name}; wait for it, or run "
                "`tdckpt upgrade` again to finish an interrupted one.",
                path=str(prefix),
            ) from exc
        tmp.unlink()
    else:
        os.replace(tmp, journal)
    fsync_dir(prefix.parent)


def read_journal(prefix: Path) -> dict[str, Any] | None:
    """The journal of ``prefix``, checked (:func:`check_journal`); None when there is none.

    The file is opened once without following a link (and without blocking on a FIFO), must
    be a regular file of at most :data:`MAX_JOURNAL_BYTES`, and must be a JSON object that
    names only what tdckpt derives from the prefix; anything else raises before anything
    is touched.
    """
    journal = journal_path(prefix)
    try:
        fd = os.open(journal, os.O_RDONLY | OPEN_RECORD)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(journal):
            raise refuse(prefix, "is a symlink; tdckpt only ever writes a regular file") from exc
        raise refuse(prefix, f"cannot be read ({exc.strerror})", unsafe=False) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refuse(prefix, "is not a regular file")
        if st.st_size > MAX_JOURNAL_BYTES:
            raise refuse(
                prefix,
                f"is {st.st_size} bytes; an upgrade journal is under {MAX_JOURNAL_BYTES} bytes",
                unsafe=False,
            )
        data = os.read(fd, MAX_JOURNAL_BYTES + 1)
    finally:
        os.close(fd)
    try:
        state = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise refuse(prefix, f"is not valid JSON ({exc})", unsafe=False) from exc
    return check_journal(prefix, state)


def check_journal(prefix: Path, state: Any) -> dict[str, Any]:
    """``state`` if it is a journal tdckpt could have written for ``prefix``; else raise.

    Every name is recomputed from the prefix and compared (staging
    ``<name>.tdckpt-upgrade-<12 hex>``, its ``.tdz``, backup
    ``<name>.tdckpt-backup-<UTC time>[-n]``): a journal can never make tdckpt rename or
    delete anything else. A derived path that exists must be what tdckpt made there (a real
    directory or regular file, never a symlink).
    """
    if not isinstance(state, dict):
        raise refuse(prefix, f"holds a JSON {type(state).__name__}, not an object", unsafe=False)
    unknown = sorted(set(state) - _JOURNAL_KEYS)
    if unknown:
        raise refuse(prefix, f"has fields tdckpt never writes ({unknown})", unsafe=False)
    if state.get("version") != JOURNAL_VERSION:
        raise refuse(
            prefix, f"has version {state.get('version')!r} (this tdckpt writes 1)", unsafe=False
        )
    if state.get("prefix") != prefix.name:
        raise refuse(prefix, f"names the prefix {state.get('prefix')!r}, not {prefix.name!r}")
    kind, phase = state.get("kind"), state.get("phase")
    if kind not in ("directory", "archive"):
        raise refuse(prefix, f"has kind {kind!r}", unsafe=False)
    if phase not in ("staging", "staged", "swapped"):
        raise refuse(prefix, f"has phase {phase!r}", unsafe=False)
    if not isinstance(state.get("keep_backup"), bool):
        raise refuse(prefix, "has no boolean keep_backup", unsafe=False)
    for field in ("old", "new"):
        value = state.get(field)
        if value is not None and not (
            isinstance(value, list)
            and len(value) == 2
            and all(type(v) is int and v >= 0 for v in value)
        ):
            raise refuse(prefix, f"has {field}={value!r} (expected [device, inode])", unsafe=False)
    name = re.escape(prefix.name)
    staging = state.get("staging")
    if not isinstance(staging, str) or not re.fullmatch(
        name + re.escape(STAGING_MARK) + "[0-9a-f]{12}", staging
    ):
        raise refuse(prefix, f"names the staging {staging!r}, not {prefix.name}{STAGING_MARK}<id>")
    backup = state.get("backup")
    if not isinstance(backup, str) or not re.fullmatch(
        name + re.escape(BACKUP_MARK) + r"[0-9]{8}T[0-9]{6}Z(?:-[1-9][0-9]{0,8})?", backup
    ):
        raise refuse(
            prefix, f"names the backup {backup!r}, not {prefix.name}{BACKUP_MARK}<UTC time>"
        )
    new_archive = state.get("new_archive")
    if new_archive != (f"{staging}.tdz" if kind == "archive" else None):
        raise refuse(prefix, f"names the new archive {new_archive!r}, which is not {staging}.tdz")
    parent = prefix.parent
    want = stat.S_ISREG if kind == "archive" else stat.S_ISDIR
    what = "regular file" if kind == "archive" else "directory"
    for path, test, label in (
        (prefix, want, what),
        (parent / backup, want, what),
        (parent / staging, stat.S_ISDIR, "directory"),
        *([(parent / new_archive, stat.S_ISREG, "regular file")] if new_archive else []),
        (journal_tmp(prefix), stat.S_ISREG, "regular file"),
    ):
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if not test(mode):
            found = "a symlink" if stat.S_ISLNK(mode) else "something else"
            raise refuse(
                prefix, f"applies to {path}, which is {found}, not the {label} tdckpt made"
            )
    return state


def refuse(
    prefix: Path, why: str, *, unsafe: bool = True, culprit: Path | None = None
) -> TdckptError:
    """The error for a journal tdckpt will not act on; it says that nothing was changed.
    ``culprit``: the file to remove by hand, when it is not the journal itself (its
    temporary file)."""
    journal = journal_path(prefix)
    bad = culprit if culprit is not None else journal
    remove = "rm -r" if culprit is not None and bad.is_dir() and not bad.is_symlink() else "rm"
    message = (
        f"{journal}: refusing this upgrade journal: it {why}. tdckpt did not write it for "
        f"{prefix.name!r}, so nothing was renamed or removed. If no tdckpt upgrade is "
        f"running here, inspect it and remove it by hand ({remove} {bad}), then run "
        "`tdckpt upgrade` again."
    )
    if unsafe:
        return UnsafePathError(message, path=str(journal))
    return IncompleteCheckpointError(message, path=str(journal))


def remove_journal(prefix: Path) -> None:
    journal_path(prefix).unlink(missing_ok=True)
    journal_tmp(prefix).unlink(missing_ok=True)
    fsync_dir(prefix.parent)


def ino_of(path: Path) -> list[int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return [st.st_dev, st.st_ino]


# -- executing ---------------------------------------------------------------------------------


# -- recovering ------------------------------------------------------------------------------
