"""The step store of a local root: ``<root>/<step>/`` folders and ``<root>/<step>.tdz`` archives.

Commit vocabulary on a file system (see :mod:`tdckpt._write.atomic`): an attempt is the
staging folder ``<root>/<step>.tmp-<uuid>/``; commit is one rename to ``<root>/<step>``
(``renameat2(RENAME_EXCHANGE)`` for an overwrite, where offered) or, for an archive, the
archive writer's temp-file-then-``os.replace``; retiring renames a step to a temporary name
(unlisted at once) before its tree is removed; gc removes temporary names, and renames back
a step an interrupted overwrite had set aside. Exclusive writing: the root's flock
(:class:`tdckpt._write.lock.RootLock`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tdckpt._manage import background as _background
from tdckpt._manage.steps import StepIndex, StepStatus, preferred
from tdckpt._manage.verify import Progress, VerifyReport, manifest_problem, verify_files
from tdckpt._shard.check import shard_problems
from tdckpt._shard.inspect import shard_summary
from tdckpt._store.base import Attempt, Capabilities, StepRecord
from tdckpt._write import atomic as _atomic
from tdckpt._write.incremental import (
    IncrementalBase,
    IncrementalSave,
    shared_bytes,
    unshare_for_write,
)
from tdckpt._write.lock import RootLock
from tdckpt._write.save import write_checkpoint
from tdckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    LockError,
    MetadataError,
)
from tdckpt.schema import MANIFEST_NAME, ShardedManifest, StateRecord
from tdckpt.warnings import TdckptWarning

__all__ = ["LocalStepStore"]

#: Scans of a root that lists no committed step before believing it (see records).
_EMPTY_RESCANS = 3


class LocalStepStore:
    """The steps of one local folder (see the module docstring).

    Args:
        root: the folder (created on the first write).
        state: the manager's lock guarding the manifest cache and the lock object.
        manager_id: written into the lock file (who holds the root).
        archive: write each step as one ``.tdz`` archive.
        fsync: make every write durable before it is committed.
        checksum, compression, layout: how steps are written (see the manager).
    """

    def __init__(
        self,
        root: Path,
        *,
        state: threading.RLock,
        manager_id: str,
        archive: bool,
        fsync: bool,
        checksum: str,
        compression: str,
        layout: str,
    ) -> None:
        self.root: Path = root
        self.archive = archive
        self.fsync = fsync
        self.checksum = checksum
        self.compression = compression
        self.layout = layout
        self.capabilities = Capabilities(
            atomic_rename=True,
            file_backed=True,
            collective=True,
            verifies_reads=False,
            archives=True,
        )
        self._state = state
        self._id = manager_id
        self._index = StepIndex(root, state)  # the manifests of the entries, cached
        self.root_lock: RootLock | None = None

    # -- listing ---------------------------------------------------------------------------
    def entries(self) -> dict[int, dict[str, Path]]:
        """Every step-named entry of the root, committed or not: step -> kind -> path."""
        out: dict[int, dict[str, Path]] = {}
        try:
            scan = os.scandir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return out
        with scan:
            for entry in scan:
                parsed = _atomic.parse_step_name(entry.name)
                if parsed is None:
                    continue
                step, kind = parsed
                try:
                    ok = (
                        entry.is_dir(follow_symlinks=False)
                        if kind == "dir"
                        else entry.is_file(follow_symlinks=False)
                    )
                except OSError:
                    ok = False
                if ok:
                    out.setdefault(step, {})[kind] = Path(entry.path)
        return out

    def records(self) -> dict[int, StepRecord]:
        """Committed steps: step-named entries holding a valid manifest (of a step that is
        both a folder and an archive, the newer: :func:`_newest`)."""
        out = self._records_once()
        for _ in range(_EMPTY_RESCANS):
            if out or not self.root.is_dir():
                break
            # A listing is not atomic: a writer in another process that commits a step
            # and retires the previous one meanwhile can hide both from one scan. A root
            # that holds steps is never empty for long, so look again before saying so.
            out = self._records_once()
        return out

    def _records_once(self) -> dict[int, StepRecord]:
        return {
            step: _newest(valid, archive=self.archive)
            for step, valid in self._committed_forms().items()
        }

    def _committed_forms(self) -> dict[int, dict[str, StepRecord]]:
        """step -> kind -> record of every step-named entry holding a valid manifest."""
        out: dict[int, dict[str, StepRecord]] = {}
        for step, forms in self.entries().items():
            for kind, path in forms.items():
                try:
                    record = StepRecord(step, path, self._index.manifest(path, kind))
                except MetadataError:
                    continue
                out.setdefault(step, {})[kind] = record
        return out

    def resolve(self, step: int | None) -> StepRecord:
        records = self.records()
        if step is None:
            if not records:
                raise CheckpointNotFoundError(
                    f"{self.root}: no committed checkpoint yet; save one first (or check the "
                    "root path).",
                    path=str(self.root),
                )
            step = max(records)
        step = _atomic.check_step(step)
        if step in records:
            return records[step]
        unreadable = self._unreadable(step)
        if unreadable is not None:
            path, exc = unreadable
            raise IncompleteCheckpointError(
                f"{path}: step {step} is not a committed tdckpt checkpoint: "
                f"{exc.message} Restore or verify another step (see steps()).",
                path=str(path),
                step=step,
            ) from exc
        raise self._not_found(step)

    def damaged(self, step: int) -> VerifyReport | None:
        unreadable = self._unreadable(step)
        if unreadable is None:
            return None
        path, exc = unreadable
        return manifest_problem(step, path, exc.message)

    def _unreadable(self, step: int) -> tuple[Path, MetadataError] | None:
        """The entry of ``step`` (:func:`preferred`) and why its manifest cannot be read, or
        None when it can; CheckpointNotFoundError when nothing in the root is named ``step``."""
        forms = self.forms(step)
        if not forms:
            raise self._not_found(step)
        path = preferred(forms, archive=self.archive)
        kind = "archive" if path.name.endswith(_atomic.ARCHIVE_SUFFIX) else "dir"
        try:
            self._index.manifest(path, kind)
        except MetadataError as exc:
            return path, exc
        return None

    def _not_found(self, step: int) -> CheckpointNotFoundError:
        """The error for a step that is not committed, listing the latest committed ones."""
        steps = sorted(self.records())
        shown = ", ".join(map(str, steps[-10:])) if steps else "none"
        return CheckpointNotFoundError(
            f"{self.root}: no committed step {step} (committed steps: {shown}). Pick one of "
            "steps(), or None for the latest.",
            path=str(self.root),
            step=step,
        )

    def statuses(self) -> list[StepStatus]:
        rows: list[StepStatus] = []
        for step, forms in sorted(self.entries().items()):
            for kind, path in sorted(forms.items()):
                try:
                    manifest = self._index.manifest(path, kind)
                except MetadataError as exc:
                    rows.append(StepStatus(step, path, kind, "damaged", detail=str(exc)))
                    continue
                rows.append(
                    StepStatus(
                        step,
                        path,
                        "sharded" if isinstance(manifest, ShardedManifest) else kind,
                        "committed",
                        size=sum(f.size for f in manifest.files),
                        format_version=manifest.format_version,
                        key_encoding=manifest.key_encoding,
                        created=manifest.created,
                        metadata=copy.deepcopy(manifest.user_metadata),
                        detail=shard_summary(manifest)
                        if isinstance(manifest, ShardedManifest)
                        else None,
                    )
                )
        if self.root.is_dir():
            for name in sorted(os.listdir(self.root)):
                if _atomic.is_tmp_name(name):
                    rows.append(
                        StepStatus(_atomic.tmp_step(name), self.root / name, "tmp", "incomplete")
                    )
        return rows

    def exists(self) -> bool:
        return self.root.is_dir()

    def forms(self, step: int) -> dict[str, Path]:
        """The step-named entries of ``step`` (committed or not): kind -> path."""
        return self.entries().get(step, {})

    # -- exclusive writing -----------------------------------------------------------------
    def lock(self) -> None:
        with self._state:
            lock = self.root_lock
            if lock is not None and not lock.held:
                self.root_lock = lock = None  # a forked child let go of its parent's lock
            if lock is not None and not lock.still_ours():
                # The lock file was removed or replaced under us: another writer may hold
                # a new one. Let go of ours (never touching the new file) and take the
                # lock again, which refuses if that other writer is alive.
                lock._forget()
                self.root_lock = None
            if self.root_lock is None:
                self._check_root()
                if not self.root.is_dir():
                    try:
                        self.root.mkdir(parents=True, exist_ok=True)
                    except OSError as exc:  # a file in the way, a read-only parent
                        raise LockError(
                            f"{self.root}: cannot create the checkpoint root "
                            f"({exc.strerror}: {exc.filename}). Pass a directory, or a path "
                            "whose parent this process can write.",
                            root=str(self.root),
                            path=str(self.root),
                        ) from exc
                    if self.fsync:  # the root's own name must survive a crash too
                        _atomic.fsync_dir(self.root.parent)
                new = RootLock(self.root, manager_id=self._id, fsync=self.fsync)
                # warning -> acquire <- lock <- StepSaver.lock_root <- save/gc <- the user's line
                new.acquire(stacklevel=4)
                self.root_lock = new

    def unlock(self) -> None:
        with self._state:
            if self.root_lock is not None:
                self.root_lock.release()
                self.root_lock = None

    def _check_root(self) -> None:
        """Refuse a root that is, or lies inside, a checkpoint: saving there changes it."""
        markers = ("meta.json", "meta.pt", MANIFEST_NAME)
        for where in (self.root, *self.root.absolute().parents):
            inside = [m for m in markers if os.path.lexists(where / m)]
            if inside and (where == self.root or MANIFEST_NAME in inside):
                raise LockError(
                    f"{self.root}: {'is' if where == self.root else 'lies inside'} a "
                    f"checkpoint ({where / inside[0]} exists); a manager saving here would "
                    "change that checkpoint. Pass a separate folder as the root.",
                    root=str(self.root),
                    path=str(where / inside[0]),
                )

    # -- writing ---------------------------------------------------------------------------
    def existing(self, step: int) -> bool:
        return bool(self.forms(step))

    def exists_error(self, step: int) -> CheckpointExistsError:
        where = preferred(self.forms(step) or {"dir": self._final(step)}, archive=self.archive)
        return CheckpointExistsError(
            f"{where}: step {step} already exists; a committed step is never overwritten "
            "unless asked. Pass overwrite=True to replace it, or save under another step.",
            path=str(where),
            step=step,
        )

    def commit_point(self, step: int) -> Path:
        return self._final(step)

    def _final(self, step: int) -> Path:
        name = _atomic.step_archive_name(step) if self.archive else _atomic.step_name(step)
        return self.root / name

    def begin(self, step: int, *, overwrite: bool) -> Attempt:
        final = self._final(step)
        if not overwrite and os.path.lexists(final):
            _atomic.raise_exists(final)
        return Attempt(step, _atomic.staging_dir(self.root, step), overwrite)

    def write(
        self,
        attempt: Attempt,
        obj: Any,
        *,
        metadata: dict[str, Any] | None,
        state: StateRecord | None,
        progress: Progress | None,
        incremental: bool = False,
    ) -> None:
        options: dict[str, Any] = {}
        if self.layout == "consolidated":
            from tdckpt._write.consolidated_write import write_consolidated as writer
        else:  # an archive's staging folder is read back at once: no O_DIRECT for it
            writer, options = write_checkpoint, {"progress": progress, "direct": not self.archive}
            if incremental:  # unchanged leaves linked from the latest committed step
                options["incremental"] = self._incremental_save()
        writer(
            obj,
            Path(attempt.where),
            step=attempt.step,
            user_metadata=metadata,
            fsync=self.fsync,
            checksum=self.checksum,
            state=state,
            **options,
        )

    def _incremental_save(self) -> IncrementalSave:
        """An incremental save against the latest committed step (under the writer lock)."""
        records = self.records()
        if not records:
            return IncrementalSave(base=None)
        latest = records[max(records)]
        return IncrementalSave(
            base=IncrementalBase.of_step(
                latest.step, Path(latest.where), latest.manifest, self.checksum
            )
        )

    def commit(self, attempt: Attempt, *, stacklevel: int) -> Path:
        """Rename the staging folder in (or pack the archive); then, for an overwrite that
        changed form (folder <-> archive), retire the other form. ``stacklevel``: of the
        warning about a tree that could not be removed, counted from this method."""
        step, staging = attempt.step, Path(attempt.where)
        final = self._final(step)
        try:
            if self.archive:
                from tdckpt._write.archive_write import write_archive

                if not attempt.overwrite and os.path.lexists(final):  # writing took a while
                    _atomic.raise_exists(final)
                write_archive(staging, final, compression=self.compression, fsync=self.fsync)
                _atomic.remove_tree(staging, ignore_errors=True)
            elif attempt.overwrite and os.path.lexists(final):
                _atomic.replace_step(self.root, step, staging, final, fsync=self.fsync)
            else:
                _atomic.rename_noreplace(staging, final)
                if self.fsync:
                    _atomic.fsync_dir(self.root)
        except BaseException:
            self.abort(attempt)
            raise
        if attempt.overwrite:
            other = "dir" if self.archive else "archive"
            stale = self.forms(step).get(other)
            if stale is not None:
                self.remove(self._retire_paths([(step, stale)]), stacklevel=stacklevel + 1)
        return final

    def abort(self, attempt: Attempt) -> None:
        # Never leave a half-written staging folder behind on an ordinary error; a crash
        # leaves it for gc.
        _atomic.remove_tree(attempt.where, ignore_errors=True)

    # -- deleting --------------------------------------------------------------------------
    def retire(self, records: list[StepRecord]) -> list[tuple[Path, Path]]:
        """Rename every form of each step aside (folder and archive)."""
        entries = self.entries()
        return self._retire_paths(
            [(r.step, path) for r in records for path in entries.get(r.step, {}).values()]
        )

    def _retire_paths(self, doomed: list[tuple[int, Path]]) -> list[tuple[Path, Path]]:
        """``(former path, temporary path)`` pairs; once this returns the steps are no
        longer listed, whatever happens to the removal that follows."""
        retired = []
        with self._state:
            for step, path in doomed:
                retired.append((path, _atomic.retire(self.root, path, step)))
        if retired and self.fsync:
            _atomic.fsync_dir(self.root)
        return retired

    def remove(self, retired: list[Any], *, stacklevel: int) -> list[Path | str]:
        # Runs after a save committed: a tree this process cannot delete (a read-only
        # sub-folder, another user's file) is left for gc with a warning, not an error that
        # would make the committed save look failed. The step is no longer listed either way.
        for _, aside in retired:
            try:
                _atomic.remove_retired(aside)
            except OSError as exc:
                _warn_not_removed(aside, exc, stacklevel=stacklevel + 1)
        return [path for path, _ in retired]

    def gc(self, grace_period: float | None, *, stacklevel: int) -> list[Path | str]:
        """Remove every temporary entry older than ``grace_period`` (None: all of them);
        rename back a step an interrupted overwrite had set aside; remove the older form of
        a step committed both as a folder and as an archive (an overwrite that changed the
        form, interrupted before it removed the old one: every reader reads the newer)."""
        removed: list[Path | str] = []
        now = time.time()
        older = [
            (step, Path(record.where))
            for step, valid in self._committed_forms().items()
            if len(valid) > 1
            for record in valid.values()
            if record is not _newest(valid, archive=self.archive)
        ]  # (only valid forms: a form whose manifest cannot be read is never removed)
        if older:
            removed += self.remove(self._retire_paths(older), stacklevel=stacklevel + 1)
        for name in sorted(os.listdir(self.root)):
            if _atomic.is_tmp_name(name) and _older(self.root / name, now, grace_period):
                try:
                    gone = _atomic.recover_or_remove(self.root, name, fsync=self.fsync)
                except OSError as exc:
                    _warn_not_removed(self.root / name, exc, stacklevel=stacklevel + 1)
                    continue
                if gone is not None:
                    removed.append(gone)
        if removed and self.fsync:
            _atomic.fsync_dir(self.root)
        return removed

    def shared_bytes(self) -> dict[int, int]:
        """Hard links are counted by the file system: bytes of inodes another step names."""
        records = self.records()
        shared = shared_bytes((step, Path(r.where)) for step, r in records.items())
        return {step: shared.get(step, 0) for step in records}

    # -- reading ---------------------------------------------------------------------------
    def open(self, record: StepRecord, *, writes: bool = False) -> Any:
        if writes:  # mapped shared and writable: this step's linked files get private copies
            unshare_for_write(Path(record.where), record.manifest, fsync=self.fsync)
        return contextlib.nullcontext(Path(record.where))  # read where it lies

    def verify(
        self, record: StepRecord, progress: Progress | None, *, shared: dict[Any, Any] | None = None
    ) -> VerifyReport:
        """Every file against the manifest; for a sharded step also the manifest against
        its shards (:func:`tdckpt._shard.check.shard_problems`)."""
        where = Path(record.where)
        report = verify_files(record.step, where, record.manifest, progress, shared=shared)
        if isinstance(record.manifest, ShardedManifest):
            report.problems += shard_problems(where, record.manifest)
        return report


def _newest(forms: dict[str, StepRecord], *, archive: bool) -> StepRecord:
    """The record of a step's valid forms to read: its only one, or, of a step committed
    both as a folder and as an archive (an overwrite that changed the form, interrupted
    before it removed the old one), the one saved last - the same for every reader,
    whatever form its manager writes; the manager's own form on a tie."""
    if len(forms) == 1:
        return next(iter(forms.values()))

    def created(record: StepRecord) -> float:
        try:
            return datetime.fromisoformat(record.manifest.created).timestamp()
        except (TypeError, ValueError):
            return float("-inf")

    ranked = sorted(forms.values(), key=created)
    if created(ranked[-1]) > created(ranked[0]):
        return ranked[-1]
    return preferred(forms, archive=archive)  # type: ignore[no-any-return]


def _older(path: Path, now: float, grace_period: float | None) -> bool:
    """Whether ``path`` was last changed more than ``grace_period`` seconds ago (None: yes)."""
    if grace_period is None:
        return True
    try:
        return now - os.lstat(path).st_mtime >= grace_period
    except OSError:
        return True  # gone, or unreadable: recover_or_remove says what happens


def _warn_not_removed(path: Path, exc: OSError, *, stacklevel: int) -> None:
    where = f": {exc.filename}" if exc.filename and str(exc.filename) != str(path) else ""
    # On save_async's background thread the warning is kept, and issued on the caller's
    # thread when the save's outcome is delivered.
    _background.warn(
        f"{path}: could not be removed ({exc.strerror}{where}); it is left behind and no "
        "longer listed as a step. Make it writable (e.g. chmod -R u+w) and run gc() or "
        "`tdckpt gc` again.",
        TdckptWarning,
        stacklevel=stacklevel,
    )
