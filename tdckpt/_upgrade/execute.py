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
import os
import re
import stat
import uuid
import zipfile
from pathlib import Path
from typing import Any

from tdckpt import schema
from tdckpt._read.storage import Storage
from tdckpt._read.tree import VFile
from tdckpt._report import Problem
from tdckpt._upgrade.journal import (
    JOURNAL_VERSION,
    STAGING_MARK,
    backup_name,
    ino_of,
    journal_path,
    journal_tmp,
    read_journal,
    refuse,
    remove_journal,
    write_journal,
)
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
)
from tdckpt._write.writer import write_small
from tdckpt.errors import (
    IncompleteCheckpointError,
    MigrationError,
    TdckptError,
)

__all__ = ["execute", "recover", "write_error"]

#: errno values for which a hard link is impossible and a copy is made instead.
_NO_LINK = frozenset(
    {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES}
)


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
    backup = backup_name(prefix)
    state: dict[str, Any] = {
        "version": JOURNAL_VERSION,
        "kind": "archive" if archive else "directory",
        "prefix": prefix.name,
        "staging": staging.name,
        "new_archive": new_archive.name if archive else None,
        "backup": backup.name,
        "keep_backup": keep_backup,
        "phase": "staging",
        "old": ino_of(prefix),
        "new": None,
    }
    try:
        write_journal(prefix, state, create=True)
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
            state["new"] = ino_of(new_archive)
        else:
            state["new"] = ino_of(staging)
    except BaseException as exc:
        # Nothing was swapped: the old prefix is untouched. Undo the staging.
        for leftover in (staging, new_archive):
            with contextlib.suppress(OSError):
                remove_tree(leftover)
        with contextlib.suppress(OSError):
            remove_journal(prefix)
        if isinstance(exc, OSError):
            raise write_error(prefix, exc, plan.copy_bytes) from exc
        raise
    try:
        state["phase"] = "staged"
        write_journal(prefix, state, create=False)
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
                write_small(staging / op.path, metas[op.path], fsync=True)
                runner.step("write-meta")
            elif op.kind in ("link", "copy", "write") and op.path in files:
                vfile = files[op.path]
                dst = staging / op.path
                if vfile.data is not None:
                    write_small(dst, vfile.data, fsync=True)
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
                write_small(staging / schema.MANIFEST_NAME, plan.manifest_bytes(sums), fsync=True)
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
                if ino_of(dst) != [st.st_dev, st.st_ino]:
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
        if ino_of(prefix) == old and ino_of(backup) is None:
            os.link(prefix, backup)
            fsync_dir(parent)
        if runner:
            runner.step("backup")
        if ino_of(prefix) == old and ino_of(new_archive) == new:
            os.replace(new_archive, prefix)
            fsync_dir(parent)
        if runner:
            runner.step("swap")
        with contextlib.suppress(OSError):
            remove_tree(staging)
    else:
        from tdckpt._write.atomic import _exchange, rename_noreplace

        if ino_of(prefix) == old and ino_of(staging) == new:
            if _exchange(staging, prefix):
                fsync_dir(parent)
            else:
                rename_noreplace(prefix, backup)
                fsync_dir(parent)
        if runner:
            runner.step("backup")
        if ino_of(staging) == old and ino_of(backup) is None:
            rename_noreplace(staging, backup)  # after an exchange
            fsync_dir(parent)
        if ino_of(prefix) is None and ino_of(staging) == new:
            os.rename(staging, prefix)
            fsync_dir(parent)
        if runner:
            runner.step("swap")
    if ino_of(prefix) != new:
        raise MigrationError(
            f"{prefix}: the upgraded tree could not be put in place (journal "
            f"{journal_path(prefix).name} kept); run `tdckpt upgrade` again to finish.",
            script=None,
        )
    state["phase"] = "swapped"
    write_journal(prefix, state, create=False)
    if not state["keep_backup"]:
        if runner:
            runner.step("remove")
        if ino_of(backup) == old:
            remove_tree(backup)
            fsync_dir(parent)
    remove_journal(prefix)


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
                raise refuse(
                    path,
                    f"has a temporary file {tmp.name} that is not a regular file",
                    culprit=tmp,
                )
            # created but never linked into place: nothing else was done yet
            remove_journal(path)
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
        remove_journal(path)
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
