"""``CheckpointManager``: numbered, atomic, verifiable checkpoints of a TensorDict in one root.

A root holds one entry per committed step - ``<root>/<step>/`` (or ``<root>/<step>.tdz``)
in tensordict 0.15.3's format plus ``tdckpt.manifest.json`` on a file system, a commit
record naming an attempt prefix in object storage - and nothing else that the manager
lists. Every step is written into an attempt nobody lists and committed by one atomic act
once its bytes are durable, so a process killed at any instant leaves every committed step
intact; what it leaves half-written is never listed, and :meth:`CheckpointManager.gc`
removes it.

The manager decides policy - what is saved, restored and deleted, and when - over a
:class:`~tdckpt._store.base.StepStore` (:mod:`tdckpt._store`), which lists, opens, begins,
commits, retires and collects the steps of a local folder or of an fsspec URL; the manager
asks the store's capabilities, never its type. The mechanics are collaborators it owns
and never reaches into (:mod:`tdckpt._manage`): :class:`~tdckpt._manage.saver.StepSaver`
claims, writes and commits a step, then applies retention;
:class:`~tdckpt._manage.reader.StepReader` restores one; both keep the steps being read
or overwritten in :class:`~tdckpt._manage.pins.StepPins`. A step is re-read against its
manifest through :mod:`tdckpt._manage.verify`.
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

import copy
import numbers
import os
import threading
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tdckpt._manage.background import BackgroundSaver, SaveFuture
from tdckpt._manage.pins import StepPins
from tdckpt._manage.reader import StepReader
from tdckpt._manage.saver import StepSaver, saveable, step_info
from tdckpt._manage.schedule import SaveSchedule
from tdckpt._manage.steps import StepStatus
from tdckpt._manage.verify import Progress, VerifyProblem, VerifyReport
from tdckpt._progress import ProgressArg, progress_bar
from tdckpt._shard.group import DEFAULT_TIMEOUT as _SHARD_TIMEOUT
from tdckpt._shard.group import resolve_group, wants_group
from tdckpt._state import is_state_mapping
from tdckpt._store import StepStore, open_step_store
from tdckpt._write import atomic as _atomic
from tdckpt._write.checksum import DEFAULT_CHECKSUM, new_hasher
from tdckpt._write.incremental import check_incremental
from tdckpt._write.save import check_json_data, prepare_checkpoint
from tdckpt._write.snapshot import StagingBuffers
from tdckpt.errors import AsyncSaveError, TdckptError, UnsupportedContentError
from tdckpt.retention import KeepAll, RetentionPolicy, StepInfo, metric_value
from tdckpt.save_policy import SavePolicy
from tdckpt.schema import Manifest
from tdckpt.warnings import TdckptDeprecationWarning

if TYPE_CHECKING:
    from tdckpt._shard.steps import ShardSteps
    from tdckpt._write.lock import RootLock

__all__ = [
    "CheckpointManager",
    "RemoteCheckpointManager",
    "SaveFuture",
    "StepStatus",
    "VerifyProblem",
    "VerifyReport",
]


class CheckpointManager:
    """Save, list, verify, restore and prune the numbered checkpoints of one root.

    The root is a local folder, or an fsspec URL (``s3://bucket/run``, ``memory://x``) kept
    in object storage (``pip install 'tdckpt[remote]'``; see docs/remote.rst): one class,
    one signature, the same methods and errors; what differs is how a step is committed
    and read (:mod:`tdckpt._store`).

    Writing (:meth:`save`, retention, :meth:`gc`) takes the root's single-writer lock
    (``<root>/.tdckpt.lock``; a lease in object storage) on first use and holds it until
    :meth:`close`: a second
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
            :class:`~tdckpt.errors.CollectiveError` (default 1800).
        layout: ``"memmap"`` (default: a file per leaf, what ``td.memmap`` writes) or
            ``"consolidated"``: each step is a folder of one data file,
            ``tensordict.consolidated``, that ``TensorDict.from_consolidated`` loads, and
            the manifest, which records every leaf's offset, size and checksum. Restores map
            the one file once. (:meth:`save_async` snapshots a detached copy, then writes
            the one file in the background.) A collective manager writes one such data file
            per shard (docs/distributed.rst); ``incremental`` is refused with it.
        storage_options: for an fsspec URL root (``s3://bucket/run``, ``memory://x``), the
            filesystem's options (credentials, ``client_kwargs``...); refused for a local
            root. In object storage a step is committed by a conditional create of its
            commit record (two writers racing one step: one gets
            :class:`~tdckpt.errors.CommitConflictError`), ``overwrite=True``,
            ``mode="r+"``, ``archive``, ``layout``, ``group`` and ``rows`` are refused, and a
            restore reads the step's bytes verifying every checksum.
        save_policy: when :meth:`should_save` says "save this step" (default: never; see
            :mod:`tdckpt.save_policy`). A policy holding
            :class:`~tdckpt.save_policy.SaveOnPreemption` installs its signal handlers
            now (the manager must be made on the main thread) and :meth:`close` puts the
            previous ones back.
        clock: the time source of the save policies, in seconds (default
            :func:`time.monotonic`; a fake clock in tests).
        lease_ttl: for a URL root, seconds a writer's lease lasts without renewal (default
            600); refused for a local root (a file lock guards it).
        cache_dir: for a URL root, a local folder restores download a whole step into once
            (re-verified when reused) and map its files from; by default a restore reads
            only the leaves it restores, by ranged reads, into memory. Refused for a local
            root (read in place).
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
        timeout: float | None = None,
        storage_options: dict[str, Any] | None = None,
        save_policy: SavePolicy | None = None,
        clock: Callable[[], float] | None = None,
        lease_ttl: float | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        layout: str = "memmap",
        incremental: bool = False,
    ) -> None:
        from tdckpt._write.consolidated_write import check_layout

        self.layout = check_layout(layout)
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
        self.storage_options = storage_options
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.id = uuid.uuid4().hex
        # _state guards the lock object, the in-use counts and the manifest cache, and is
        # held while retention retires steps, so a restore cannot pick a step that is
        # being deleted, nor retention delete a step a restore has picked.
        self._state = threading.RLock()
        self._steps: StepStore = open_step_store(
            root,
            state=self._state,
            manager_id=self.id,
            archive=self.archive,
            fsync=self.fsync,
            checksum=checksum,
            compression=compression,
            layout=self.layout,
            storage_options=storage_options,
            lease_ttl=lease_ttl,
            cache_dir=cache_dir,
        )
        self.root: Path | str = self._steps.root
        caps = self._steps.capabilities
        if not caps.collective and (group not in (None, False) or timeout is not None):
            raise ValueError(
                f"{self.root}: group= and timeout= make a collective manager of sharded steps, "
                "which are saved to local roots only. Drop them, or use a shared local root."
            )
        # should_save: the save policy, its clock, the last save, the preemption handlers
        # (checked here, before any collective; joined and installed at the end).
        self._schedule = SaveSchedule(save_policy, clock)
        self._schedule.check_thread(str(self.root))
        # The steps being read (kept from retention) or overwritten (reads of them wait).
        self._pins = StepPins(self._steps, self._state)
        # One write (save, retention, gc) at a time within this process.
        self._writing = threading.Lock()
        self._saver = StepSaver(self._steps, self._pins, writing=self._writing, state=self._state)
        # The arguments are refused before the group is made (a collective): every rank
        # refuses alike, and no group is left behind by a manager that never was.
        collective = caps.collective and wants_group(group)
        if collective and self.archive:
            raise ValueError("a collective manager saves sharded steps as folders: archive=False")
        if self.layout == "consolidated" and self.archive:
            raise ValueError(
                "layout='consolidated' saves each step (or each shard of a collective "
                "manager's step) as a folder of one data file and the manifest: not with "
                "archive=True"
            )
        self.incremental = check_incremental(
            incremental, where=str(self.root), archive=self.archive, layout=self.layout
        )
        timeout = _SHARD_TIMEOUT if timeout is None else timeout
        # None: a single-process manager
        self._shard = resolve_group(group, timeout) if collective else None
        # save_async: one save in flight on one background thread, staged into buffers
        # reused across saves (tdckpt._manage.background, tdckpt._write.snapshot).
        self._background = BackgroundSaver(self.root)
        self._staging = StagingBuffers()
        self._staging_lock = threading.Lock()
        self._reader = StepReader(
            self._steps, self._pins, shard=self._shard, background=self._background
        )
        if self._shard is not None and save_policy is not None:
            self._schedule.join_group(self._shard.pg, timeout)  # collective, as the above
        self._schedule.install(str(self.root))

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({str(self.root)!r}, retention={self.retention!r}, "
            f"archive={self.archive}, fsync={self.fsync})"
        )

    @property
    def store(self) -> Any:
        """What the steps live in: the fsspec store of an object-storage root
        (``store.calls`` counts the requests sent), the folder of a local one."""
        return getattr(self._steps, "store", self.root)

    @property
    def _lock(self) -> RootLock | None:
        """The local root's file lock while this manager holds it (else None)."""
        return getattr(self._steps, "root_lock", None)

    @_lock.setter
    def _lock(self, value: RootLock | None) -> None:
        self._steps.root_lock = value  # type: ignore[attr-defined]

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
            self._steps.unlock()
        if self._shard is not None:  # the gloo group this manager made (never the user's)
            self._shard.destroy()
        if failure is not None:
            raise failure

    # -- listing ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The committed steps, in increasing order (never an attempt or foreign entry)."""
        return sorted(self._steps.records())

    def latest_step(self) -> int | None:
        """The highest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def _resolve(self, step: int | None) -> tuple[int, Path | str, Manifest]:
        record = self._steps.resolve(step)
        return record.step, record.where, record.manifest

    def path(self, step: int) -> Path | str:
        """The folder (or ``.tdz`` archive) of a committed step; in object storage, the
        URL of the step's data (its attempt prefix)."""
        return self._steps.resolve(_atomic.check_step(step)).where

    def metadata(self, step: int) -> dict[str, Any]:
        """The user metadata saved with a committed step (a copy)."""
        return copy.deepcopy(self._steps.resolve(_atomic.check_step(step)).manifest.user_metadata)

    def best_step(self, key: str, mode: Literal["min", "max"] = "min") -> int | None:
        """The committed step with the lowest (``"min"``) or highest (``"max"``) metadata value.

        Steps whose metadata lack ``key`` (or hold a non-number or NaN there) are ignored;
        ties go to the newer step. None when no step has the key.
        """
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        best: tuple[float, int] | None = None
        for step, record in sorted(self._steps.records().items()):
            value = metric_value(record.manifest.user_metadata, key)
            if value is None:
                continue
            score = (value if mode == "min" else -value, -step)
            if best is None or score < best:
                best = score
        return None if best is None else -best[1]

    def step_infos(self) -> list[StepInfo]:
        """What retention policies see: every committed step with its metadata, oldest first."""
        return [step_info(record) for _, record in sorted(self._steps.records().items())]

    def list_steps(self) -> list[StepStatus]:
        """Every step-like entry of the root with its status, for ``tdckpt ls``.

        Committed steps (a valid manifest or commit record), damaged ones (a step-named
        entry tdckpt cannot read: never restored, never listed by :meth:`steps`), and the
        leftovers of crashed saves (``incomplete``, removed by :meth:`gc`).
        """
        return self._steps.statuses()

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
    ) -> Path | str:
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
            incremental = self._wants_incremental(incremental)
            answered = self._schedule.save_started()
            shared = self._saver.save_collective(
                self._shard_steps(),
                self.retention,
                step,
                obj,
                metadata,
                overwrite,
                replicated,
                incremental=incremental,
            )
            self._schedule.saved(step, answered)
            return shared
        self._refuse_replicated(replicated)
        step = _atomic.check_step(step)
        if overwrite and not self._steps.capabilities.atomic_rename:
            raise ValueError(
                f"{self.root}: overwrite=True is not supported in object storage: replacing a "
                "committed step needs an atomic swap that object stores lack, and a reader "
                "could see the old step vanish. Save under a new step (and let retention "
                "delete the old one)."
            )
        incremental = self._wants_incremental(incremental)
        if metadata is not None:
            check_json_data(metadata)  # before taking the lock or creating anything
        obj, state = saveable(obj)
        self._background.drain(before=f"this save of step {step} started", stacklevel=2)
        answered = self._schedule.save_started()
        with self._writing:
            self._saver.lock_root()
            path = self._saver.save_locked(
                step,
                obj,
                metadata,
                self.retention,
                overwrite=overwrite,
                progress=progress,
                state=state,
                incremental=incremental,
            )
        self._schedule.saved(step, answered)
        return path

    def _refuse_replicated(self, replicated: Any) -> None:
        if not self._steps.capabilities.collective and tuple(replicated):
            raise ValueError(
                f"{self.root}: replicated= names keys of a sharded step, written by a "
                "collective manager on a local root. Drop it."
            )

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
        state at most); :meth:`close` frees it. With ``layout="consolidated"`` the snapshot
        is a detached copy of ``state`` instead (a new one per save), and what tensordict
        cannot write as one file (non-tensor data that is not JSON) fails in the background.

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
                store (every such key is listed); nothing was staged or written. In a
                collective manager this and the next refusal of one rank's own state or
                metadata come from every rank's ``result()`` instead (as from
                :meth:`save`, through the protocol): a rank that skipped the save would
                take the ranks' collectives out of step.
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
        collective = self._shard is not None
        if collective and is_state_mapping(state):
            self.save(step, state)  # raises the collective refusal of a training state
        self._refuse_replicated(replicated)
        step = _atomic.check_step(step)
        incremental = self._wants_incremental(incremental)
        consolidated = self.layout == "consolidated"
        # In a collective manager a refusal of this rank's state or metadata alone is
        # carried into the protocol (every rank's result() raises it), never raised here:
        # one rank skipping the save would take the ranks' collectives out of step.
        refused: BaseException | None = None
        try:
            if metadata is not None:
                check_json_data(metadata)  # before taking the lock or creating anything
                metadata = copy.deepcopy(metadata)  # plain JSON: later edits cannot reach it
            obj, record = saveable(state)  # on the caller's thread, before the snapshot
            if consolidated:  # written whole by tensordict's consolidate: refused now
                from tdckpt._write.consolidated_write import check_consolidatable

                check_consolidatable(obj, Path(self.root, _atomic.step_name(step)))
        except (TdckptError, TypeError, ValueError) as exc:
            if not collective:
                raise
            refused, obj, record = exc, None, None
        with self._staging_lock:  # one snapshot at a time uses the staging buffer
            self._background.drain(before=f"this save of step {step} started", stacklevel=2)
            if not collective:  # (a collective save checks on rank 0, in the protocol)
                with self._writing:
                    self._saver.lock_root()
                    if self._steps.existing(step):
                        raise self._steps.exists_error(step)
            answered = self._schedule.save_started()
            job: Callable[[], Path | str]
            if collective or not self._steps.capabilities.file_backed or consolidated:
                from tdckpt._write.snapshot import detached_copy

                if not collective and not consolidated:
                    # content the format cannot store is refused here, naming the key, as
                    # for a local root (the background thread would find it only later)
                    prepare_checkpoint(obj, f"{self.root}/{_atomic.step_name(step)}")
                # tensors cloned, non-tensor values deep-copied; a shard's errors (a bad
                # shard, ...) surface in the protocol, on every rank
                if refused is None:
                    try:
                        snapshot = detached_copy(obj)
                    except TdckptError as exc:
                        if not collective:
                            raise
                        refused = exc
                if refused is not None:
                    snapshot = None
            else:  # staged into reused buffers, written as files by the background thread
                prepared = prepare_checkpoint(obj, Path(self.root, _atomic.step_name(step)))
                snapshot = self._staging.stage(prepared)
            if collective:
                shards = tuple(replicated)
                job = lambda: self._saver.save_collective(  # noqa: E731
                    self._shard_steps(),
                    self.retention,
                    step,
                    snapshot,
                    metadata if refused is None else None,
                    False,
                    shards,
                    incremental=incremental,
                    refused=refused,
                )
            else:
                job = lambda: self._saver.save_in_background(  # noqa: E731
                    step, snapshot, metadata, record, self.retention, incremental
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
    ) -> Path | str | None:
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

    def wait(self) -> Path | str | None:
        """Wait for the :meth:`save_async` in flight; return its committed path.

        Returns None when no save was started, or when the last one failed and its error
        was already retrieved (``result()``, ``exception()``). Does not release anything:
        training and saving go on.

        Raises:
            AsyncSaveError: the save in flight failed and nobody retrieved its error (it
                counts as retrieved from then on).
        """
        future = self._background.drain(before="wait() returned", stacklevel=2)
        if future is None or future._future.exception() is not None:
            return None
        return future._future.result()

    def _wants_incremental(self, incremental: bool | None) -> bool:
        """A save's ``incremental`` (None: the manager's), refused where it cannot apply."""
        if incremental is None:
            return self.incremental
        return check_incremental(
            incremental, where=str(self.root), archive=self.archive, layout=self.layout
        )

    def _shard_steps(self) -> ShardSteps:
        """This root's steps as the shard layer drives them (:mod:`tdckpt._shard.steps`)."""
        from tdckpt._shard.steps import ShardSteps

        return ShardSteps(
            group=self._shard,
            store=self._steps,
            fsync=self.fsync,
            checksum=self.checksum,
            resolve=self._resolve,
            using=self._pins.using,
            verified=self._reader.verified,
            turn=self._saver.turn,
            layout=self.layout,
        )

    def prune(self) -> list[Path | str]:
        """Apply the retention policy now (it also runs after every save); return what went."""
        if self._shard is not None and self._shard.rank != 0:
            return []  # rank 0 prunes the shared root
        with self._writing:
            if not self._steps.exists():
                return []
            self._saver.lock_root()
            # _warn_not_removed <- remove <- apply_retention <- prune <- caller
            return self._saver.apply_retention(self.retention, just_saved=None, stacklevel=3)

    def gc(self, *, grace_period: float | None = None) -> list[Path | str]:
        """Remove what crashed saves and deletes left behind; return the removed paths.

        On a file system: every ``<step>.tmp-*`` entry (staging folders, steps being
        deleted) and the archive writer's temporary files; a step that an interrupted
        overwrite had renamed aside, with nothing committed in its place, is renamed back
        instead. In object storage: every attempt prefix no commit record names; never an
        attempt of a step whose record cannot be read (it may name it: a
        :class:`~tdckpt.warnings.TdckptWarning` says so), and each step's record is read
        again just before one of its attempts is deleted. Committed steps and foreign
        entries are never touched. Takes the writer lock. In a collective manager rank 0
        cleans the shared root; the other ranks return ``[]``.

        ``grace_period``: keep what changed less than that many seconds ago. Default: none
        kept on a file system (the writer lock already means no save of this root is
        running), an hour in object storage (a save may still be uploading, and the
        store's clock decides).
        """
        if grace_period is not None and (
            not isinstance(grace_period, numbers.Real)
            or isinstance(grace_period, bool)
            or not grace_period >= 0
        ):
            raise ValueError(
                f"grace_period must be None or a number of seconds >= 0, got {grace_period!r}"
            )
        if self._shard is not None and self._shard.rank != 0:
            return []  # rank 0 cleans the shared root
        with self._writing:
            if not self._steps.exists():
                return []
            self._saver.lock_root()
            # the warning <- store.gc <- gc <- caller
            return self._steps.gc(grace_period, stacklevel=3)

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
        step; what several steps share (an incremental save's linked file, or the earlier
        step's object a commit record refers to) is read once and its checksum compared
        with each step's manifest (``VerifyReport.shared_checked``)."""
        shared: dict[Any, Any] = {}  # what several steps share, read once
        with progress_bar(progress, "verify") as report:
            return [
                self._verify(step, report, shared)
                for step in (self.steps() if steps is None else steps)
            ]

    def shared_bytes(self) -> dict[int, int]:
        """``step -> bytes of its files that another committed step names too`` (incremental
        steps share files, or objects in object storage): a step's own bytes, about what
        deleting it frees, are its size less these. Steps that share nothing map to 0."""
        return self._steps.shared_bytes()

    def _verify(
        self, step: int | None, progress: Progress | None, shared: dict[Any, Any] | None = None
    ) -> VerifyReport:
        if step is not None:
            step = _atomic.check_step(step)
            self._pins.settle(step)
            damaged = self._steps.damaged(step)
            if damaged is not None:
                return damaged
        with self._pins.pinned(step) as record:
            report = self._steps.verify(record, progress, shared=shared)
        if not report.ok and record.step not in self._steps.records():
            # deleted meanwhile (by another process's retention): not damage - say so
            self._steps.resolve(record.step)  # CheckpointNotFoundError
        return report

    # -- restoring -------------------------------------------------------------------------
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
                For a training state the patterns name entries (``keys="model"``): only the
                selected entries are read and restored. For a sharded step each rank reads
                only its rows of the selected leaves.
            report: return ``(td, report)``, a :class:`~tdckpt.RestoreReport` (its
                ``missing`` and ``unexpected`` keys are errors under ``strict=True``).

        Raises:
            CheckpointNotFoundError: no such step.
            IntegrityError: ``verify=True`` and the step is damaged (every problem listed).
            RestoreError: ``strict=True`` and the keys differ (``.missing``/``.unexpected``).
        """
        return self._reader.restore_into(
            td,
            step,
            allow_pickle=allow_pickle,
            mode=mode,
            verify=verify,
            strict=strict,
            device=device,
            keys=keys,
            exclude=exclude,
            report=report,
            shard_steps=self._shard_steps,
        )

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
        device: str | Any | None = None,
    ) -> Any:
        """Load a committed step into a new object (TensorDict, tensorclass, lazy stack, ...).

        In a collective manager of M ranks each rank gets its part of the global rows
        (``torch.tensor_split`` into M along dim 0), or the ``rows`` slice it asks for;
        outside a group a sharded step restores whole (or its ``rows``). Only the rows
        returned are read, as views of the mapped files where they lie in one shard.

        ``mode="r"`` (default) maps the files copy-on-write: writes into the result never
        reach the checkpoint. ``keys`` / ``exclude`` / ``strict`` / ``report`` restore a part
        of the step and ``rename`` / ``dtype`` / ``device`` transform it, as
        :func:`tdckpt.load_memmap` does (only the selected bytes are mapped; a training
        state's entries are its top-level keys: ``keys="model"``). See :meth:`restore_into`
        for the other arguments.

        Raises:
            CheckpointNotFoundError: no such step.
            IntegrityError: ``verify=True`` and the step is damaged.
            RestoreError: ``strict`` and a pattern of ``keys`` selects nothing; a
                ``device`` this process does not have (before anything is read).
        """
        return self._reader.restore(
            step,
            allow_pickle=allow_pickle,
            mode=mode,
            verify=verify,
            rows=rows,
            keys=keys,
            exclude=exclude,
            strict=strict,
            report=report,
            rename=rename,
            dtype=dtype,
            device=device,
            shard_steps=self._shard_steps,
        )


def RemoteCheckpointManager(root: str, **kwargs: Any) -> CheckpointManager:
    """Deprecated: :class:`CheckpointManager` takes an object-storage URL itself.

    Kept for one release: warns with :class:`~tdckpt.warnings.TdckptDeprecationWarning`
    and returns ``CheckpointManager(root, **kwargs)``.
    """
    warnings.warn(
        TdckptDeprecationWarning(
            "RemoteCheckpointManager is deprecated and will be removed in tdckpt 0.2: "
            f"CheckpointManager({root!r}, ...) keeps a root in object storage itself (one "
            "class for every root). Use CheckpointManager.",
            since="0.1",
            removal="0.2",
        ),
        stacklevel=2,
    )
    return CheckpointManager(root, **kwargs)
