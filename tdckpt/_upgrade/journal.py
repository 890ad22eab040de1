"""Carry out an upgrade plan on disk, crash-safely: lock, journal, staging, swap, recovery.

:func:`execute` materializes the migrated tree beside the prefix and swaps it in:

1. a journal ``<prefix>.tdckpt-upgrade.journal`` is created (it is also the lock: one
   upgrade per prefix at a time);
2. the new tree is built in ``<prefix>.tdckpt-upgrade-<id>/``: every ``meta.json`` as the
   plan wrote it, every leaf file a **copy of its own** of the old one - a reflink
   (``ioctl(FICLONE)``: extents shared copy-on-write, no byte copied) where the file system
   can, else a real copy - so that the backup and the upgraded tree never share a file (a
   write through one never reaches the other); with ``backup=False`` (the old tree is
   deleted) a hard link instead. Each leaf is opened once without following links, checked
   against what was validated, and checksummed as it is copied (or read, for a link); the
   checksums an old tdckpt manifest recorded are kept. New side files are written,
   tdckpt's manifest last; files and directories fsynced;
3. the journal records the inode of the old prefix and of the staged tree (``staged``);
4. swap: the two names are exchanged atomically (``renameat2(RENAME_EXCHANGE)``) where the
   kernel can, else the old prefix is renamed to the backup name and the staged tree into
   place; the old tree ends as ``<prefix>.tdckpt-backup-<UTC time>`` (an existing backup is
   never overwritten) and is deleted only with ``backup=False``;
5. the journal is removed.

A crash at any instant leaves the old prefix intact (at its name, or, between the two
renames of the fallback, at the backup name with the journal saying so) or the new one in
place; the next ``upgrade`` of the prefix reads the journal first and finishes the swap or
removes the partial staging (:func:`recover`), comparing inodes rather than trusting names.
The journal itself is never trusted either (:func:`read_journal`, :func:`check_journal`): it
may only name what tdckpt derives from the prefix, or nothing is touched.

``.tdz`` archives follow the same protocol with files: the entries are streamed out of the
archive into the staging directory and packed by :func:`tdckpt._read.archive.write_archive` into
``<prefix>.tdckpt-upgrade-<id>.tdz``; the old archive is hard-linked to the backup name and
the new one ``os.replace``-d onto the prefix.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import json
import os
import re
import stat
import uuid
import zipfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tdckpt import schema
from tdckpt._read.storage import Storage
from tdckpt._read.tree import VFile
from tdckpt._report import Problem
from tdckpt._upgrade.plan import Progress, UpgradePlan, UpgradeReport
from tdckpt._write.archive_write import write_archive
from tdckpt._write.atomic import fsync_dir, remove_tree
from tdckpt._write.checksum import DEFAULT_CHECKSUM, new_hasher
from tdckpt._write.journal import (
    COPY_CHUNK,
    OPEN_RECORD,
    copy_fd,
    fsync_file,
    hash_fd,
    write_record,
)
from tdckpt._write.lock import try_flock
from tdckpt._write.save import _write_small
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
    "MAX_JOURNAL_BYTES",
    "STAGING_MARK",
    "check_journal",
    "execute",
    "journal_path",
    "journal_tmp",
    "read_journal",
    "recover",
    "upgrade_lock",
    "write_error",
]

#: ``<prefix><JOURNAL_SUFFIX>``: the journal of an upgrade in progress.
JOURNAL_SUFFIX = ".tdckpt-upgrade.journal"
#: ``<prefix><STAGING_MARK><id>`` (``.tdz``): the tree (archive) being staged.
STAGING_MARK = ".tdckpt-upgrade-"
#: ``<prefix><BACKUP_MARK><UTC time>``: the old tree, kept after the swap.
BACKUP_MARK = ".tdckpt-backup-"
_JOURNAL_VERSION = 1
_JOURNAL_KEYS = frozenset(
    {"version", "kind", "prefix", "staging", "new_archive", "backup", "keep_backup", "phase"}
    | {"old", "new"}
)
#: A journal is a few hundred bytes; a larger file is not one tdckpt wrote.
MAX_JOURNAL_BYTES = 64 * 1024
#: errno values for which a hard link is impossible and a copy is made instead.
_NO_LINK = frozenset(
    {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES}
)


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


def _backup_name(prefix: Path) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = f"{prefix.name}{BACKUP_MARK}{stamp}"
    candidate, n = prefix.parent / base, 1
    while os.path.lexists(candidate):
        candidate = prefix.parent / f"{base}-{n}"
        n += 1
    return candidate


def _write_journal(prefix: Path, state: dict[str, Any], *, create: bool) -> None:
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
            raise _refuse(prefix, "is a symlink; tdckpt only ever writes a regular file") from exc
        raise _refuse(prefix, f"cannot be read ({exc.strerror})", unsafe=False) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(prefix, "is not a regular file")
        if st.st_size > MAX_JOURNAL_BYTES:
            raise _refuse(
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
        raise _refuse(prefix, f"is not valid JSON ({exc})", unsafe=False) from exc
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
        raise _refuse(prefix, f"holds a JSON {type(state).__name__}, not an object", unsafe=False)
    unknown = sorted(set(state) - _JOURNAL_KEYS)
    if unknown:
        raise _refuse(prefix, f"has fields tdckpt never writes ({unknown})", unsafe=False)
    if state.get("version") != _JOURNAL_VERSION:
        raise _refuse(
            prefix, f"has version {state.get('version')!r} (this tdckpt writes 1)", unsafe=False
        )
    if state.get("prefix") != prefix.name:
        raise _refuse(prefix, f"names the prefix {state.get('prefix')!r}, not {prefix.name!r}")
    kind, phase = state.get("kind"), state.get("phase")
    if kind not in ("directory", "archive"):
        raise _refuse(prefix, f"has kind {kind!r}", unsafe=False)
    if phase not in ("staging", "staged", "swapped"):
        raise _refuse(prefix, f"has phase {phase!r}", unsafe=False)
    if not isinstance(state.get("keep_backup"), bool):
        raise _refuse(prefix, "has no boolean keep_backup", unsafe=False)
    for field in ("old", "new"):
        value = state.get(field)
        if value is not None and not (
            isinstance(value, list)
            and len(value) == 2
            and all(type(v) is int and v >= 0 for v in value)
        ):
            raise _refuse(prefix, f"has {field}={value!r} (expected [device, inode])", unsafe=False)
    name = re.escape(prefix.name)
    staging = state.get("staging")
    if not isinstance(staging, str) or not re.fullmatch(
        name + re.escape(STAGING_MARK) + "[0-9a-f]{12}", staging
    ):
        raise _refuse(prefix, f"names the staging {staging!r}, not {prefix.name}{STAGING_MARK}<id>")
    backup = state.get("backup")
    if not isinstance(backup, str) or not re.fullmatch(
        name + re.escape(BACKUP_MARK) + r"[0-9]{8}T[0-9]{6}Z(?:-[1-9][0-9]{0,8})?", backup
    ):
        raise _refuse(
            prefix, f"names the backup {backup!r}, not {prefix.name}{BACKUP_MARK}<UTC time>"
        )
    new_archive = state.get("new_archive")
    if new_archive != (f"{staging}.tdz" if kind == "archive" else None):
        raise _refuse(prefix, f"names the new archive {new_archive!r}, which is not {staging}.tdz")
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
            raise _refuse(
                prefix, f"applies to {path}, which is {found}, not the {label} tdckpt made"
            )
    return state


def _refuse(prefix: Path, why: str, *, unsafe: bool = True) -> TdckptError:
    """The error for a journal tdckpt will not act on; it says that nothing was changed."""
    journal = journal_path(prefix)
    message = (
        f"{journal}: refusing this upgrade journal: it {why}. tdckpt did not write it for "
        f"{prefix.name!r}, so nothing was renamed or removed. If no tdckpt upgrade is "
        f"running here, inspect it and remove it by hand (rm {journal}), then run "
        "`tdckpt upgrade` again."
    )
    if unsafe:
        return UnsafePathError(message, path=str(journal))
    return IncompleteCheckpointError(message, path=str(journal))


def _remove_journal(prefix: Path) -> None:
    journal_path(prefix).unlink(missing_ok=True)
    journal_tmp(prefix).unlink(missing_ok=True)
    fsync_dir(prefix.parent)


def _ino(path: Path) -> list[int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return [st.st_dev, st.st_ino]


# -- executing ---------------------------------------------------------------------------------


class _Runner:
    """Performs the planned operations in order, reporting each."""

    def __init__(self, plan: UpgradePlan, progress: Progress | None) -> None:
        self.plan = plan
        self.progress = progress
        self.total = len(plan.report.operations)
        self.done = 0

    def step(self, kind: str) -> None:
        op = self.plan.report.operations[self.done]
        assert op.kind == kind, f"operation {self.done}: planned {op.kind}, performing {kind}"
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total, f"{op.kind} {op.path}")


def execute(plan: UpgradePlan, *, keep_backup: bool, progress: Progress | None) -> None:
    """Carry out ``plan`` (journal, staging, swap); set ``plan.report.backup``.

    Before the swap any error removes the staging and the journal, leaving the old prefix
    untouched; after it, what is left is what :func:`recover` finishes.
    """
    prefix = plan.prefix
    archive = plan.storage.kind == "archive"
    token = uuid.uuid4().hex[:12]
    staging = prefix.parent / f"{prefix.name}{STAGING_MARK}{token}"
    new_archive = prefix.parent / f"{prefix.name}{STAGING_MARK}{token}.tdz"
    backup = _backup_name(prefix)
    state: dict[str, Any] = {
        "version": _JOURNAL_VERSION,
        "kind": "archive" if archive else "directory",
        "prefix": prefix.name,
        "staging": staging.name,
        "new_archive": new_archive.name if archive else None,
        "backup": backup.name,
        "keep_backup": keep_backup,
        "phase": "staging",
        "old": _ino(prefix),
        "new": None,
    }
    try:
        _write_journal(prefix, state, create=True)
    except OSError as exc:
        with contextlib.suppress(OSError):
            journal_tmp(prefix).unlink(missing_ok=True)
        raise write_error(prefix, exc, plan.copy_bytes) from exc
    runner = _Runner(plan, progress)
    try:
        _build_staging(plan, staging, runner)
        if archive:
            write_archive(staging, new_archive, compression="stored", fsync=True)
            runner.step("write")
            state["new"] = _ino(new_archive)
        else:
            state["new"] = _ino(staging)
    except BaseException as exc:
        # Nothing was swapped: the old prefix is untouched. Undo the staging.
        for leftover in (staging, new_archive):
            with contextlib.suppress(OSError):
                remove_tree(leftover)
        with contextlib.suppress(OSError):
            _remove_journal(prefix)
        if isinstance(exc, OSError):
            raise write_error(prefix, exc, plan.copy_bytes) from exc
        raise
    try:
        state["phase"] = "staged"
        _write_journal(prefix, state, create=False)
        _swap(prefix, state, runner)
    except OSError as exc:
        raise IncompleteCheckpointError(
            f"{prefix}: the upgrade stopped while putting the upgraded tree in place ({exc}). "
            f"The journal {journal_path(prefix).name} records where each tree is; run "
            "`tdckpt upgrade` again to finish it.",
            path=str(prefix),
        ) from exc
    plan.report.backup = str(backup) if keep_backup else None


def write_error(prefix: Path, exc: OSError, copy_bytes: int = 0) -> TdckptError:
    """A clear error for an upgrade that could not write beside ``prefix`` (nothing changed)."""
    parent = prefix.parent if str(prefix.parent) else Path(".")
    what = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = (
            f"the directory {parent} is not writable ({what}); an upgrade writes the new tree "
            "beside the prefix. Make it writable, or copy the checkpoint somewhere writable "
            "and upgrade the copy"
        )
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = (
            f"not enough space in {parent} ({what}). An upgrade that keeps a backup copies "
            f"the leaf data ({copy_bytes} bytes) unless the file system shares extents "
            "(reflink); free space, or upgrade without a backup (--no-backup / backup=False), "
            "which hard-links the leaves instead"
        )
    else:
        hint = f"{what}"
    return MigrationError(
        f"{prefix}: cannot upgrade: {hint}. Nothing was changed.", script=None, path=str(prefix)
    )


def _build_staging(plan: UpgradePlan, staging: Path, runner: _Runner) -> None:
    storage = plan.storage
    archive = storage.kind == "archive"
    staging.mkdir()
    for rel in plan.dirs:
        if rel:
            (staging / rel).mkdir()
    metas = dict(plan.metas)
    files = {rel: vfile for rel, vfile in plan.new_files}
    sums: dict[str, str] = {}
    zf = zipfile.ZipFile(storage.location) if archive else None
    try:
        for op in plan.report.operations:
            if op.kind == "write-meta":
                _write_small(staging / op.path, metas[op.path], fsync=True)
                runner.step("write-meta")
            elif op.kind in ("link", "copy", "write") and op.path in files:
                vfile = files[op.path]
                dst = staging / op.path
                if vfile.data is not None:
                    _write_small(dst, vfile.data, fsync=True)
                else:
                    kept = plan.kept_checksums.get(op.path)
                    algorithm = kept.split(":", 1)[0] if kept else DEFAULT_CHECKSUM
                    if zf is not None:
                        digest: str | None = _extract(zf, vfile, dst, algorithm)
                    else:
                        # a copy reads the bytes anyway: checksum them (and compare with
                        # the kept checksum); a link reads them only when none is kept
                        copy = op.kind == "copy"
                        digest = _place_leaf(
                            storage,
                            vfile,
                            dst,
                            plan.report,
                            copy=copy,
                            algorithm=algorithm if copy or kept is None else None,
                        )
                    if kept is not None:
                        if digest is not None and digest != kept:
                            plan.report.problems.append(_mismatch(op.path, kept, digest))
                        sums[op.path] = kept  # never launder a change since the save
                    elif digest is not None:
                        sums[op.path] = digest
                runner.step(op.kind)
            elif op.kind == "write" and op.path == schema.MANIFEST_NAME:
                _write_small(staging / schema.MANIFEST_NAME, plan.manifest_bytes(sums), fsync=True)
                runner.step("write")
                break
    finally:
        if zf is not None:
            zf.close()
    for rel in reversed(plan.dirs):  # children before parents
        fsync_dir(staging / rel if rel else staging)
    fsync_dir(staging.parent)


def _mismatch(path: str, kept: str, found: str) -> Problem:
    return Problem(
        "checksum-mismatch",
        "warning",
        path,
        (),
        f"its bytes no longer match the checksum its tdckpt manifest recorded ({kept}, "
        f"found {found}): the file changed after it was saved. The upgraded manifest keeps "
        "the recorded checksum, so `verify` reports it; restore this leaf from a good copy.",
    )


def _changed(src: Path | str, why: str) -> MigrationError:
    return MigrationError(
        f"{src}: {why} since the checkpoint was validated, so the upgrade stopped and nothing "
        "was changed. Run `tdckpt upgrade` again once nothing else writes the checkpoint.",
        script=None,
        path=str(src),
    )


def _place_leaf(
    storage: Storage,
    vfile: VFile,
    dst: Path,
    report: UpgradeReport,
    *,
    copy: bool,
    algorithm: str | None,
) -> str | None:
    """Put one leaf of the old tree into the staging; return its checksum when computed.

    The source is opened once without following links and checked (a regular file of the
    validated size); what is placed is exactly that file's bytes. ``copy``: new bytes of
    its own (a reflink where the file system shares extents copy-on-write, else a real
    copy, checksummed on the way), so that the backup and the upgraded tree never share a
    file. Otherwise a hard link (no backup is kept). ``algorithm``: checksum the bytes
    (None: the old manifest's checksum is kept, and no extra read is made for it).
    """
    assert vfile.source is not None
    src = storage.physical_path(vfile.source)
    assert src is not None
    try:
        fd = os.open(src, os.O_RDONLY | OPEN_RECORD)
    except OSError as exc:
        raise _changed(src, f"cannot be opened any more ({exc.strerror})") from exc
    changed = functools.partial(_changed, src)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _changed(src, "is no longer a regular file")
        if st.st_size != vfile.size:
            raise _changed(src, f"is {st.st_size} bytes, not {vfile.size},")
        if not copy:
            try:
                os.link(src, dst)
            except OSError as exc:
                if exc.errno not in _NO_LINK:
                    raise
                why = os.strerror(exc.errno or 0)
                report.copied.append(f"{vfile.source}: {why}; copied instead")
            else:
                if _ino(dst) != [st.st_dev, st.st_ino]:
                    raise _changed(src, "was replaced")
                fsync_file(dst)
                return hash_fd(fd, st.st_size, algorithm, changed) if algorithm else None
        how, digest = copy_fd(fd, st, dst, algorithm, changed)
        if how == "reflink":
            report.reflinked_bytes += st.st_size
        else:
            report.copied_bytes += st.st_size
        return digest
    finally:
        os.close(fd)


def _extract(zf: zipfile.ZipFile, vfile: VFile, dst: Path, algorithm: str) -> str:
    """Stream one entry out of the archive (bounded memory; CRC checked by zipfile)."""
    assert vfile.source is not None
    hasher = new_hasher(algorithm)
    with zf.open(vfile.source) as src, open(dst, "xb") as out:
        while True:
            chunk = src.read(COPY_CHUNK)
            if not chunk:
                break
            hasher.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    return f"{algorithm}:{hasher.hexdigest()}"


def _swap(prefix: Path, state: dict[str, Any], runner: _Runner | None) -> None:
    """Put the staged tree in place and the old one at the backup name (idempotent)."""
    parent = prefix.parent
    staging = parent / state["staging"]
    backup = parent / state["backup"]
    old, new = state["old"], state["new"]
    if state["kind"] == "archive":
        new_archive = parent / state["new_archive"]
        if _ino(prefix) == old and _ino(backup) is None:
            os.link(prefix, backup)
            fsync_dir(parent)
        if runner:
            runner.step("backup")
        if _ino(prefix) == old and _ino(new_archive) == new:
            os.replace(new_archive, prefix)
            fsync_dir(parent)
        if runner:
            runner.step("swap")
        with contextlib.suppress(OSError):
            remove_tree(staging)
    else:
        from tdckpt._write.atomic import _exchange, rename_noreplace

        if _ino(prefix) == old and _ino(staging) == new:
            if _exchange(staging, prefix):
                fsync_dir(parent)
            else:
                rename_noreplace(prefix, backup)
                fsync_dir(parent)
        if runner:
            runner.step("backup")
        if _ino(staging) == old and _ino(backup) is None:
            rename_noreplace(staging, backup)  # after an exchange
            fsync_dir(parent)
        if _ino(prefix) is None and _ino(staging) == new:
            os.rename(staging, prefix)
            fsync_dir(parent)
        if runner:
            runner.step("swap")
    if _ino(prefix) != new:
        raise MigrationError(
            f"{prefix}: the upgraded tree could not be put in place (journal "
            f"{journal_path(prefix).name} kept); run `tdckpt upgrade` again to finish.",
            script=None,
        )
    state["phase"] = "swapped"
    _write_journal(prefix, state, create=False)
    if not state["keep_backup"]:
        if runner:
            runner.step("remove")
        if _ino(backup) == old:
            remove_tree(backup)
            fsync_dir(parent)
    _remove_journal(prefix)


# -- recovering ------------------------------------------------------------------------------


def recover(prefix: str | os.PathLike[str]) -> str | None:
    """Finish or undo an upgrade of ``prefix`` that was interrupted; describe what was done.

    Reads the journal beside the prefix. Before the staged tree was complete, the staging
    is removed and the old prefix stays. Once it was complete (``staged``), the swap is
    finished: the new tree ends at the prefix and the old one at the backup name. Inodes
    recorded in the journal decide which tree is where, so a re-run after a crash at any
    instant converges. Returns None when there was nothing to recover.
    """
    path = Path(prefix)
    state = read_journal(path)  # refuses a journal tdckpt did not write for this prefix
    if state is None:
        tmp = journal_tmp(path)
        if os.path.lexists(tmp):
            if not stat.S_ISREG(os.lstat(tmp).st_mode):
                raise _refuse(path, f"has a temporary file {tmp.name} that is not a regular file")
            # created but never linked into place: nothing else was done yet
            _remove_journal(path)
            return "an upgrade that had not started writing; its journal was removed"
        return None
    parent = path.parent
    staging = parent / str(state["staging"])
    if state.get("phase") == "staging":
        remove_tree(staging)
        if state.get("new_archive"):
            remove_tree(parent / str(state["new_archive"]))
            left = re.escape(f".{state['new_archive']}.") + r"[0-9a-f]+\.tmp"
            for tmp in parent.glob(f".{glob.escape(state['new_archive'])}.*.tmp"):
                if re.fullmatch(left, tmp.name):  # write_archive's temporary file
                    tmp.unlink(missing_ok=True)
        fsync_dir(parent)
        _remove_journal(path)
        return "an upgrade interrupted while staging: the partial staging was removed"
    try:
        _swap(path, state, None)
    except TdckptError:
        raise
    except OSError as exc:
        raise IncompleteCheckpointError(
            f"{path}: cannot finish the interrupted upgrade recorded in "
            f"{journal_path(path).name} ({exc}). The old tree is at {path} or "
            f"{parent / str(state['backup'])}.",
            path=str(path),
        ) from exc
    return "an upgrade interrupted after staging: the swap was finished"
