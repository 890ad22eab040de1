"""``CheckpointManager``: numbered, atomic, verifiable checkpoints of a TensorDict in one root.

A root holds one entry per committed step - ``<root>/<step>/`` (or ``<root>/<step>.tdz``)
in tensordict 0.15.3's format plus ``tdckpt.manifest.json`` - and nothing else that the
manager lists. Every entry is committed by one atomic rename after its files, directories
and manifest are durable (:mod:`tdckpt._write.atomic`), so a process killed at any instant leaves
every committed step intact; what it leaves half-written is a ``*.tmp-*`` name that is
never listed and that :meth:`CheckpointManager.gc` removes.

The manager decides what is saved, restored and deleted, and when; it finds the root's
steps and reads their manifests through :mod:`tdckpt._manage.steps`, and re-reads a step against
its manifest through :mod:`tdckpt._manage.verify`.

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from tdckpt.manager import CheckpointManager
    >>> from tdckpt.retention import KeepLast
    >>> td = TensorDict(w=torch.zeros(3))
    >>> with tempfile.TemporaryDirectory() as root:
    ...     with CheckpointManager(root, retention=KeepLast(2)) as mgr:
    ...         for step in (10, 20, 30):
    ...             _ = mgr.save(step, td, metadata={"loss": 1 / step})
    ...         mgr.steps(), mgr.best_step("loss"), mgr.verify().ok
    ([20, 30], 30, True)
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tdckpt._manage.steps import StepIndex, StepStatus, preferred
from tdckpt._manage.verify import (
    Progress,
    VerifyProblem,
    VerifyReport,
    manifest_problem,
    verify_files,
)
from tdckpt._remote.urls import is_url, require_local_options
from tdckpt._write import atomic as _atomic
from tdckpt._write.checksum import DEFAULT_CHECKSUM, new_hasher
from tdckpt._write.lock import RootLock
from tdckpt._write.save import check_json_data, write_checkpoint
from tdckpt.errors import (
    CheckpointExistsError,
    IntegrityError,
    LockError,
    MetadataError,
    RestoreError,
)
from tdckpt.retention import KeepAll, RetentionPolicy, StepInfo, metric_value
from tdckpt.schema import MANIFEST_NAME, Manifest
from tdckpt.warnings import TdckptWarning

if TYPE_CHECKING:
    from tdckpt._read.pipeline import OpenedCheckpoint

__all__ = ["CheckpointManager", "StepStatus", "VerifyProblem", "VerifyReport"]


class CheckpointManager:
    """Save, list, verify, restore and prune the numbered checkpoints of one root folder.

    Writing (:meth:`save`, retention, :meth:`gc`) takes the root's single-writer lock
    (``<root>/.tdckpt.lock``) on first use and holds it until :meth:`close`: a second
    writer - another manager, in this process or another - gets a
    :class:`~tdckpt.errors.LockError`. Reading (:meth:`steps`, :meth:`metadata`,
    :meth:`verify`, :meth:`restore`, ...) never takes it, so any number of readers can
    watch a root while one process trains.

    Args:
        root: the folder holding the steps (created on the first save).
        retention: which steps to keep after each save (default: all). The newest
            committed step, the step just saved and any step being restored or verified
            through this manager are never deleted.
        archive: save each step as one ``<step>.tdz`` archive instead of a folder.
        fsync: make every save durable before it is committed (off only for throw-away
            runs: a power loss may then leave a listed step with missing bytes).
        checksum: the checksum algorithm of new saves: ``"crc32"`` (default, fast) or a
            hashlib algorithm such as ``"sha256"`` (slower; resists deliberate tampering).
        compression: for archives, ``"stored"`` (mappable without copies) or ``"deflate"``.
        storage_options: for an fsspec URL root (``s3://bucket/run``, ``memory://x``), the
            filesystem's options (credentials, ``client_kwargs``...). A URL root is kept in
            object storage (``pip install 'tdckpt[remote]'``; see the remote guide and
            :class:`tdckpt._remote.manager.RemoteCheckpointManager`).

    Example:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict(w=torch.arange(3.0))
        >>> with tempfile.TemporaryDirectory() as root:
        ...     with CheckpointManager(root) as mgr:
        ...         _ = mgr.save(100, td, metadata={"loss": 0.5})
        ...         restored = mgr.restore()
        ...         restored["w"].tolist(), mgr.metadata(100)
        ([0.0, 1.0, 2.0], {'loss': 0.5})
    """

    def __new__(cls, root: str | os.PathLike[str], *args: Any, **kwargs: Any) -> CheckpointManager:
        # An fsspec URL (s3://, memory://, file://, ...) gets the object-storage manager.
        if cls is CheckpointManager and is_url(root):
            from tdckpt._remote.manager import RemoteCheckpointManager

            return super().__new__(RemoteCheckpointManager)
        return super().__new__(cls)

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        retention: RetentionPolicy | None = None,
        archive: bool = False,
        fsync: bool = True,
        checksum: str = DEFAULT_CHECKSUM,
        compression: str = "stored",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        require_local_options(root, storage_options)
        self.root = Path(root)
        self.retention: RetentionPolicy = KeepAll() if retention is None else retention
        if not callable(getattr(self.retention, "select_to_keep", None)):
            raise TypeError(
                f"retention must be a retention policy (an object with select_to_keep), got "
                f"{retention!r}; see tdckpt.retention."
            )
        self.archive = bool(archive)
        self.fsync = bool(fsync)
        new_hasher(checksum)  # refuse an unknown algorithm now, not at the first save
        self.checksum = checksum
        if compression not in ("stored", "deflate"):
            raise ValueError(f"compression must be 'stored' or 'deflate', got {compression!r}")
        self.compression = compression
        self.id = uuid.uuid4().hex
        self._lock: RootLock | None = None
        # _state guards the lock object, the in-use counts and the manifest cache, and is
        # held while retention renames steps away, so a restore cannot pick a step that is
        # being deleted, nor retention delete a step a restore has picked.
        self._state = threading.RLock()
        # Signalled when an overwrite ends: a restore of that step waits for it rather than
        # read a folder that is being swapped.
        self._swapped = threading.Condition(self._state)
        self._overwriting: set[int] = set()
        # One write (save, retention, gc) at a time within this process.
        self._writing = threading.Lock()
        self._in_use: Counter[int] = Counter()
        self._index = StepIndex(self.root, self._state)

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({str(self.root)!r}, retention={self.retention!r}, "
            f"archive={self.archive}, fsync={self.fsync})"
        )

    # -- life cycle ------------------------------------------------------------------------
    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the writer lock (if taken). Reading still works; a later write re-locks.

        Waits for a save, retention or gc running in another thread to finish first, so
        the lock is never released in the middle of a write.
        """
        with self._writing, self._state:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _ensure_lock(self) -> None:
        with self._state:
            if self._lock is not None and not self._lock.held:
                self._lock = None  # a forked child let go of its parent's lock
            if self._lock is not None and not self._lock.still_ours():
                # The lock file was removed or replaced under us: another writer may hold
                # a new one. Let go of ours (never touching the new file) and take the
                # lock again, which refuses if that other writer is alive.
                self._lock._forget()
                self._lock = None
            if self._lock is None:
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
                lock = RootLock(self.root, manager_id=self.id, fsync=self.fsync)
                # warning -> acquire <- _ensure_lock <- save/gc <- the user's line
                lock.acquire(stacklevel=3)
                self._lock = lock

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

    # -- listing ---------------------------------------------------------------------------
    def _preferred(self, forms: dict[str, Any]) -> Any:
        return preferred(forms, archive=self.archive)

    def steps(self) -> list[int]:
        """The committed steps, in increasing order (never a ``*.tmp-*`` or foreign entry)."""
        return sorted(self._index.committed())

    def latest_step(self) -> int | None:
        """The highest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def _resolve(self, step: int | None) -> tuple[int, Path, Manifest]:
        return self._index.resolve(step, archive=self.archive)

    def path(self, step: int) -> Path:
        """The folder (or ``.tdz`` archive) of a committed step."""
        return self._resolve(_atomic.check_step(step))[1]

    def metadata(self, step: int) -> dict[str, Any]:
        """The user metadata saved with a committed step (a copy)."""
        return copy.deepcopy(self._resolve(_atomic.check_step(step))[2].user_metadata)

    def best_step(self, key: str, mode: Literal["min", "max"] = "min") -> int | None:
        """The committed step with the lowest (``"min"``) or highest (``"max"``) metadata value.

        Steps whose metadata lack ``key`` (or hold a non-number or NaN there) are ignored;
        ties go to the newer step. None when no step has the key.
        """
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        best: tuple[float, int] | None = None
        for step, forms in sorted(self._index.committed().items()):
            value = metric_value(self._preferred(forms)[1].user_metadata, key)
            if value is None:
                continue
            score = (value if mode == "min" else -value, -step)
            if best is None or score < best:
                best = score
        return None if best is None else -best[1]

    def step_infos(self) -> list[StepInfo]:
        """What retention policies see: every committed step with its metadata, oldest first."""
        infos = []
        for step, forms in sorted(self._index.committed().items()):
            path, manifest = self._preferred(forms)
            infos.append(
                StepInfo(
                    step=step,
                    path=path,
                    metadata=copy.deepcopy(manifest.user_metadata),
                    created=manifest.created,
                )
            )
        return infos

    def list_steps(self) -> list[StepStatus]:
        """Every step-like entry of the root with its status, for ``tdckpt ls``.

        Committed steps (a valid manifest), damaged ones (a step-named entry whose
        manifest cannot be read: never restored, never listed by :meth:`steps`), and the
        leftovers of crashed saves (``*.tmp-*``: ``incomplete``, removed by :meth:`gc`).
        """
        return self._index.statuses()

    @contextlib.contextmanager
    def _using(self, step: int | None) -> Iterator[tuple[int, Path, Manifest]]:
        """Pick a committed step and protect it from retention until the block ends."""
        with self._state:
            resolved = self._resolve(step)
            while resolved[0] in self._overwriting:
                self._swapped.wait()
                resolved = self._resolve(step)
            self._in_use[resolved[0]] += 1
        try:
            yield resolved
        finally:
            with self._state:
                self._in_use[resolved[0]] -= 1
                if self._in_use[resolved[0]] <= 0:
                    del self._in_use[resolved[0]]

    # -- saving ----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        obj: Any,
        *,
        metadata: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> Path:
        """Save ``obj`` as ``step``: all or nothing on disk, then apply the retention policy.

        ``obj`` (a TensorDict, lazy stack, tensorclass or non-tensor data) is written in
        tensordict 0.15.3's format into a staging folder beside the root's steps, made
        durable, and committed by one rename; it is never modified. Retention runs only
        after the commit.

        Args:
            step: the step number (an int >= 0); it names the folder.
            obj: what to save.
            metadata: plain JSON data stored in the manifest (see :meth:`metadata`,
                :meth:`best_step`, :class:`~tdckpt.retention.KeepBest`).
            overwrite: replace an existing step (atomically) instead of refusing.

        Returns:
            The committed folder (or archive).

        Raises:
            CheckpointExistsError: the step exists and ``overwrite`` is False, or it is
                being restored right now.
            LockError: another writer holds the root.
            tdckpt.errors.UnsupportedContentError: ``obj`` holds what the format cannot
                store (every such key is listed); nothing was written.
            MetadataError: ``metadata`` is not plain JSON data.
        """
        step = _atomic.check_step(step)
        if metadata is not None:
            check_json_data(metadata)  # before taking the lock or creating anything
        with self._writing:
            self._ensure_lock()
            forms = self._index.entries().get(step, {})
            if forms and not overwrite:
                raise CheckpointExistsError(
                    f"{self._preferred(forms)}: step {step} already exists; a committed step "
                    "is never overwritten unless asked. Pass overwrite=True to replace it, "
                    "or save under another step.",
                    path=str(self._preferred(forms)),
                    step=step,
                )

            if forms:
                with self._state:
                    if self._in_use.get(step):
                        raise CheckpointExistsError(
                            f"{self.root}: step {step} is being restored or verified right "
                            "now; it cannot be overwritten until that finishes. Save under "
                            "another step, or retry.",
                            path=str(self.root),
                            step=step,
                        )
                    self._overwriting.add(step)
            try:
                path = self._commit(step, obj, metadata, overwrite=overwrite)
                # An overwrite in the other form (folder vs archive) leaves the old one.
                other = "dir" if self.archive else "archive"
                if other in forms:
                    self._delete([(step, forms[other])])
            finally:
                if forms:
                    with self._state:
                        self._overwriting.discard(step)
                        self._swapped.notify_all()
            self._apply_retention(just_saved=step)
        return path

    def _commit(
        self, step: int, obj: Any, metadata: dict[str, Any] | None, *, overwrite: bool
    ) -> Path:
        def write(staging: Path) -> Manifest:
            return write_checkpoint(
                obj,
                staging,
                step=step,
                user_metadata=metadata,
                fsync=self.fsync,
                checksum=self.checksum,
            )

        if self.archive:
            path, _ = _atomic.commit_archive(
                self.root,
                step,
                write,
                overwrite=overwrite,
                fsync=self.fsync,
                compression=self.compression,
            )
        else:
            path, _ = _atomic.commit_directory(
                self.root, step, write, overwrite=overwrite, fsync=self.fsync
            )
        return path

    def _retire(self, doomed: list[tuple[int, Path]]) -> list[tuple[Path, Path]]:
        """Rename steps away (under ``_state``, so ``_using`` cannot pick them meanwhile).

        Returns ``(former path, temporary path)`` pairs; once this returns the steps are no
        longer listed, whatever happens to the removal that follows.
        """
        retired = []
        with self._state:
            for step, path in doomed:
                retired.append((path, _atomic.retire(self.root, path, step, fsync=False)))
        if retired and self.fsync:
            _atomic.fsync_dir(self.root)
        return retired

    @staticmethod
    def _remove(retired: list[tuple[Path, Path]]) -> list[Path]:
        # Runs after a save committed: a tree this process cannot delete (a read-only
        # sub-folder, another user's file) is left for gc with a warning, not an error that
        # would make the committed save look failed. The step is no longer listed either way.
        for _, aside in retired:
            try:
                _atomic.remove_retired(aside)
            except OSError as exc:
                # _warn_not_removed <- _remove <- _apply_retention/_delete <- save/prune <- caller
                _warn_not_removed(aside, exc, stacklevel=5)
        return [path for path, _ in retired]

    def _delete(self, doomed: list[tuple[int, Path]]) -> list[Path]:
        return self._remove(self._retire(doomed))

    def _apply_retention(self, *, just_saved: int | None) -> list[Path]:
        with self._state:
            infos = self.step_infos()
            if not infos:
                return []
            keep = set(self.retention.select_to_keep(infos))
            # Never: the newest committed step, the one just saved, one in use.
            keep.add(infos[-1].step)
            if just_saved is not None:
                keep.add(just_saved)
            keep.update(self._in_use)
            doomed = []
            entries = self._index.entries()
            for info in infos:
                if info.step not in keep:
                    doomed += [(info.step, p) for p in entries.get(info.step, {}).values()]
            retired = self._retire(doomed)
        # The (slow) removal runs without _state: restores of other steps need not wait.
        return self._remove(retired)

    def prune(self) -> list[Path]:
        """Apply the retention policy now (it also runs after every save); return what went."""
        with self._writing:
            if not self.root.is_dir():
                return []
            self._ensure_lock()
            return self._apply_retention(just_saved=None)

    def gc(self) -> list[Path]:
        """Remove what crashed saves and deletes left behind; return the removed paths.

        Removes every ``<step>.tmp-*`` entry (staging folders, steps being deleted) and the
        archive writer's temporary files. A step that an interrupted overwrite had renamed
        aside, with nothing committed in its place, is renamed back instead. Committed
        steps and foreign entries are never touched. Takes the writer lock.
        """
        with self._writing:
            if not self.root.is_dir():
                return []
            self._ensure_lock()
            removed = []
            for name in sorted(os.listdir(self.root)):
                if _atomic.is_tmp_name(name):
                    try:
                        gone = _atomic.recover_or_remove(self.root, name, fsync=self.fsync)
                    except OSError as exc:
                        _warn_not_removed(self.root / name, exc, stacklevel=3)
                        continue
                    if gone is not None:
                        removed.append(gone)
            if removed and self.fsync:
                _atomic.fsync_dir(self.root)
            return removed

    # -- verification ----------------------------------------------------------------------
    def verify(self, step: int | None = None, *, progress: Progress | None = None) -> VerifyReport:
        """Re-read every file of a step and compare it with the manifest.

        Reports every missing, short, long, changed (checksum), misplaced (not a regular
        file) and extra file, with the key it stores. Never modifies anything; never takes
        the writer lock (but this manager's retention will not delete the step meanwhile).

        Args:
            step: the step (default: the latest committed one).
            progress: called as ``progress(bytes_done, bytes_total)`` while reading.

        Raises:
            CheckpointNotFoundError: no such step (a step-named entry without a valid
                manifest is reported, not raised).
        """
        if step is None:
            with self._using(None) as (resolved, path, manifest):
                return verify_files(resolved, path, manifest, progress)
        step = _atomic.check_step(step)
        with self._state:
            while step in self._overwriting:
                self._swapped.wait()
            forms = self._index.entries().get(step)
            if not forms:
                raise self._index.not_found(step)
            path = self._preferred(forms)
            self._in_use[step] += 1
        try:
            kind = "archive" if path.name.endswith(_atomic.ARCHIVE_SUFFIX) else "dir"
            try:
                manifest = self._index.manifest(path, kind)
            except MetadataError as exc:
                return manifest_problem(step, path, exc.message)
            return verify_files(step, path, manifest, progress)
        finally:
            with self._state:
                self._in_use[step] -= 1
                if self._in_use[step] <= 0:
                    del self._in_use[step]

    # -- restoring -------------------------------------------------------------------------
    def _verified(self, step: int, path: Path, manifest: Manifest) -> None:
        report = verify_files(step, path, manifest, None)
        if not report.ok:
            raise IntegrityError(
                f"{path}: step {step} failed verification, so nothing was restored and the "
                f"target is unchanged.\n{report.summary()}\nRestore another step (see "
                "steps()), or re-save this one.",
                path=str(path),
                step=step,
                report=report,
                problems=list(report.problems),
            )

    def restore_into(
        self,
        td: Any,
        step: int | None = None,
        *,
        allow_pickle: bool | None = None,
        mode: Literal["r", "r+"] | None = "r",
        verify: bool = False,
        strict: bool = True,
    ) -> Any:
        """Load a committed step into ``td`` in place, all or nothing, and return ``td``.

        The target and its nested tensordicts are reused, each leaf is replaced by the
        loaded one, and on any error ``td`` is left exactly as it was
        (:func:`tdckpt.load_memmap_`).

        With the default ``mode="r"`` every leaf maps its file copy-on-write (private):
        training that writes into the restored tensors in place changes memory only, and
        can never reach - let alone corrupt - a committed checkpoint. ``mode="r+"`` maps the
        files shared, so in-place writes DO modify the checkpoint on disk (and its
        checksums then fail :meth:`verify`); use it only on purpose.

        While it runs, the step is marked as being restored: retention in another thread of
        this manager does not delete it.

        Args:
            td: a TensorDict, tensorclass instance, lazy stack or nested dict.
            step: the step (default: the latest committed one).
            allow_pickle: True loads pickled non-tensor data, False refuses it before
                touching ``td``, None loads it with a FutureWarning (tensordict's policy).
            mode: ``"r"`` (copy-on-write, default), ``"r+"`` (shared, writes reach the
                files) or None (tensordict's default: shared when the file is writable).
            verify: first re-read every file and compare it with the manifest; on any
                mismatch raise :class:`~tdckpt.errors.IntegrityError` with ``td`` untouched.
            strict: refuse (:class:`~tdckpt.errors.RestoreError`, ``td`` untouched) when
                ``td``'s keys differ from the checkpoint's - compared on the validated
                metadata, before any file is mapped or value unpickled, so the step is
                restored once either way; with False, ``td`` takes the checkpoint's
                structure (keys the checkpoint lacks are removed). Keys are compared at
                every level (lazy stacks member by member); tensors and non-tensor data,
                a tensorclass's non-tensor fields included, are leaves.

        Raises:
            CheckpointNotFoundError: no such step.
            IntegrityError: ``verify=True`` and the step is damaged (every problem listed).
            RestoreError: ``strict=True`` and the keys differ (``.missing``/``.unexpected``).
        """
        from tdckpt._restore.engine import _check_args, restore_in_place
        from tdckpt._restore.keys import key_difference, saved_structure, target_structure

        _check_args(True, allow_pickle, mode)
        with self._using(step) as (resolved, path, manifest):
            if verify:
                self._verified(resolved, path, manifest)

            def same_keys(opened: OpenedCheckpoint) -> None:
                # On the validated node tree, before any leaf is mapped or value unpickled.
                saved = saved_structure(opened)
                missing, unexpected = key_difference(
                    saved, target_structure(td, opaque=saved.opaque)
                )
                if missing or unexpected:
                    raise RestoreError(
                        f"{path}: step {resolved} does not have the target's keys (strict=True); "
                        f"nothing was changed. In the target but not the checkpoint: "
                        f"{_show_keys(missing)}. In the checkpoint but not the target: "
                        f"{_show_keys(unexpected)}. Pass strict=False to give the target the "
                        "checkpoint's structure, or use restore() for a new object.",
                        path=str(path),
                        step=resolved,
                        missing=missing,
                        unexpected=unexpected,
                    )

            restore_in_place(
                td,
                path,
                True,
                allow_pickle=allow_pickle,
                mode=mode,
                check=same_keys if strict else None,
            )
        return td

    def restore(
        self,
        step: int | None = None,
        *,
        allow_pickle: bool | None = None,
        mode: Literal["r", "r+"] | None = "r",
        verify: bool = False,
    ) -> Any:
        """Load a committed step into a new object (TensorDict, tensorclass, lazy stack, ...).

        ``mode="r"`` (default) maps the files copy-on-write: writes into the result never
        reach the checkpoint. See :meth:`restore_into` for the other arguments.

        Raises:
            CheckpointNotFoundError: no such step.
            IntegrityError: ``verify=True`` and the step is damaged.
        """
        from tdckpt._restore.engine import load_memmap

        with self._using(step) as (resolved, path, manifest):
            if verify:
                self._verified(resolved, path, manifest)
            return load_memmap(path, robust_key=True, allow_pickle=allow_pickle, mode=mode)


def _warn_not_removed(path: Path, exc: OSError, *, stacklevel: int) -> None:
    where = f": {exc.filename}" if exc.filename and str(exc.filename) != str(path) else ""
    warnings.warn(
        f"{path}: could not be removed ({exc.strerror}{where}); it is left behind and no "
        "longer listed as a step. Make it writable (e.g. chmod -R u+w) and run gc() or "
        "`tdckpt gc` again.",
        TdckptWarning,
        stacklevel=stacklevel,
    )


def _show_keys(keys: list[tuple[str, ...]], limit: int = 10) -> str:
    if not keys:
        return "none"
    shown = ", ".join(repr(k if len(k) > 1 else k[0]) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
