"""Carry out an upgrade plan on disk, crash-safely: lock, journal, staging, swap, recovery.

:func:`execute` materializes the migrated tree beside the prefix and swaps it in:

1. a journal ``<prefix>.tdckpt-upgrade.journal`` is created (it is also the lock: one
   upgrade per prefix at a time);
2. the new tree is built in ``<prefix>.tdckpt-upgrade-<id>/``: every ``meta.json`` as the
   plan wrote it, every leaf file **hard-linked** from the old prefix (no byte is copied or
   read; a copy only where a link is impossible, e.g. across devices, and reported), new
   side files written, tdckpt's manifest last; files and directories fsynced;
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

``.tdz`` archives follow the same protocol with files: the entries are streamed out of the
archive into the staging directory and packed by :func:`tdckpt._read.archive.write_archive` into
``<prefix>.tdckpt-upgrade-<id>.tdz``; the old archive is hard-linked to the backup name and
the new one ``os.replace``-d onto the prefix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import uuid
import zipfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tdckpt import schema
from tdckpt._read.storage import Storage
from tdckpt._read.tree import VFile
from tdckpt.errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    LockError,
    MigrationError,
    TdckptError,
)

if TYPE_CHECKING:
    from tdckpt._upgrade.upgrade import Progress, UpgradePlan, UpgradeReport

__all__ = [
    "BACKUP_MARK",
    "JOURNAL_SUFFIX",
    "STAGING_MARK",
    "execute",
    "journal_path",
    "journal_tmp",
    "recover",
    "upgrade_lock",
]

#: ``<prefix><JOURNAL_SUFFIX>``: the journal of an upgrade in progress.
JOURNAL_SUFFIX = ".tdckpt-upgrade.journal"
#: ``<prefix><STAGING_MARK><id>`` (``.tdz``): the tree (archive) being staged.
STAGING_MARK = ".tdckpt-upgrade-"
#: ``<prefix><BACKUP_MARK><UTC time>``: the old tree, kept after the swap.
BACKUP_MARK = ".tdckpt-backup-"
_JOURNAL_VERSION = 1
_COPY_CHUNK = 16 << 20
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
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise LockError(
                f"{prefix}: another tdckpt upgrade is running in {parent}; wait for it to "
                "finish, then run this one again.",
                path=str(prefix),
            ) from exc
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
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
    data = json.dumps(state, indent=1).encode("utf-8")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
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
    _fsync_dir(prefix.parent)


def _read_journal(prefix: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(journal_path(prefix).read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _remove_journal(prefix: Path) -> None:
    journal_path(prefix).unlink(missing_ok=True)
    journal_tmp(prefix).unlink(missing_ok=True)
    _fsync_dir(prefix.parent)


def _fsync_dir(path: Path) -> None:
    from tdckpt._write.atomic import fsync_dir

    fsync_dir(path)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _ino(path: Path) -> list[int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return [st.st_dev, st.st_ino]


def _rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


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
    _write_journal(prefix, state, create=True)
    runner = _Runner(plan, progress)
    try:
        _build_staging(plan, staging, runner)
        if archive:
            from tdckpt._read.archive import write_archive

            write_archive(staging, new_archive, compression="stored", fsync=True)
            runner.step("write")
            state["new"] = _ino(new_archive)
        else:
            state["new"] = _ino(staging)
    except BaseException:
        # Nothing was swapped: the old prefix is untouched. Undo the staging.
        with contextlib.suppress(OSError):
            _rmtree(staging)
            _rmtree(new_archive)
            _remove_journal(prefix)
        raise
    state["phase"] = "staged"
    _write_journal(prefix, state, create=False)
    _swap(prefix, state, runner)
    plan.report.backup = str(backup) if keep_backup else None


def _build_staging(plan: UpgradePlan, staging: Path, runner: _Runner) -> None:
    storage = plan.storage
    archive = storage.kind == "archive"
    staging.mkdir()
    for rel in plan.dirs:
        if rel:
            (staging / rel).mkdir()
    metas = dict(plan.metas)
    files = {rel: vfile for rel, vfile in plan.new_files}
    zf = zipfile.ZipFile(storage.location) if archive else None
    try:
        for op in plan.report.operations:
            if op.kind == "write-meta":
                _write_file(staging / op.path, metas[op.path])
                runner.step("write-meta")
            elif op.kind in ("link", "write") and op.path in files:
                vfile = files[op.path]
                dst = staging / op.path
                if vfile.data is not None:
                    _write_file(dst, vfile.data)
                elif zf is not None:
                    _extract(zf, vfile, dst)
                else:
                    _link(storage, vfile, dst, plan.report)
                runner.step(op.kind)
            elif op.kind == "write" and op.path == schema.MANIFEST_NAME:
                _write_file(staging / schema.MANIFEST_NAME, plan.manifest)
                runner.step("write")
                break
    finally:
        if zf is not None:
            zf.close()
    for rel in reversed(plan.dirs):  # children before parents
        _fsync_dir(staging / rel if rel else staging)
    _fsync_dir(staging.parent)


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _link(storage: Storage, vfile: VFile, dst: Path, report: UpgradeReport) -> None:
    assert vfile.source is not None
    src = storage.physical_path(vfile.source)
    assert src is not None
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
        shutil.copyfile(src, dst)
        report.copied.append(f"{vfile.source}: {os.strerror(exc.errno or 0)}; copied instead")
    _fsync_file(dst)


def _extract(zf: zipfile.ZipFile, vfile: VFile, dst: Path) -> None:
    """Stream one entry out of the archive (bounded memory; CRC checked by zipfile)."""
    assert vfile.source is not None
    with zf.open(vfile.source) as src, open(dst, "xb") as out:
        while True:
            chunk = src.read(_COPY_CHUNK)
            if not chunk:
                break
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())


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
            _fsync_dir(parent)
        if runner:
            runner.step("backup")
        if _ino(prefix) == old and _ino(new_archive) == new:
            os.replace(new_archive, prefix)
            _fsync_dir(parent)
        if runner:
            runner.step("swap")
        with contextlib.suppress(OSError):
            _rmtree(staging)
    else:
        from tdckpt._write.atomic import _exchange, rename_noreplace

        if _ino(prefix) == old and _ino(staging) == new:
            if _exchange(staging, prefix):
                _fsync_dir(parent)
            else:
                rename_noreplace(prefix, backup)
                _fsync_dir(parent)
        if runner:
            runner.step("backup")
        if _ino(staging) == old and _ino(backup) is None:
            rename_noreplace(staging, backup)  # after an exchange
            _fsync_dir(parent)
        if _ino(prefix) is None and _ino(staging) == new:
            os.rename(staging, prefix)
            _fsync_dir(parent)
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
            _rmtree(backup)
            _fsync_dir(parent)
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
    state = _read_journal(path)
    if state is None:
        if journal_path(path).exists() or journal_tmp(path).exists():
            # created but never completed: nothing else was done yet
            _remove_journal(path)
            return "an upgrade that had not started writing; its journal was removed"
        return None
    if state.get("version") != _JOURNAL_VERSION or state.get("prefix") != path.name:
        raise IncompleteCheckpointError(
            f"{journal_path(path)}: an upgrade journal tdckpt cannot read (version "
            f"{state.get('version')!r}); inspect it and remove it by hand.",
            path=str(path),
        )
    parent = path.parent
    staging = parent / str(state["staging"])
    if state.get("phase") == "staging":
        _rmtree(staging)
        if state.get("new_archive"):
            _rmtree(parent / str(state["new_archive"]))
            for tmp in parent.glob(f".{state['new_archive']}.*.tmp"):
                tmp.unlink(missing_ok=True)
        _fsync_dir(parent)
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
