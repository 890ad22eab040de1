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
:meth:`CheckpointManager.save_async` stages a snapshot of the state on the caller's thread
(:mod:`tdckpt._write.snapshot`) and runs the same save on one background thread
(:mod:`tdckpt._manage.background`).

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
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tdckpt._manage import background as _background
from tdckpt._manage.background import BackgroundSaver, SaveFuture
from tdckpt._manage.schedule import SaveSchedule
from tdckpt._manage.steps import StepIndex, StepStatus, preferred
from tdckpt._manage.verify import (
    Progress,
    SharedDigests,
    VerifyProblem,
    VerifyReport,
    manifest_problem,
    verify_files,
)
from tdckpt._progress import ProgressArg, progress_bar
from tdckpt._remote.urls import is_url, require_local_options
from tdckpt._shard.group import DEFAULT_TIMEOUT as _SHARD_TIMEOUT
from tdckpt._shard.group import resolve_group
from tdckpt._state import holds_live_objects, is_state_mapping, restore_state, to_tensordict
from tdckpt._write import atomic as _atomic
from tdckpt._write.archive_write import commit_archive
from tdckpt._write.checksum import DEFAULT_CHECKSUM, new_hasher
from tdckpt._write.incremental import (
    IncrementalBase,
    IncrementalSave,
    check_incremental,
    unshare_for_write,
    writes_reach_files,
)
from tdckpt._write.lock import RootLock
from tdckpt._write.save import check_json_data, prepare_checkpoint, write_checkpoint
from tdckpt._write.snapshot import StagingBuffers
from tdckpt.errors import (
    AsyncSaveError,
    CheckpointExistsError,
    IntegrityError,
    LockError,
    MetadataError,
    RestoreError,
    TdckptError,
    UnsupportedContentError,
)
from tdckpt.retention import KeepAll, RetentionPolicy, StepInfo, metric_value
from tdckpt.save_policy import SavePolicy
from tdckpt.schema import MANIFEST_NAME, Manifest, ShardedManifest, StateRecord
from tdckpt.warnings import TdckptWarning

if TYPE_CHECKING:
    from tdckpt._read.pipeline import OpenedCheckpoint

__all__ = ["CheckpointManager", "SaveFuture", "StepStatus", "VerifyProblem", "VerifyReport"]


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
        group: the ranks that save and restore together (a ``torch.distributed`` process
            group). With a group, or whenever ``torch.distributed`` is initialized, the
            manager is collective: every rank of the group makes it and calls :meth:`save`
            and :meth:`restore` alike, each with its shard (see docs/distributed.rst).
            Otherwise nothing changes. ``group=False``: never collective, even under
            ``torch.distributed`` (a manager one rank alone makes, e.g. to list steps).
        timeout: seconds a collective of a sharded save or restore waits for the other
            ranks before every surviving rank raises
            :class:`~tdckpt.errors.CollectiveError`.
        layout: ``"memmap"`` (default: a file per leaf, what ``td.memmap`` writes) or
            ``"consolidated"``: each step is a folder of one data file,
            ``tensordict.consolidated``, that ``TensorDict.from_consolidated`` loads, and
            the manifest, which records every leaf's offset, size and checksum. Restores map
            the one file once. (:meth:`save_async` saves the memmap layout only.)
        storage_options: for an fsspec URL root (``s3://bucket/run``, ``memory://x``), the
            filesystem's options (credentials, ``client_kwargs``...). A URL root is kept in
            object storage (``pip install 'tdckpt[remote]'``; see the remote guide and
            :class:`tdckpt._remote.manager.RemoteCheckpointManager`).
        save_policy: when :meth:`should_save` says "save this step" (default: never; see
            :mod:`tdckpt.save_policy`). A policy holding
            :class:`~tdckpt.save_policy.SaveOnPreemption` installs its signal handlers
            now (the manager must be made on the main thread) and :meth:`close` puts the
            previous ones back.
        clock: the time source of the save policies, in seconds (default
            :func:`time.monotonic`; a fake clock in tests).
        lease_ttl: for a URL root, seconds a writer's lease lasts without renewal (default
            600); refused for a local root (a file lock guards it).
        cache_dir: for a URL root, where restores download a step (default: a private
            temporary folder); refused for a local root (read in place).
        incremental: default of every save's ``incremental``: a leaf whose bytes the
            latest committed step holds (same dtype, shape, size and checksum) is not
            written again; the new step shares that step's file (a reflink where the file
            system has it, else a hard link), and the leaf files of incremental saves are
            read-only on disk. Off by default (see docs/incremental.rst: it changes file
            modes, and equality rests on the checksum). In a collective manager each
            rank's shard is compared with its shard of the latest step; on a URL root the
            commit record refers to the earlier step's objects. Not with
            ``archive=True`` or ``layout="consolidated"``.

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

    #: how steps are saved: "memmap" (a file per leaf) or "consolidated" (one data file)
    layout: str = "memmap"

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
        group: Any = None,
        timeout: float = _SHARD_TIMEOUT,
        storage_options: dict[str, Any] | None = None,
        save_policy: SavePolicy | None = None,
        clock: Callable[[], float] | None = None,
        lease_ttl: float | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        layout: str = "memmap",
        incremental: bool = False,
    ) -> None:
        require_local_options(root, storage_options)
        for name, value in (("lease_ttl", lease_ttl), ("cache_dir", cache_dir)):
            if value is not None:
                raise ValueError(
                    f"{root}: {name} is for object-storage roots (s3://..., memory://...); a "
                    f"local root is guarded by a file lock and read in place. Drop {name}."
                )
        from tdckpt._write.consolidated_write import check_layout

        self.layout = check_layout(layout)
        self.root = Path(root)
        self.retention: RetentionPolicy = KeepAll() if retention is None else retention
        if not callable(getattr(self.retention, "select_to_keep", None)):
            raise TypeError(
                f"retention must be a retention policy (an object with select_to_keep), got "
                f"{retention!r}; see tdckpt.retention."
            )
        # should_save: the save policy, its clock, the last save, the preemption handlers
        # (checked here, before any collective; joined and installed at the end).
        self._schedule = SaveSchedule(save_policy, clock)
        self._schedule.check_thread(str(self.root))
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
        self._shard = resolve_group(group, timeout)  # None: a single-process manager
        if self._shard is not None and self.archive:
            raise ValueError("a collective manager saves sharded steps as folders: archive=False")
        if self.layout == "consolidated" and (self.archive or self._shard is not None):
            raise ValueError(
                "layout='consolidated' saves each step as a folder of one data file and the "
                "manifest: not with archive=True, nor in a collective (sharded) manager"
            )
        # -- incremental hook (tdckpt._write.incremental) --
        self.incremental = check_incremental(
            incremental, where=str(self.root), archive=self.archive, layout=self.layout
        )
        # save_async: one save in flight on one background thread, staged into buffers
        # reused across saves (tdckpt._manage.background, tdckpt._write.snapshot).
        self._background = BackgroundSaver(self.root)
        self._staging = StagingBuffers()
        self._staging_lock = threading.Lock()
        if self._shard is not None and save_policy is not None:
            self._schedule.join_group(self._shard.pg, timeout)  # collective, as the above
        self._schedule.install(str(self.root))

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({str(self.root)!r}, retention={self.retention!r}, "
            f"archive={self.archive}, fsync={self.fsync})"
        )

    @property
    def tdckpt_group(self) -> Any:
        """The gloo process group tdckpt coordinates ranks on (None outside a group)."""
        return None if self._shard is None else self._shard.pg

    # -- life cycle ------------------------------------------------------------------------
    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: object, error: object, tb: object) -> None:
        if not isinstance(error, BaseException):
            self._close(stacklevel=3)
            return
        # The block raised: its error goes on. A background save that failed unretrieved
        # is told in a note of that error's traceback instead of replacing it.
        try:
            self._close(stacklevel=3)
        except AsyncSaveError as failure:
            error.add_note(f"While leaving the CheckpointManager block: {failure}")

    def close(self) -> None:
        """Release the writer lock (if taken). Reading still works; a later write re-locks.

        A collective manager also frees the gloo group it made (a group passed as
        ``group=`` is the user's and stays); its later saves and restores raise
        :class:`~tdckpt.errors.CollectiveError` on every rank: make a new manager.

        Waits for a save, retention or gc running in another thread to finish first - the
        background save of :meth:`save_async` included - so the lock is never released in
        the middle of a write. Frees the staging buffer of :meth:`save_async`. Puts back
        the signal handlers that a ``SaveOnPreemption`` policy replaced.

        Raises:
            AsyncSaveError: the last :meth:`save_async` failed and nobody retrieved its
                error (``result()``, ``exception()`` or a later save); the lock is
                released all the same. Leaving a ``with`` block raises it too - unless
                the block is left by an exception: that one goes on, with the failure
                told in a note (``__notes__``) of its traceback.
        """
        self._close(stacklevel=3)

    def _close(self, *, stacklevel: int) -> None:
        # stacklevel: of the kept background warnings, from this method (3: close's caller).
        failure = self._background.shutdown(stacklevel=stacklevel)
        self._schedule.uninstall()
        with self._staging_lock:
            self._staging.release()
        with self._writing, self._state:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
        if self._shard is not None:  # the gloo group this manager made (never the user's)
            self._shard.destroy()
        if failure is not None:
            raise failure

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

    def shared_bytes(self) -> dict[int, int]:
        """``step -> bytes of its files that another committed step names too`` (incremental
        steps share files): a step's own bytes, about what deleting it frees, are its size
        less these. Steps that share nothing map to 0."""
        from tdckpt._write.incremental import shared_bytes  # incremental hook

        steps = []
        for step, forms in self._index.committed().items():
            path, _ = self._preferred(forms)
            steps.append((step, path))
        return shared_bytes(steps)

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
        progress: ProgressArg = None,
        replicated: Any = (),
        incremental: bool | None = None,
    ) -> Path:
        """Save ``obj`` as ``step``: all or nothing on disk, then apply the retention policy.

        ``obj`` (a TensorDict, lazy stack, tensorclass or non-tensor data, or a training
        state: a mapping of names to TensorDict-likes, modules, optimizers, LR schedulers,
        :class:`tdckpt.RandomState` and any object with ``state_dict()`` and
        ``load_state_dict()``) is written in tensordict 0.15.3's format into a staging
        folder beside the root's steps, made durable, and committed by one rename; it is
        never modified. Retention runs only after the commit.

        In a collective manager ``obj`` is this rank's shard: the global TensorDict is the
        ranks' shards concatenated along dim 0 in rank order, saved as one step by every
        rank together (all or nothing; see docs/distributed.rst).

        Args:
            step: the step number (an int >= 0); it names the folder.
            obj: what to save.
            metadata: plain JSON data stored in the manifest (see :meth:`metadata`,
                :meth:`best_step`, :class:`~tdckpt.retention.KeepBest`).
            overwrite: replace an existing step (atomically) instead of refusing.
            progress: ``True`` draws a progress bar of the bytes written (tqdm, on
                stderr, only when it is a terminal); a callable is called as
                ``progress(bytes_done, bytes_total)``.
            replicated: in a collective manager, the keys of entries that are equal on
                every rank and carry no batch dimension (non-tensor data): written once,
                by rank 0. Ignored outside a group (everything is saved).
            incremental: share the unchanged leaves' files with the latest committed step
                instead of writing them (None: the manager's ``incremental``).

        A background save of :meth:`save_async` still in flight is waited for first.

        Returns:
            The committed folder (or archive).

        Raises:
            AsyncSaveError: the previous :meth:`save_async` failed and nobody retrieved its
                error; nothing of this save was started.
            CheckpointExistsError: the step exists and ``overwrite`` is False, or it is
                being restored right now.
            LockError: another writer holds the root.
            tdckpt.errors.UnsupportedContentError: ``obj`` holds what the format cannot
                store (every such key is listed); nothing was written.
            MetadataError: ``metadata`` is not plain JSON data.
        """
        if self._shard is not None:
            from tdckpt._shard.save import collective_save

            self._background.drain(before=f"this save of step {step} started", stacklevel=2)
            if is_state_mapping(obj):  # refused on every rank alike, before any collective
                raise UnsupportedContentError(
                    f"{self.root}: a collective manager saves one TensorDict shard per rank; "
                    "a training state (modules, optimizers, ...) is not sharded. Save it from "
                    "one rank with CheckpointManager(..., group=False), or save the shard.",
                    path=str(self.root),
                    problems=["a training state given to a collective save"],
                    keys=[()],
                )
            answered = self._schedule.save_started()
            path = collective_save(
                self,
                step,
                obj,
                metadata=metadata,
                overwrite=overwrite,
                replicated=replicated,
                incremental=self._wants_incremental(incremental),  # incremental hook
            )
            self._schedule.saved(step, answered)
            return path
        step = _atomic.check_step(step)
        incremental = self._wants_incremental(incremental)
        if metadata is not None:
            check_json_data(metadata)  # before taking the lock or creating anything
        obj, state = self._saveable(obj)
        self._background.drain(before=f"this save of step {step} started", stacklevel=2)
        answered = self._schedule.save_started()
        with self._writing:
            self._ensure_lock()
            path = self._save_locked(
                step,
                obj,
                metadata,
                overwrite=overwrite,
                progress=progress,
                state=state,
                incremental=incremental,
            )
        self._schedule.saved(step, answered)
        return path

    def save_async(
        self,
        step: int,
        state: Any,
        *,
        metadata: dict[str, Any] | None = None,
        replicated: Any = (),
        incremental: bool | None = None,
    ) -> SaveFuture:
        """Snapshot ``state`` now, write and commit it on a background thread.

        Returns once every leaf of ``state`` is copied into a reusable CPU buffer (pinned
        memory for tensors on an accelerator) and its non-tensor data serialized: from then
        on the caller may change ``state`` in place - CPU, shared-memory and memory-mapped
        leaves included - without reaching the checkpoint. Writing, checksums, fsync, the
        commit and retention then run on this manager's background thread, exactly as
        :meth:`save` does them; the step is listed (:meth:`steps`, :meth:`latest_step`) and
        retention runs only after the step is durable, and a restore never sees it before.

        One save is in flight at a time: this call (and :meth:`save`) first waits for the
        previous background save. The buffer is reused by the next snapshot of the same
        layout, so memory stays flat over any number of saves (one extra copy of the
        state at most); :meth:`close` frees it.

        A failure of the background save is never lost: :meth:`SaveFuture.result` raises
        it; if nobody asked, the next :meth:`save`/:meth:`save_async` and :meth:`close`
        (or leaving the ``with`` block) raise :class:`~tdckpt.errors.AsyncSaveError` for
        it, with the original error as ``__cause__``.

        Args:
            step: the step number (an int >= 0); it names the folder.
            state: what to save (what :meth:`save` accepts).
            metadata: plain JSON data stored in the manifest (copied now).
            replicated: in a collective manager, as for :meth:`save`.
            incremental: as for :meth:`save`.

        In a collective manager every rank calls it with its shard, as :meth:`save`; the
        shard is copied now (tensors cloned, non-tensor values deep-copied), and the
        sharded save protocol - its collectives included - runs on the background thread,
        on tdckpt's own gloo group (never the caller's group). A collective restore first
        waits for the save in flight, so the two never share the group at once.

        Returns:
            A :class:`~tdckpt.manager.SaveFuture`; ``result()`` gives the committed path.

        Raises:
            AsyncSaveError: the previous background save failed and nobody retrieved it;
                nothing of this save was started.
            CheckpointExistsError: the step exists already (checked now, and again
                before the commit).
            LockError: another writer holds the root.
            tdckpt.errors.UnsupportedContentError: ``state`` holds what the format cannot
                store (every such key is listed); nothing was staged or written.
            MetadataError: ``metadata`` is not plain JSON data.

        Example:
            >>> import tempfile, torch
            >>> from tensordict import TensorDict
            >>> td = TensorDict(w=torch.zeros(3))
            >>> with tempfile.TemporaryDirectory() as root:
            ...     with CheckpointManager(root) as mgr:
            ...         future = mgr.save_async(1, td, metadata={"loss": 0.5})
            ...         td["w"] += 1  # training goes on: step 1 keeps the zeros
            ...         _ = future.result()  # wait (optional: the next save waits too)
            ...         mgr.restore(1)["w"].tolist(), mgr.metadata(1)
            ([0.0, 0.0, 0.0], {'loss': 0.5})
        """
        if self._shard is not None:
            return self._save_async_collective(
                step, state, metadata, replicated, self._wants_incremental(incremental)
            )
        step = _atomic.check_step(step)
        incremental = self._wants_incremental(incremental)
        if metadata is not None:
            check_json_data(metadata)  # before taking the lock or creating anything
            metadata = copy.deepcopy(metadata)  # plain JSON: later edits must not reach it
        if self.layout == "consolidated":
            raise ValueError(
                "save_async stages the memmap layout only; with layout='consolidated' call "
                "save() (or make a manager with layout='memmap' for background saves)"
            )
        obj, record = self._saveable(state)  # on the caller's thread, before the snapshot
        with self._staging_lock:  # one snapshot at a time uses the staging buffer
            self._background.drain(before=f"this save of step {step} started", stacklevel=2)
            with self._writing:
                self._ensure_lock()
                self._refuse_existing(step, self._index.entries().get(step, {}))
            answered = self._schedule.save_started()
            prepared = prepare_checkpoint(obj, self.root / _atomic.step_name(step))
            snapshot = self._staging.stage(prepared)
            future = self._background.submit(
                step,
                lambda: self._save_in_background(step, snapshot, metadata, record, incremental),
            )
        self._schedule.saved(step, answered)
        return future

    def _save_async_collective(
        self,
        step: int,
        obj: Any,
        metadata: dict[str, Any] | None,
        replicated: Any,
        incremental: bool = False,
    ) -> SaveFuture:
        from tdckpt._shard.save import collective_save
        from tdckpt._write.snapshot import detached_copy

        step = _atomic.check_step(step)
        if metadata is not None:
            check_json_data(metadata)
            metadata = copy.deepcopy(metadata)
        if is_state_mapping(obj):
            self.save(step, obj)  # raises the collective refusal of a training state
        replicated = tuple(replicated)
        with self._staging_lock:
            self._background.drain(before=f"this save of step {step} started", stacklevel=3)
            answered = self._schedule.save_started()
            snapshot = detached_copy(obj)  # errors (bad shard, ...) surface in the protocol

            def job() -> Path:
                return collective_save(
                    self,
                    step,
                    snapshot,
                    metadata=metadata,
                    overwrite=False,
                    replicated=replicated,
                    incremental=incremental,
                )

            future = self._background.submit(step, job)
        self._schedule.saved(step, answered)
        return future

    # -- when to save ----------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether to save ``step`` now, by the manager's ``save_policy``.

        The loop becomes ``if mgr.should_save(step): mgr.save(step, state)`` (or
        ``save_async``). Never True without a ``save_policy``, and never twice for one step:
        not for the step this manager saved last, nor - before its first save - for the
        newest step committed in the root when the loop began (a resumed run). Any
        ``save``/``save_async`` counts as "the last save" for
        :class:`~tdckpt.save_policy.SaveEverySeconds`.

        With :class:`~tdckpt.save_policy.SaveOnPreemption`, True at the first call after
        a preemption signal arrived (see :attr:`preempted`): save, then leave the loop.

        In a collective manager every rank must call it for every step it asks about, in
        the same order: the ranks' answers are gathered (one small gloo collective on a
        group of tdckpt's own, so it never waits for a background save) and every rank
        gets True when any rank's policy says so - one rank's signal is enough.

        Raises:
            CollectiveError: in a group, the ranks asked about different steps, or one did
                not ask within the manager's ``timeout``.
        """
        step = _atomic.check_step(step)
        return self._schedule.decide(step, self.latest_step)

    @property
    def preempted(self) -> bool:
        """True once a preemption signal of the ``SaveOnPreemption`` policy arrived.

        In a collective manager also once another rank's signal was learnt at a
        :meth:`should_save` or :meth:`save_if_preempted`. It stays True: the job is being
        stopped, so leave the loop after the save :meth:`should_save` asked for.
        """
        return self._schedule.preempted

    def save_if_preempted(
        self, step: int, state: Any, *, metadata: dict[str, Any] | None = None
    ) -> Path | None:
        """Save ``state`` as ``step`` now (synchronously) if a preemption signal is pending.

        For long stretches without a step boundary (an evaluation pass, a data pass): call
        it at points where ``state`` is consistent. Returns the committed path, or None
        when no signal is pending (or ``step`` was just saved). In a collective manager
        every rank must call it at the same points (one rank's signal is enough, as for
        :meth:`should_save`).

        Raises:
            ValueError: the manager's ``save_policy`` has no
                :class:`~tdckpt.save_policy.SaveOnPreemption` (nothing would ever be
                pending).
        """
        step = _atomic.check_step(step)
        if not self._schedule.signals:
            raise ValueError(
                f"{self.root}: save_if_preempted needs a save_policy holding "
                "SaveOnPreemption (no signal handler is installed); pass e.g. "
                "save_policy=SaveEvery(1000) | SaveOnPreemption()."
            )
        if not self._schedule.preemption_due(step, self.latest_step):
            return None
        return self.save(step, state, metadata=metadata)

    def wait(self) -> Path | None:
        """Wait for the :meth:`save_async` in flight; return its committed path.

        Returns None when no save was started, or when the last one failed and its error
        was already retrieved (``result()``, ``exception()``). Does not release anything:
        training and saving go on.

        Raises:
            AsyncSaveError: the save in flight failed and nobody retrieved its error (it
                counts as retrieved from then on).
        """
        self._background.drain(before="wait() returned", stacklevel=2)
        future = self._background.inflight
        if future is None or future._future.exception() is not None:
            return None
        return future._future.result()

    def _save_in_background(
        self,
        step: int,
        snapshot: Any,
        metadata: dict[str, Any] | None,
        state: StateRecord | None,
        incremental: bool = False,
    ) -> Path:
        with self._writing:
            return self._save_locked(
                step, snapshot, metadata, overwrite=False, state=state, incremental=incremental
            )

    @staticmethod
    def _saveable(obj: Any) -> tuple[Any, StateRecord | None]:
        """What ``save``/``save_async`` write for ``obj``, and the training-state record.

        A training state (a mapping holding modules, optimizers, ...) becomes one
        TensorDict of every entry's state (:func:`tdckpt._state.to_tensordict`); anything
        else is written as it is. Runs on the caller's thread, before any snapshot.
        """
        if is_state_mapping(obj):
            return to_tensordict(obj)
        return obj, None

    def _refuse_existing(self, step: int, forms: dict[str, Any]) -> None:
        if forms:
            raise CheckpointExistsError(
                f"{self._preferred(forms)}: step {step} already exists; a committed step "
                "is never overwritten unless asked. Pass overwrite=True to replace it, "
                "or save under another step.",
                path=str(self._preferred(forms)),
                step=step,
            )

    def _claim(self, step: int, *, overwrite: bool) -> dict[str, Path]:
        """The step's existing forms, marked as being overwritten (under ``_writing``).

        Refuses an existing step unless ``overwrite``, and one being restored or verified;
        the caller discards ``step`` from ``_overwriting`` (and notifies) when done.
        """
        forms: dict[str, Path] = self._index.entries().get(step, {})
        if not overwrite:
            self._refuse_existing(step, forms)
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
        return forms

    def _save_locked(
        self,
        step: int,
        obj: Any,
        metadata: dict[str, Any] | None,
        *,
        overwrite: bool,
        progress: ProgressArg = None,
        state: StateRecord | None = None,
        incremental: bool = False,
    ) -> Path:
        """The body of a save, under ``_writing``: write, commit, then retention.

        ``obj`` is what to write: an object, or a staged snapshot of one (the background
        thread of :meth:`save_async`).
        """
        self._ensure_lock()
        forms = self._claim(step, overwrite=overwrite)
        try:
            with progress_bar(progress, "save") as report:
                path = self._commit(
                    step,
                    obj,
                    metadata,
                    overwrite=overwrite,
                    progress=report,
                    state=state,
                    incremental=incremental,
                )
            # An overwrite in the other form (folder vs archive) leaves the old one.
            other = "dir" if self.archive else "archive"
            if other in forms:
                # _warn_not_removed <- _remove <- _save_locked <- save <- caller
                self._remove(self._retire([(step, forms[other])]), stacklevel=5)
        finally:
            if forms:
                with self._state:
                    self._overwriting.discard(step)
                    self._swapped.notify_all()
        # _warn_not_removed <- _remove <- _apply_retention <- _save_locked <- save <- caller
        self._apply_retention(just_saved=step, stacklevel=6)
        return path

    def _commit(
        self,
        step: int,
        obj: Any,
        metadata: dict[str, Any] | None,
        *,
        overwrite: bool,
        progress: Progress | None = None,
        state: StateRecord | None = None,
        incremental: bool = False,
    ) -> Path:
        shared = self._incremental_save() if incremental else None  # incremental hook

        def write(staging: Path) -> Manifest:
            if self.layout == "consolidated":
                from tdckpt._write.consolidated_write import write_consolidated

                return write_consolidated(
                    obj,
                    staging,
                    step=step,
                    user_metadata=metadata,
                    fsync=self.fsync,
                    checksum=self.checksum,
                    state=state,
                )
            return write_checkpoint(
                obj,
                staging,
                step=step,
                user_metadata=metadata,
                fsync=self.fsync,
                checksum=self.checksum,
                progress=progress,
                state=state,
                direct=not self.archive,  # an archive's staging folder is read back at once
                incremental=shared,
            )

        if self.archive:
            path, _ = commit_archive(
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

    # -- incremental hooks (tdckpt._write.incremental) -------------------------------------
    def _wants_incremental(self, incremental: bool | None) -> bool:
        if incremental is None:
            return self.incremental
        return check_incremental(
            incremental,
            where=str(self.root),
            archive=self.archive,
            layout=self.layout,
        )

    def _incremental_save(self) -> IncrementalSave:
        """An incremental save against the latest committed step (under ``_writing``)."""
        committed = self._index.committed()
        if not committed:
            return IncrementalSave(base=None)
        latest = max(committed)
        path, manifest = self._preferred(committed[latest])
        return IncrementalSave(base=IncrementalBase.of_step(latest, path, manifest, self.checksum))

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
    def _remove(retired: list[tuple[Path, Path]], *, stacklevel: int) -> list[Path]:
        # Runs after a save committed: a tree this process cannot delete (a read-only
        # sub-folder, another user's file) is left for gc with a warning, not an error that
        # would make the committed save look failed. The step is no longer listed either way.
        for _, aside in retired:
            try:
                _atomic.remove_retired(aside)
            except OSError as exc:
                # stacklevel: of the warning, counted from _warn_not_removed (1).
                _warn_not_removed(aside, exc, stacklevel=stacklevel)
        return [path for path, _ in retired]

    def _apply_retention(self, *, just_saved: int | None, stacklevel: int = 5) -> list[Path]:
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
        # _warn_not_removed <- _remove <- _apply_retention <- prune <- caller: 5
        return self._remove(retired, stacklevel=stacklevel)

    def prune(self) -> list[Path]:
        """Apply the retention policy now (it also runs after every save); return what went."""
        if self._shard is not None and self._shard.rank != 0:
            return []  # rank 0 prunes the shared root
        with self._writing:
            if not self.root.is_dir():
                return []
            self._ensure_lock()
            return self._apply_retention(just_saved=None)

    def gc(self, *, grace_period: float | None = None) -> list[Path]:
        """Remove what crashed saves and deletes left behind; return the removed paths.

        Removes every ``<step>.tmp-*`` entry (staging folders, steps being deleted) and the
        archive writer's temporary files. A step that an interrupted overwrite had renamed
        aside, with nothing committed in its place, is renamed back instead. Committed
        steps and foreign entries are never touched. Takes the writer lock. In a
        collective manager rank 0 cleans the shared root; the other ranks return ``[]``.

        ``grace_period``: keep entries changed less than that many seconds ago (default:
        none kept; the writer lock already means no save of this root is running). The
        same argument as an object-storage root's, where uploads may still be in flight.
        """
        if grace_period is not None and not grace_period >= 0:
            raise ValueError(f"grace_period must be >= 0 seconds, got {grace_period!r}")
        if self._shard is not None and self._shard.rank != 0:
            return []  # rank 0 cleans the shared root
        with self._writing:
            if not self.root.is_dir():
                return []
            self._ensure_lock()
            removed = []
            now = time.time()
            for name in sorted(os.listdir(self.root)):
                if _atomic.is_tmp_name(name) and _older(self.root / name, now, grace_period):
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
    def verify(self, step: int | None = None, *, progress: ProgressArg = None) -> VerifyReport:
        """Re-read every file of a step and compare it with the manifest.

        Reports every missing, short, long, changed (checksum), misplaced (not a regular
        file) and extra file, with the key it stores. Never modifies anything; never takes
        the writer lock (but this manager's retention will not delete the step meanwhile).

        Args:
            step: the step (default: the latest committed one).
            progress: ``True`` draws a progress bar (tqdm, on stderr, only when it is a
                terminal); a callable is called as ``progress(bytes_done, bytes_total)``
                while reading.

        Raises:
            CheckpointNotFoundError: no such step (a step-named entry without a valid
                manifest is reported, not raised).
        """
        with progress_bar(progress, "verify") as report:
            return self._verify(step, report)

    def verify_steps(
        self, steps: list[int] | None = None, *, progress: ProgressArg = None
    ) -> list[VerifyReport]:
        """:meth:`verify` each of ``steps`` (default: every committed step), one report per
        step; a file several steps share (an incremental save's hard link) is read once and
        its checksum compared with each step's manifest (``VerifyReport.shared_checked``)."""
        shared: SharedDigests = {}  # incremental hook: shared files read once
        with progress_bar(progress, "verify") as report:
            return [
                self._verify(step, report, shared)
                for step in (self.steps() if steps is None else steps)
            ]

    def _verify(
        self, step: int | None, progress: Progress | None, shared: SharedDigests | None = None
    ) -> VerifyReport:
        if step is None:
            with self._using(None) as (resolved, path, manifest):
                return _verify_step(resolved, path, manifest, progress, shared)
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
            return _verify_step(step, path, manifest, progress, shared)
        finally:
            with self._state:
                self._in_use[step] -= 1
                if self._in_use[step] <= 0:
                    del self._in_use[step]

    # -- restoring -------------------------------------------------------------------------
    def _verified(self, step: int, path: Path, manifest: Manifest) -> None:
        report = _verify_step(step, path, manifest, None)
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
        device: str | Any | None = None,
        keys: Any = None,
        exclude: Any = None,
        report: bool = False,
    ) -> Any:
        """Load a committed step into ``td`` in place, all or nothing, and return ``td``.

        ``td`` may also be a training state - the mapping of names to modules, optimizers,
        schedulers, ... that was saved (a mapping holding at least one such object; one of
        tensors, dicts and TensorDicts only is restored as a nested dict): every entry is
        checked against the step before the first is restored, each is restored in place,
        and if one fails the others are put back (see docs/training-state.rst).

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
                a tensorclass's non-tensor fields included, are leaves. For a training
                state, False lets the step hold entries the target lacks.
            device: for a training state, where tensors that have no device of their own
                go (a module's parameters on ``meta``); parameters elsewhere keep theirs.
            keys, exclude: restore a part of the step (patterns as for :meth:`restore`):
                the selected keys are replaced, and every entry of ``td`` outside the
                selection stays as it is (``strict`` then compares the selected part only).
                Not yet for training states or sharded steps.
            report: return ``(td, report)``, a :class:`~tdckpt.RestoreReport`.

        Raises:
            CheckpointNotFoundError: no such step.
            IntegrityError: ``verify=True`` and the step is damaged (every problem listed).
            RestoreError: ``strict=True`` and the keys differ (``.missing``/``.unexpected``).
        """
        from tdckpt._restore.engine import _check_args, restore_in_place
        from tdckpt._restore.select import RestoreReport, Selection

        _check_args(True, allow_pickle, mode)
        selection = Selection.of_report(keys, exclude, report, in_place=True)
        if selection is not None and (holds_live_objects(td) or self._sharded_path(step, None)):
            raise NotImplementedError(
                f"{self.root}: keys=, exclude= and report= of restore_into do not apply to "
                "training states or sharded steps yet; restore() a part into a new object."
            )
        if holds_live_objects(td):  # a training state (a dict of tensors is a nested-dict target)
            from tdckpt._restore.engine import load_local

            with self._using(step) as (resolved, path, manifest):
                if verify:
                    self._verified(resolved, path, manifest)
                if writes_reach_files(mode):  # incremental hook: writes reach this step only
                    unshare_for_write(path, manifest, fsync=self.fsync)
                with _metadata_checked(path, manifest, resolved):
                    loaded = load_local(
                        path,
                        robust_key=True,
                        allow_pickle=allow_pickle,
                        mode=mode,
                        manifest_checked=True,
                    )
                restore_state(
                    td,
                    loaded,
                    manifest.state,
                    where=f"{path}: step {resolved}",
                    strict=strict,
                    device=device,
                )
            return td
        if device is not None:
            raise ValueError(
                "device= applies to a training state (a mapping of names to modules, ...); "
                "a TensorDict is restored memory-mapped on the CPU: move it afterwards."
            )
        if self._sharded_path(step, None):
            from tdckpt._shard.restore import restore_into_rows

            return restore_into_rows(
                self, td, step, allow_pickle=allow_pickle, mode=mode, verify=verify, strict=strict
            )
        with self._using(step) as (resolved, path, manifest):
            if verify:
                self._verified(resolved, path, manifest)

            same_keys = _same_keys(td, str(path), resolved, selection)
            if writes_reach_files(mode):  # incremental hook: writes reach this step only
                unshare_for_write(path, manifest, fsync=self.fsync)
            done = RestoreReport()
            with _metadata_checked(path, manifest, resolved):
                restore_in_place(
                    td,
                    path,
                    True,
                    allow_pickle=allow_pickle,
                    mode=mode,
                    check=same_keys if strict else None,
                    manifest_checked=True,  # _using validated it (cached by file identity)
                    selection=selection,
                    strict=strict,
                    report=done,
                )
        return (td, done) if report else td

    def restore(
        self,
        step: int | None = None,
        *,
        allow_pickle: bool | None = None,
        mode: Literal["r", "r+"] | None = "r",
        verify: bool = False,
        rows: slice | None = None,
        keys: Any = None,
        exclude: Any = None,
        strict: bool = True,
        report: bool = False,
        rename: Any = None,
        dtype: Any = None,
    ) -> Any:
        """Load a committed step into a new object (TensorDict, tensorclass, lazy stack, ...).

        In a collective manager of M ranks each rank gets its part of the global rows
        (``torch.tensor_split`` into M along dim 0), or the ``rows`` slice it asks for;
        outside a group a sharded step restores whole (or its ``rows``). Only the rows
        returned are read, as views of the mapped files where they lie in one shard.

        ``mode="r"`` (default) maps the files copy-on-write: writes into the result never
        reach the checkpoint. ``keys`` / ``exclude`` / ``strict`` / ``report`` restore a part
        of the step and ``rename`` / ``dtype`` transform it, as :func:`tdckpt.load_memmap`
        does (only the selected bytes are mapped; a training state's entries are its
        top-level keys: ``keys="model"``). See :meth:`restore_into` for the other arguments.

        Raises:
            CheckpointNotFoundError: no such step.
            IntegrityError: ``verify=True`` and the step is damaged.
            RestoreError: ``strict`` and a pattern of ``keys`` selects nothing.
        """
        from tdckpt._restore.engine import _check_args, load_local
        from tdckpt._restore.select import RestoreReport, Selection
        from tdckpt._restore.transform import apply_transforms, check_transforms

        check_transforms(rename, dtype)
        selection = Selection.of_report(keys, exclude, report)
        if self._sharded_path(step, rows):
            from tdckpt._shard.restore import restore_rows

            if selection is not None or rename is not None or dtype is not None:
                raise NotImplementedError(
                    f"{self.root}: keys=, exclude=, report=, rename= and dtype= do not apply "
                    "to sharded steps yet; restore the rows and select keys from the result."
                )
            return restore_rows(
                self, step, rows, allow_pickle=allow_pickle, mode=mode, verify=verify
            )
        _check_args(True, allow_pickle, mode)
        done = RestoreReport()
        with self._using(step) as (resolved, path, manifest):
            if verify:
                self._verified(resolved, path, manifest)
            if writes_reach_files(mode):  # incremental hook: writes reach this step only
                unshare_for_write(path, manifest, fsync=self.fsync)
            # _using validated the manifest (cached by file identity): not read again
            with _metadata_checked(path, manifest, resolved):
                obj = load_local(
                    path,
                    robust_key=True,
                    allow_pickle=allow_pickle,
                    mode=mode,
                    manifest_checked=True,
                    selection=selection,
                    strict=strict,
                    report=done,
                )
        obj = apply_transforms(
            obj, rename=rename, dtype=dtype, where=f"{self.root}: step {resolved}"
        )
        return (obj, done) if report else obj

    def _sharded_path(self, step: int | None, rows: Any) -> bool:
        """Whether a restore is collective, of a sharded step, or of some rows."""
        if self._shard is not None or rows is not None:
            # One user of tdckpt's group at a time: a save in flight finishes first.
            self._background.drain(before="this restore started", stacklevel=4)
            return True
        try:
            return isinstance(self._resolve(step)[2], ShardedManifest)
        except TdckptError:
            return False  # the plain path raises the error


def _verify_step(
    step: int,
    path: Path,
    manifest: Manifest,
    progress: Progress | None,
    shared: SharedDigests | None = None,
) -> VerifyReport:
    """:func:`verify_files`, and for a sharded step its manifest against its shards."""
    report = verify_files(step, path, manifest, progress, shared=shared)
    if isinstance(manifest, ShardedManifest):
        from tdckpt._shard.check import shard_problems

        report.problems += shard_problems(path, manifest)
    return report


def _metadata_checked(path: Path, manifest: Manifest, step: int) -> Any:
    """Every file the restore reads whole (``meta.json``, ...) checked against the manifest.

    Always, not only under ``verify=True``: those files are read anyway (see
    :mod:`tdckpt._read.expected`). A mismatch raises an IntegrityError, target untouched.
    """
    from tdckpt._read.expected import expecting

    return expecting(path, manifest, where=f"{path}: step {step}")


def _same_keys(
    td: Any, where: str, step: int, selection: Any = None
) -> Callable[[OpenedCheckpoint], None]:
    """The ``strict=True`` check of :meth:`CheckpointManager.restore_into`.

    Runs on the validated node tree, before any leaf is mapped or value unpickled, and
    raises a RestoreError listing the keys that differ (``where``: the step's path or URL).
    With a ``selection`` (a selective restore), only the target's keys it concerns count.
    """
    from tdckpt._restore.keys import key_difference, saved_structure, target_structure

    def check(opened: OpenedCheckpoint) -> None:
        saved = saved_structure(opened)
        missing, unexpected = key_difference(saved, target_structure(td, opaque=saved.opaque))
        if selection is not None:
            missing = [k for k in missing if selection.touches(k)]
        if missing or unexpected:
            raise RestoreError(
                f"{where}: step {step} does not have the target's keys (strict=True); "
                f"nothing was changed. In the target but not the checkpoint: "
                f"{_show_keys(missing)}. In the checkpoint but not the target: "
                f"{_show_keys(unexpected)}. Pass strict=False to give the target the "
                "checkpoint's structure, or use restore() for a new object.",
                path=where,
                step=step,
                missing=missing,
                unexpected=unexpected,
            )

    return check


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


def _show_keys(keys: list[tuple[str, ...]], limit: int = 10) -> str:
    if not keys:
        return "none"
    shown = ", ".join(repr(k if len(k) > 1 else k[0]) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
