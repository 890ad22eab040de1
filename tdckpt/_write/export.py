"""``tdckpt.save``: write one bare prefix (directory or ``.tdz``) atomically.

The manager's steps use the same writer; this is the function for a single prefix outside
a managed root, e.g. to hand a checkpoint to plain tensordict users. What it writes,
tensordict 0.15.3's ``TensorDict.load_memmap`` loads (the manifest is an extra file
tensordict ignores).

The protocol, for a prefix ``<dir>/<name>`` (every name below is derived from ``<name>``
and a fresh random token; nothing else is ever created, renamed or removed):

1. Journal: ``<dir>/.<name>.tdckpt-save`` records the token. It is written and flocked
   under a temporary name (``.<name>.tdckpt-save.<token>.new``) and renamed into place
   without replacing, so it is complete whenever it exists, and held (flock) for the whole
   save: a second save of the same prefix finds it held and is refused.
2. Write the checkpoint into ``<dir>/.<name>.tmp-<token>/`` and make it durable.
3. Commit:

   * a directory: renamed onto ``<name>`` without replacing; an overwrite swaps the two
     trees atomically with ``renameat2(RENAME_EXCHANGE)`` (Linux), so ``<name>`` always
     names a complete checkpoint, old or new; the old one (now at the staging name) is
     then removed. Where the exchange is unsupported, the old tree is renamed to
     ``<dir>/.<name>.old-<token>`` first: a crash before the new tree is renamed in leaves
     no ``<name>``, and the next save of the prefix renames the old one back.
   * a ``.tdz``: packed into ``<dir>/.<name>.<token>.tmp``, synced, renamed onto ``<name>``
     (``os.replace``, atomic; without replacing unless ``overwrite``).

4. Remove the journal.

A save that finds a journal whose flock is free (its save crashed) recovers first: it
restores ``.<name>.old-<token>`` if ``<name>`` is missing, removes the journal's staging,
old and archive temporaries, then the journal. Only names the journal's token derives are
touched, never through a symlink; a journal that is not tdckpt's is refused, untouched.
On a file system without flock a journal counts as crashed only once it is ten minutes
old (a save of the same prefix is refused until then).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tdckpt._progress import ProgressArg, progress_bar
from tdckpt._remote.urls import is_url, require_local_options
from tdckpt._write import atomic as _atomic
from tdckpt._write.journal import OPEN_RECORD as _OPEN
from tdckpt._write.journal import drop_record, write_record
from tdckpt._write.lock import same_file, try_flock
from tdckpt._write.save import write_checkpoint
from tdckpt.errors import CheckpointExistsError, LockError, TdckptError, UnsafePathError
from tdckpt.schema import MANIFEST_NAME, Manifest
from tdckpt.warnings import TdckptWarning

__all__ = ["JOURNAL_SUFFIX", "save"]

#: What the journal of ``<dir>/<name>`` is called: ``.<name>`` + this.
JOURNAL_SUFFIX = ".tdckpt-save"
_TOKEN_RE = re.compile(r"[0-9a-f]{16}")
_MAX_JOURNAL_BYTES = 4096
#: The longest file name most file systems take (ext4, xfs, btrfs, tmpfs: 255 bytes).
_NAME_MAX = 255
#: What the longest derived name adds to the prefix's name.
_NAME_OVERHEAD = len(f".{JOURNAL_SUFFIX}.{'0' * 16}.new")
#: Without flock, a journal older than this (seconds) belongs to a save that crashed.
_NO_FLOCK_GRACE = 600.0

#: Fault injection for the crash tests: called with the name of each protocol stage
#: ("journal-new", "journal", "written", "swapped", "aside", "renamed", "archived", "committed",
#: "cleaned"). None (always, outside tests) costs one comparison per stage.
_fault: Callable[[str], None] | None = None


def _at(stage: str) -> None:
    if _fault is not None:
        _fault(stage)


class _Names:
    """Every name a save of ``dest`` may create, all derived from its name and a token."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.parent = dest.parent
        self.name = dest.name
        self.journal = self.parent / f".{self.name}{JOURNAL_SUFFIX}"

    def journal_new(self, token: str) -> Path:
        return self.parent / f".{self.name}{JOURNAL_SUFFIX}.{token}.new"

    def staging(self, token: str) -> Path:
        return self.parent / f".{self.name}.tmp-{token}"

    def old(self, token: str) -> Path:
        return self.parent / f".{self.name}.old-{token}"

    def archive_tmp(self, token: str) -> Path:
        return self.parent / f".{self.name}.{token}.tmp"


def _journal_record(names: _Names, token: str) -> bytes:
    return json.dumps({"tdckpt_save": 1, "prefix": names.name, "token": token}).encode()


def _parse_journal(names: _Names, data: bytes) -> str | None:
    """The token of a journal tdckpt wrote for this prefix, or None."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if type(raw) is not dict or raw.get("tdckpt_save") != 1 or raw.get("prefix") != names.name:
        return None
    token = raw.get("token")
    if type(token) is not str or _TOKEN_RE.fullmatch(token) is None:
        return None
    return token


def _foreign_journal(names: _Names, why: str) -> UnsafePathError:
    return UnsafePathError(
        f"{names.journal}: {why}; expected the journal of an interrupted tdckpt.save of "
        f"{names.dest}. Nothing was changed. Remove it if no save of this prefix is running.",
        path=str(names.journal),
    )


def _recover(names: _Names, *, fsync: bool, stacklevel: int) -> None:
    """Finish the crashed save a journal belongs to (see the module docstring).

    ``stacklevel``: where the warning points, 1 being the caller of ``_recover``.
    """
    try:
        fd = os.open(names.journal, os.O_RDONLY | _OPEN)
    except FileNotFoundError:
        return  # its save just finished
    except OSError as exc:
        raise _foreign_journal(names, f"cannot open it ({exc.strerror})") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _foreign_journal(names, "not a regular file")
        got = try_flock(fd)
        if got is False or (got is None and time.time() - st.st_mtime < _NO_FLOCK_GRACE):
            # Without flock (some network mounts) only a journal left for a while is stale.
            held = "is locked" if got is False else "is recent and cannot be locked here"
            raise LockError(
                f"{names.dest}: another tdckpt.save of this prefix is in progress (its journal "
                f"{names.journal} {held}). Wait for it to finish, or save elsewhere.",
                path=str(names.dest),
                journal=str(names.journal),
            )
        if st.st_size > _MAX_JOURNAL_BYTES:
            raise _foreign_journal(names, f"{st.st_size} bytes, too large for a save journal")
        token = _parse_journal(names, os.pread(fd, _MAX_JOURNAL_BYTES, 0))
        if token is None:
            raise _foreign_journal(names, "not a save journal tdckpt wrote for this prefix")
        old, done = names.old(token), []
        if os.path.lexists(old):
            if not os.path.lexists(names.dest):
                # Crashed between renaming the old tree aside and the new one in.
                os.rename(old, names.dest)
                done.append(f"restored the previous checkpoint from {old.name}")
            elif _atomic.remove_tree(old):
                done.append(f"removed the replaced checkpoint {old.name}")
        for leftover in (names.staging(token), names.archive_tmp(token)):
            if _atomic.remove_tree(leftover):
                done.append(f"removed {leftover.name}")
        if fsync:
            _atomic.fsync_dir(names.parent)
        drop_record(fd, names.journal, fsync=fsync)
    finally:
        os.close(fd)
    warnings.warn(
        f"{names.dest}: an earlier tdckpt.save of this prefix was interrupted; recovered it "
        f"({'; '.join(done) or 'nothing was left behind'}). {names.dest} holds the last "
        "checkpoint that was completely saved.",
        TdckptWarning,
        stacklevel=stacklevel + 1,
    )


def _remove_stale_new_journals(names: _Names) -> None:
    """Remove ``.<name>.tdckpt-save.<token>.new`` files of saves that crashed at step 1."""
    pattern = re.compile(re.escape(f".{names.name}{JOURNAL_SUFFIX}.") + r"([0-9a-f]{16})\.new")
    with os.scandir(names.parent) as scan:
        candidates = [(e.name, m.group(1)) for e in scan if (m := pattern.fullmatch(e.name))]
    for name, token in candidates:
        path = names.parent / name
        try:
            fd = os.open(path, os.O_RDONLY | _OPEN)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            got = try_flock(fd)
            if (
                stat.S_ISREG(st.st_mode)
                and (got or (got is None and time.time() - st.st_mtime > _NO_FLOCK_GRACE))
                and _parse_journal(names, os.pread(fd, _MAX_JOURNAL_BYTES, 0)) == token
                and same_file(fd, path)
            ):
                os.unlink(path)
        finally:
            os.close(fd)


def _begin(names: _Names, *, fsync: bool, stacklevel: int) -> tuple[int, str]:
    """Create and hold this save's journal (recovering a crashed one). Returns (fd, token).

    ``stacklevel``: where a recovery warning points, 1 being the caller of ``_begin``.
    """
    _remove_stale_new_journals(names)
    token = secrets.token_hex(8)
    tmp = names.journal_new(token)
    fd = write_record(tmp, _journal_record(names, token), fsync=fsync, flock=True)
    try:
        _at("journal-new")
        for _ in range(3):
            try:
                _atomic.rename_noreplace(tmp, names.journal)  # the flock moves with it
                break
            except CheckpointExistsError:
                _recover(names, fsync=fsync, stacklevel=stacklevel + 1)
        else:
            raise LockError(
                f"{names.dest}: other saves of this prefix keep starting; try again.",
                path=str(names.dest),
            )
        if fsync:
            _atomic.fsync_dir(names.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        os.close(fd)
        raise
    return fd, token


def _end(names: _Names, fd: int, *, fsync: bool) -> None:
    """Remove this save's journal (the save is complete, or fully undone)."""
    try:
        drop_record(fd, names.journal, fsync=fsync)
    finally:
        os.close(fd)


def _check_prefix(dest: Path) -> None:
    if dest.name in ("", ".", ".."):
        raise UnsafePathError(
            f"{dest}: names no file or directory of its own; pass the checkpoint's own path "
            "(e.g. 'out/ckpt' or 'out/ckpt.tdz').",
            path=str(dest),
        )
    if len(os.fsencode(dest.name)) + _NAME_OVERHEAD > _NAME_MAX:
        raise UnsafePathError(
            f"{dest}: the name is too long; tdckpt.save needs {_NAME_OVERHEAD} more bytes "
            f"for its temporary names, within the {_NAME_MAX}-byte limit. Use a shorter name.",
            path=str(dest),
        )


def _check_replaceable(dest: Path) -> None:
    """``overwrite=True`` replaces a checkpoint (or an empty folder), never other data.

    A directory must hold a checkpoint's top-level metadata, an archive path must be a
    regular file that starts like a zip; a symlink is replaced itself (its target is left
    alone). Anything else - a folder of other files, a file where a folder checkpoint
    belongs, a FIFO or device - is refused, so a wrong path cannot delete a user's data.
    """
    st = os.lstat(dest)
    if stat.S_ISLNK(st.st_mode):
        return
    if dest.suffix == ".tdz":
        if stat.S_ISREG(st.st_mode) and (st.st_size == 0 or _starts_like_zip(dest)):
            return
        expected = "a .tdz archive"
    else:
        if stat.S_ISDIR(st.st_mode):
            if _holds_checkpoint_metadata(dest):
                return
            with os.scandir(dest) as entries:
                if next(entries, None) is None:
                    return
        expected = (
            "a checkpoint folder (one holding tensordict's meta.json, meta.pt or tdckpt's "
            "manifest) or an empty folder"
        )
    raise CheckpointExistsError(
        f"{dest}: exists and is not {expected}; overwrite=True replaces only a checkpoint, "
        "so nothing was written. Remove it yourself, or choose another prefix.",
        path=str(dest),
    )


def _holds_checkpoint_metadata(folder: Path) -> bool:
    """Whether ``folder`` holds a checkpoint's top-level metadata: tdckpt's manifest, an
    old tensordict's ``meta.pt``, or a ``meta.json`` that is a tensordict level's (a file
    of that name holding anything else - a dataset's description - is not one)."""
    from tdckpt._read.detect import level_kind
    from tdckpt._read.directory import DirectoryStorage

    for name in (MANIFEST_NAME, "meta.pt"):
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(folder / name).st_mode):
                return True
    # read as a restore reads it: no link followed, a regular file, bounded, parsed
    with DirectoryStorage(folder) as storage:
        try:
            meta = storage.read_json("meta.json")
        except (TdckptError, OSError):
            return False
    return isinstance(meta, dict) and level_kind(meta) != "unknown"


def _starts_like_zip(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 4) in (
            b"PK\x03\x04",
            b"PK\x05\x06",
        )
    finally:
        os.close(fd)


def _refuse_existing(dest: Path) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{dest}: already exists. Pass overwrite=True to replace it, or choose another prefix.",
        path=str(dest),
    )


def _commit_dir(names: _Names, staging: Path, token: str, *, overwrite: bool, fsync: bool) -> None:
    dest = names.dest
    if not (overwrite and os.path.lexists(dest)):
        try:
            _atomic.rename_noreplace(staging, dest)
        except CheckpointExistsError:
            raise _refuse_existing(dest) from None
        if fsync:
            _atomic.fsync_dir(names.parent)
        return
    if _atomic._exchange(staging, dest):
        # One atomic step: dest is the new tree, staging the old one.
        _at("swapped")
        if fsync:
            _atomic.fsync_dir(names.parent)
        _atomic.remove_tree(staging)
        _at("cleaned")
        return
    old = names.old(token)
    os.rename(dest, old)
    _at("aside")
    # A crash here leaves no dest: the journal makes the next save rename old back.
    try:
        os.rename(staging, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    _at("renamed")
    if fsync:
        _atomic.fsync_dir(names.parent)
    _atomic.remove_tree(old)
    _at("cleaned")


def save(
    obj: Any,
    prefix: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    fsync: bool = True,
    progress: ProgressArg = None,
    layout: str = "memmap",
    storage_options: dict[str, Any] | None = None,
) -> Manifest:
    """Save a TensorDict (or tensorclass, lazy stack) to ``prefix``, all or nothing.

    The checkpoint is written into a temporary folder beside ``prefix``, fsynced, and
    renamed into place, so ``prefix`` either holds the whole checkpoint or is untouched.
    A ``prefix`` ending in ``.tdz`` becomes a tensordict-compatible zip archive.

    ``overwrite=True`` replaces an existing ``prefix`` atomically: a directory is swapped
    with ``renameat2(RENAME_EXCHANGE)``, an archive replaced by ``os.replace``, so a reader
    always finds the complete old or the complete new checkpoint. On a file system without
    the exchange (not Linux, some network mounts) a directory is renamed aside first; a
    crash at that instant leaves ``.<name>.old-<token>`` beside a missing ``prefix``, which
    the next ``save`` of ``prefix`` renames back. Every save cleans what a crashed save of
    the same prefix left behind (with a :class:`~tdckpt.warnings.TdckptWarning`).

    Args:
        obj: what to save.
        prefix: the destination directory, or ``*.tdz`` file.
        metadata: JSON data stored in tdckpt's manifest (``user_metadata``).
        overwrite: replace an existing ``prefix`` instead of refusing.
        fsync: make the data durable before the commit (on by default).
        progress: ``True`` draws a progress bar (tqdm, on stderr, only when it is a
            terminal); a callable is called as ``progress(bytes_done, bytes_total)``.
        layout: ``"memmap"`` (a file per leaf, what ``td.memmap(prefix)`` writes) or
            ``"consolidated"``: ``prefix`` is a folder holding one data file,
            ``tensordict.consolidated``, that ``TensorDict.from_consolidated`` loads, and the
            manifest, with every leaf's offset, size and checksum (no progress is reported).
        storage_options: for an fsspec URL ``prefix`` (``s3://bucket/ckpt``,
            ``memory://x``), the filesystem's options. A URL gets a plain prefix of objects
            that :func:`tdckpt.load_memmap` reads in place: written locally first, then
            uploaded with the root ``meta.json`` last (no reader sees a partial
            checkpoint); a URL ending in ``.tdz`` gets one archive object. Object storage
            cannot replace a prefix all or nothing, so a URL that already holds objects is
            refused and ``overwrite=True`` too; steps that are replaced or retried belong in
            a :class:`~tdckpt.CheckpointManager`.

    Returns:
        The manifest written (sizes and checksums of every file).

    Raises:
        tdckpt.errors.CheckpointExistsError: ``prefix`` exists and overwrite is False.
        tdckpt.errors.LockError: another save of ``prefix`` is running.
        tdckpt.errors.UnsafePathError: ``prefix`` has no name of its own (``"."``) or one
            too long for the temporary names, or a file that is not tdckpt's sits where
            the save journal belongs.
        tdckpt.errors.RemoteError: an upload to a URL kept failing (the message says
            what was left there).
    """
    if is_url(prefix):  # never Path("memory://b/x"): a local folder named "memory:"
        return _save_url(
            obj,
            str(prefix),
            metadata=metadata,
            overwrite=overwrite,
            progress=progress,
            layout=layout,
            storage_options=storage_options,
        )
    require_local_options(prefix, storage_options)
    from tdckpt._write.consolidated_write import check_consolidatable, check_layout

    consolidated = check_layout(layout) == "consolidated"
    dest = Path(prefix)
    if consolidated and dest.suffix == ".tdz":
        raise ValueError(
            f"{dest}: layout='consolidated' writes a folder (one data file and the manifest), "
            "not a .tdz archive; choose a prefix without the .tdz suffix."
        )
    if consolidated:
        check_consolidatable(obj, dest)  # refused naming the prefix, before anything is made
    _check_prefix(dest)
    if os.path.lexists(dest):
        if not overwrite:
            raise _refuse_existing(dest)
        _check_replaceable(dest)
    names = _Names(dest)
    try:
        names.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where a parent folder belongs, a read-only folder
        raise UnsafePathError(
            f"{dest}: cannot create its parent folder {names.parent} ({exc.strerror}: "
            f"{exc.filename}); nothing was written. Pass a prefix under a folder this "
            "process can write.",
            path=str(dest),
        ) from exc
    # stacklevel 1 is _begin's caller (here), 2 the caller of save
    fd, token = _begin(names, fsync=fsync, stacklevel=2)
    staging = names.staging(token)
    clean = False
    try:
        _at("journal")
        if consolidated:
            from tdckpt._write.consolidated_write import write_consolidated

            manifest = write_consolidated(obj, staging, user_metadata=metadata, fsync=fsync)
        else:
            with progress_bar(progress, "save") as report:
                manifest = write_checkpoint(
                    obj,
                    staging,
                    user_metadata=metadata,
                    fsync=fsync,
                    progress=report,
                    direct=dest.suffix != ".tdz",  # an archive's staging is read back at once
                )
        _at("written")
        if dest.suffix == ".tdz":
            from tdckpt._write.archive_write import write_archive

            if os.path.lexists(dest) and not overwrite:
                raise CheckpointExistsError(
                    f"{dest}: appeared while saving; not replaced. Pass overwrite=True to "
                    "replace it.",
                    path=str(dest),
                )
            write_archive(
                staging,
                dest,
                fsync=fsync,
                tmp=names.archive_tmp(token),
                replace=overwrite,
            )
            _at("archived")
            _atomic.remove_tree(staging)
        else:
            _commit_dir(names, staging, token, overwrite=overwrite, fsync=fsync)
        _at("committed")
        clean = True
        return manifest
    except BaseException:
        # An ordinary error: undo what this save created. If that fails too, the journal
        # stays, and the next save of the prefix finishes the job.
        with contextlib.suppress(OSError):
            _atomic.remove_tree(staging)
            _atomic.remove_tree(names.archive_tmp(token))
            clean = not os.path.lexists(names.old(token))
        raise
    finally:
        if clean:
            _end(names, fd, fsync=fsync)
        else:
            os.close(fd)


def _save_url(
    obj: Any,
    url: str,
    *,
    metadata: dict[str, Any] | None,
    overwrite: bool,
    progress: ProgressArg,
    layout: str,
    storage_options: dict[str, Any] | None,
) -> Manifest:
    """:func:`save` to object storage (see :mod:`tdckpt._remote.upload`)."""
    import tempfile

    from tdckpt._remote.upload import empty_prefix, upload_prefix
    from tdckpt._write.consolidated_write import check_layout

    if overwrite:
        raise ValueError(
            f"{url}: overwrite=True replaces a checkpoint all or nothing, which object storage "
            "cannot do for a plain prefix (no atomic rename); nothing was written. Delete the "
            "prefix first, or use CheckpointManager(url) for steps committed atomically."
        )
    if check_layout(layout) != "memmap":
        raise ValueError(
            f"{url}: a URL holds the memmap layout (an object per file, read in place by "
            "ranged reads) or a .tdz archive (one object); save the consolidated layout "
            "locally and upload it, or drop layout=."
        )
    archive = url.rstrip("/").endswith(".tdz")
    store = empty_prefix(url, storage_options)
    with tempfile.TemporaryDirectory(prefix="tdckpt-upload-") as tmp:
        local = Path(tmp) / ("checkpoint.tdz" if archive else "checkpoint")
        manifest = save(obj, local, metadata=metadata, fsync=False, progress=progress)
        upload_prefix(store, local)
    return manifest
