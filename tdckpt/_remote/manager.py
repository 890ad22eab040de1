"""``CheckpointManager`` for a root in object storage (any fsspec URL).

``CheckpointManager("s3://bucket/run", storage_options=...)`` builds one of these (the
manager dispatches on the URL); a plain local path keeps the local manager and its
staging folder + fsync + rename commit. The API is the same; what differs is how a step is
committed and read (see :mod:`tdckpt._remote.layout`):

* save: plan the step as a local save plans it (the same files and bytes), upload it from
  memory under a fresh attempt prefix (checksums computed while uploading), check the upload
  with one listing, renew the lease, then create the commit record with a conditional
  create. The step exists iff the record does: a save killed at any instant leaves no listed
  step; of two writers racing one step exactly one create succeeds and the other gets a
  :class:`~tdckpt.errors.CommitConflictError`. ``overwrite=True`` is refused: replacing a
  committed step needs an atomic swap object stores do not have.
* restore / restore_into: read the record, fetch exactly each file's bytes with ranged,
  concurrent reads into a private local folder (``cache_dir``, or a temporary one in memory-
  backed ``/dev/shm`` when there is one), verify every checksum while reading, then run the
  same in-place engine on that folder: all or nothing, target untouched on any error. Leaves
  are mapped copy-on-write (``mode="r"``); the temporary folder is removed right after (the
  mapped pages stay with the tensors).
* retention: delete the record first (the step is gone), then its data; gc: delete attempt
  prefixes no record names once older than a grace period."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from tdckpt._manage import background as _background
from tdckpt._manage.background import BackgroundSaver, SaveFuture
from tdckpt._manage.schedule import SaveSchedule
from tdckpt._manage.steps import StepStatus
from tdckpt._manage.verify import Progress, VerifyProblem, VerifyReport
from tdckpt._progress import ProgressArg, progress_bar
from tdckpt._remote import layout
from tdckpt._remote.encode import encode_checkpoint
from tdckpt._remote.lease import DEFAULT_TTL_S, Lease
from tdckpt._remote.prefix import relabel_warnings
from tdckpt._remote.shared import Protected, protected, remove_attempt, share_objects
from tdckpt._remote.store import Store, mtime, open_store, shorten
from tdckpt._remote.transfer import check_uploaded, download_step, plan_objects, upload_encoded
from tdckpt._state import holds_live_objects, restore_state
from tdckpt._write import atomic as _atomic
from tdckpt._write.checksum import DEFAULT_CHECKSUM, new_hasher
from tdckpt._write.save import check_json_data
from tdckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitConflictError,
    IncompleteCheckpointError,
    MetadataError,
    RemoteError,
    TdckptError,
)
from tdckpt.manager import CheckpointManager, _same_keys
from tdckpt.retention import KeepAll, RetentionPolicy, StepInfo, metric_value
from tdckpt.save_policy import SavePolicy
from tdckpt.schema import FileRecord, StateRecord
from tdckpt.warnings import TdckptWarning

__all__ = ["DEFAULT_GRACE_S", "RemoteCheckpointManager"]

#: gc leaves an uncommitted attempt alone until it is this old (a save may be uploading).
DEFAULT_GRACE_S = 3600.0


def _memory_tmp() -> str | None:
    shm = Path("/dev/shm")
    try:
        if shm.is_dir():
            probe = tempfile.mkdtemp(prefix="tdckpt-probe-", dir=shm)
            Path(probe).rmdir()
            return str(shm)
    except OSError:
        pass
    return None


def _why(exc: BaseException) -> str:
    """What went wrong, for a warning issued after a commit: a store failure's operation,
    object and cause (not its "Nothing was committed" advice, which is for failed saves)."""
    if isinstance(exc, RemoteError) and "operation" in exc.facts:
        cause = exc.__cause__
        shown = repr(cause) if cause is not None else exc.message
        return f"{exc.facts['operation']} of {exc.facts.get('path')}: {shorten(shown, 300)}"
    return shorten(str(exc), 400)


class RemoteCheckpointManager(CheckpointManager):
    """A :class:`~tdckpt.manager.CheckpointManager` whose root is an fsspec URL.

    Extra arguments (besides the manager's):
        storage_options: passed to fsspec (``url_to_fs``), e.g. ``{"client_kwargs":
            {"endpoint_url": ...}}`` for S3-compatible stores, ``{"anon": True}``.
        lease_ttl: seconds a writer's lease lasts without renewal (see
            :mod:`tdckpt._remote.lease`).
        cache_dir: a local folder for downloaded steps: restores then keep their files
            there (``<cache_dir>/<step>.attempt-<id>/``, re-verified on reuse) instead of
            in a temporary folder removed after each restore.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdckpt import CheckpointManager, KeepLast
        >>> with CheckpointManager("memory://doctest/run", retention=KeepLast(1)) as mgr:
        ...     for step in (1, 2):
        ...         _ = mgr.save(step, TensorDict(w=torch.full((2,), float(step))))
        ...     mgr.steps(), mgr.restore()["w"].tolist(), type(mgr).__name__
        ([2], [2.0, 2.0], 'RemoteCheckpointManager')
    """

    root: Path | str  # type: ignore[assignment]

    def __init__(
        self,
        root: str,
        *,
        retention: RetentionPolicy | None = None,
        archive: bool = False,
        fsync: bool = True,
        checksum: str = DEFAULT_CHECKSUM,
        compression: str = "stored",
        storage_options: dict[str, Any] | None = None,
        lease_ttl: float | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        save_policy: SavePolicy | None = None,
        clock: Callable[[], float] | None = None,
        group: Any = None,
        timeout: float | None = None,
        incremental: bool = False,
    ) -> None:
        if group not in (None, False) or timeout is not None:
            raise ValueError(
                f"{root}: group= and timeout= make a collective manager of sharded steps, "
                "which are saved to local roots only. Drop them, or use a shared local root."
            )
        if lease_ttl is None:
            lease_ttl = DEFAULT_TTL_S
        if archive:
            raise ValueError(
                f"{root}: archive=True is for local roots; a step in object storage is already "
                "packed into a few objects. Drop archive=True."
            )
        if compression != "stored":
            raise ValueError(f"{root}: compression applies to archives only (local roots).")
        self.retention = KeepAll() if retention is None else retention
        if not callable(getattr(self.retention, "select_to_keep", None)):
            raise TypeError(
                f"retention must be a retention policy (an object with select_to_keep), got "
                f"{retention!r}; see tdckpt.retention."
            )
        new_hasher(checksum)
        self.checksum = checksum
        self.archive = False
        self.fsync = bool(fsync)
        self.compression = compression
        self.storage_options = storage_options
        self._store: Store = open_store(root, storage_options)
        self.root = self._store.url
        self.id = uuid.uuid4().hex
        self._lease = Lease(self._store, self.id, ttl=lease_ttl)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._state = threading.RLock()
        self._writing = threading.Lock()
        self._in_use: Counter[int] = Counter()
        self._records: dict[str, tuple[tuple[Any, ...], layout.CommitRecord | MetadataError]] = {}
        # save_async: one save in flight on one background thread (uploads and the commit).
        self._background = BackgroundSaver(self.root)
        self._staging_lock = threading.Lock()
        self._schedule = SaveSchedule(save_policy, clock)  # should_save (as the base class)
        self._schedule.install(self.root)
        # -- incremental hook (tdckpt._remote.shared) --
        self.incremental = self._wants_incremental(incremental)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, retention={self.retention!r})"

    @property
    def store(self) -> Store:
        """The store (``store.calls`` counts the requests sent)."""
        return self._store

    @property
    def tdckpt_group(self) -> Any:
        """None: an object-storage manager is never collective."""
        return None

    def _close(self, *, stacklevel: int) -> None:
        failure = self._background.shutdown(stacklevel=stacklevel)
        self._schedule.uninstall()
        with self._writing, self._state:
            self._lease.release()
        if failure is not None:
            raise failure

    def _ensure_lock(self) -> None:
        with self._state:
            self._lease.renew()

    # -- listing -------------------------------------------------------------------------
    def _scan(
        self,
    ) -> tuple[dict[int, layout.CommitRecord], dict[int, str], dict[str, tuple[int, str, Any]]]:
        """(committed records, damaged steps -> reason, attempt prefixes -> (step, id, info))."""
        committed: dict[int, layout.CommitRecord] = {}
        damaged: dict[int, str] = {}
        attempts: dict[str, tuple[int, str, Any]] = {}
        folders: dict[int, str] = {}
        for entry in self._store.ls(""):
            name = self._store.rel(entry["name"]).rsplit("/", 1)[-1]
            step = layout.parse_commit(name)
            if step is not None and entry.get("type") == "directory":
                # objects under a record's name: not a record tdckpt wrote, but it may be
                # one's remains; like an unreadable record it protects the step's attempts
                folders[step] = (
                    f"{self._store.show(name)}: a prefix of objects where the step's commit "
                    "record belongs, not a commit record."
                )
                continue
            if step is not None:
                result = self._record(name, step, entry)
                if isinstance(result, MetadataError):
                    damaged[step] = result.message
                else:
                    committed[step] = result
                continue
            parsed = layout.parse_attempt(name)
            if parsed is not None:
                attempts[name] = (parsed[0], parsed[1], entry)
        for step, reason in folders.items():
            if step not in committed:
                damaged.setdefault(step, reason)
        return committed, damaged, attempts

    def _record(
        self, name: str, step: int, entry: dict[str, Any]
    ) -> layout.CommitRecord | MetadataError:
        signature = (entry.get("size"), entry.get("ETag"), mtime(entry))
        with self._state:
            cached = self._records.get(name)
        if cached is not None and cached[0] == signature and signature != (None, None, None):
            return cached[1]
        result: layout.CommitRecord | MetadataError
        where = self._store.show(name)
        size = entry.get("size")
        if isinstance(size, int) and size > layout.MAX_RECORD_BYTES:
            result = MetadataError(
                f"{where}: {size} bytes, more than {layout.MAX_RECORD_BYTES}, too large for a "
                "commit record; it was not read.",
                path=where,
            )
        else:
            try:
                # capped: the object may have grown since it was listed
                data = self._store.cat_capped(name, layout.MAX_RECORD_BYTES, "commit record")
                result = layout.parse_record(data, where, step)
            except FileNotFoundError:
                result = MetadataError(f"{where}: deleted while being read.", path=where)
            except MetadataError as exc:
                result = exc
        with self._state:
            self._records[name] = (signature, result)
        return result

    def _committed(self) -> dict[int, layout.CommitRecord]:
        return self._scan()[0]

    def steps(self) -> list[int]:
        return sorted(self._committed())

    def _resolve_record(self, step: int | None) -> tuple[int, layout.CommitRecord]:
        committed, damaged, _ = self._scan()
        if step is None:
            if not committed:
                raise CheckpointNotFoundError(
                    f"{self.root}: no committed checkpoint yet; save one first (or check the URL).",
                    path=self.root,
                )
            step = max(committed)
        step = _atomic.check_step(step)
        if step in committed:
            return step, committed[step]
        if step in damaged:
            raise IncompleteCheckpointError(
                f"{self._store.show(layout.commit_name(step))}: step {step} is not a committed "
                f"tdckpt checkpoint: {damaged[step]} Restore or verify another step.",
                path=self._store.show(layout.commit_name(step)),
                step=step,
            )
        shown = ", ".join(map(str, sorted(committed)[-10:])) or "none"
        raise CheckpointNotFoundError(
            f"{self.root}: no committed step {step} (committed steps: {shown}). Pick one of "
            "steps(), or None for the latest.",
            path=self.root,
            step=step,
        )

    def _url(self, step: int, record: layout.CommitRecord) -> str:
        return self._store.show(layout.attempt_name(step, record.attempt))

    def path(self, step: int) -> str:  # type: ignore[override]
        """The URL of a committed step's data (its attempt prefix)."""
        step, record = self._resolve_record(_atomic.check_step(step))
        return self._url(step, record)

    def metadata(self, step: int) -> dict[str, Any]:
        return copy.deepcopy(
            self._resolve_record(_atomic.check_step(step))[1].manifest.user_metadata
        )

    def best_step(self, key: str, mode: Literal["min", "max"] = "min") -> int | None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        best: tuple[float, int] | None = None
        for step, record in sorted(self._committed().items()):
            value = metric_value(record.manifest.user_metadata, key)
            if value is None:
                continue
            score = (value if mode == "min" else -value, -step)
            if best is None or score < best:
                best = score
        return None if best is None else -best[1]

    def step_infos(self) -> list[StepInfo]:
        return [
            StepInfo(
                step=step,
                path=self._url(step, record),
                metadata=copy.deepcopy(record.manifest.user_metadata),
                created=record.manifest.created,
            )
            for step, record in sorted(self._committed().items())
        ]

    def list_steps(self) -> list[StepStatus]:
        committed, damaged, attempts = self._scan()
        rows: list[tuple[int, int, StepStatus]] = []
        for step, record in committed.items():
            m = record.manifest
            rows.append(
                (
                    step,
                    0,
                    StepStatus(
                        step=step,
                        path=self._url(step, record),
                        kind="remote",
                        status="committed",
                        size=sum(f.size for f in m.files),
                        format_version=m.format_version,
                        key_encoding=m.key_encoding,
                        created=m.created,
                        metadata=copy.deepcopy(m.user_metadata),
                    ),
                )
            )
        for step, reason in damaged.items():
            where = self._store.show(layout.commit_name(step))
            rows.append((step, 1, StepStatus(step, where, "remote", "damaged", detail=reason)))
        named = {layout.attempt_name(s, r.attempt) for s, r in committed.items()}
        for name, (step, _, _) in attempts.items():
            if name in named:
                continue
            if step in damaged:  # an unreadable record may name it: gc keeps it
                detail = "kept by gc: the step's commit record cannot be read and may name it"
                row = StepStatus(step, self._store.show(name), "tmp", "damaged", detail=detail)
            else:
                row = StepStatus(step, self._store.show(name), "tmp", "incomplete")
            rows.append((step, 2, row))
        return [row for _, _, row in sorted(rows, key=lambda r: (r[0], r[1], str(r[2].path)))]

    @contextlib.contextmanager
    def _pinned(self, step: int | None) -> Iterator[tuple[int, layout.CommitRecord]]:
        with self._state:
            resolved = self._resolve_record(step)
            self._in_use[resolved[0]] += 1
        try:
            yield resolved
        finally:
            with self._state:
                self._in_use[resolved[0]] -= 1
                if self._in_use[resolved[0]] <= 0:
                    del self._in_use[resolved[0]]

    # -- saving --------------------------------------------------------------------------
    def save(  # type: ignore[override]
        self,
        step: int,
        obj: Any,
        *,
        metadata: dict[str, Any] | None = None,
        overwrite: bool = False,
        progress: ProgressArg = None,
        replicated: Any = (),
        incremental: bool | None = None,
    ) -> str:
        """Save ``obj`` as ``step``: committed by a conditional create, or not at all.

        Returns the URL of the step's data. Raises CommitConflictError when another writer
        committed ``step`` first (this save's data is then left for :meth:`gc`) and
        CheckpointExistsError when it is already committed. ``progress`` is told the bytes
        uploaded once every object is up. See :meth:`CheckpointManager.save` for the rest.
        """
        if replicated:
            raise ValueError(
                f"{self.root}: replicated= names keys of a sharded step, written by a "
                "collective manager on a local root. Drop it."
            )
        step = _atomic.check_step(step)
        if overwrite:
            raise ValueError(
                f"{self.root}: overwrite=True is not supported in object storage: replacing a "
                "committed step needs an atomic swap that object stores lack, and a reader "
                "could see the old step vanish. Save under a new step (and let retention "
                "delete the old one)."
            )
        incremental = self._wants_incremental(incremental)
        if metadata is not None:
            check_json_data(metadata)
        obj, state = self._saveable(obj)  # a training state: one TensorDict of its entries
        self._background.drain(before=f"this save of step {step} started", stacklevel=2)
        answered = self._schedule.save_started()
        with progress_bar(progress, "save") as report:
            url = self._save_prepared(step, obj, metadata, state, report, incremental=incremental)
        self._schedule.saved(step, answered)
        return url

    def _save_prepared(
        self,
        step: int,
        obj: Any,
        metadata: dict[str, Any] | None,
        state: StateRecord | None,
        report: Callable[..., None] | None = None,
        *,
        incremental: bool = False,
    ) -> str:
        with self._writing:
            self._ensure_lock()
            commit = layout.commit_name(step)
            if step in self._committed():
                raise CheckpointExistsError(
                    f"{self._store.show(commit)}: step {step} already exists; a committed step "
                    "is never overwritten. Save under another step.",
                    path=self._store.show(commit),
                    step=step,
                )
            attempt = uuid.uuid4().hex
            prefix = layout.attempt_name(step, attempt)
            encoded = encode_checkpoint(
                obj,
                self._store.show(prefix),
                step=step,
                user_metadata=metadata,
                checksum=self.checksum,
                state=state,
            )
            objects, locations, members = plan_objects(
                [FileRecord(path=f.rel, size=f.size) for f in encoded.files]
            )
            shared: dict[str, str] = {}
            if incremental:  # incremental hook: refer to the latest step's equal objects
                committed = self._committed()
                base = committed[max(committed)] if committed else None
                objects, shared = share_objects(
                    base, encoded.files, objects, members, self.checksum
                )
            total = sum(f.size for f in encoded.files)
            if report is not None:
                report(0, total)
            sums = upload_encoded(
                self._store, prefix, encoded.files, objects, members, self.checksum
            )
            sums.update(shared)
            if report is not None:
                report(total, total)
            record = layout.CommitRecord(
                commit_version=layout.record_version(objects),
                step=step,
                attempt=attempt,
                writer=self.id,
                objects=objects,
                locations=locations,
                manifest=encoded.manifest(sums),
            )
            del encoded  # the staged copies of non-contiguous leaves, if any
            check_uploaded(self._store, prefix, objects)
            self._ensure_lock()  # LockError if another writer took the root meanwhile
            try:
                self._store.create(commit, record.to_bytes())
            except FileExistsError:
                with contextlib.suppress(Exception):
                    self._store.rm_tree(prefix)
                raise CommitConflictError(
                    f"{self._store.show(commit)}: another writer committed step {step} while this "
                    "save was uploading; this save was not committed (its data is removed). "
                    "Only one process should save to a root: check for a second trainer.",
                    path=self._store.show(commit),
                    step=step,
                ) from None
            # The step is committed: from here on nothing may make the save look failed.
            try:
                self._apply_retention(just_saved=step)
            except (OSError, TdckptError) as exc:
                # stacklevel, counted from _background.warn: _save_prepared, save, caller.
                # On save_async's thread the warning is kept and issued on the caller's.
                _background.warn(
                    f"{self._store.show(commit)}: step {step} is committed, but applying the "
                    f"retention policy after it failed ({_why(exc)}); older steps it "
                    "would have deleted may still be listed, and data of a deleted record "
                    "is left for gc. Run prune() and gc() (or `tdckpt gc`) again once the "
                    "store answers.",
                    TdckptWarning,
                    stacklevel=3,
                )
        return self._store.show(prefix)

    def _apply_retention(self, *, just_saved: int | None, stacklevel: int = 5) -> list[Path]:
        if type(self.retention) is KeepAll:
            return []  # keeps everything: no listing needed
        with self._state:
            infos = self.step_infos()
            if not infos:
                return []
            keep = set(self.retention.select_to_keep(infos))
            keep.add(infos[-1].step)
            if just_saved is not None:
                keep.add(just_saved)
            keep.update(self._in_use)
            doomed = [i for i in infos if i.step not in keep]
            gone = []
            for info in doomed:
                # the record first: from here on the step is not listed, whatever follows
                self._store.rm_files([layout.commit_name(info.step)])
                gone.append(info)
        if gone:  # incremental hook: keep what the remaining records name
            try:
                committed, damaged, _ = self._scan()
                protect: Protected = protected(self._store, committed, damaged)
            except (OSError, RemoteError):
                protect = ({}, None)  # cannot tell what is named: data left for gc
        for info in gone:
            with contextlib.suppress(OSError, RemoteError):  # else left for gc: no record
                remove_attempt(self._store, self._rel_of(str(info.path)), protect)
        return [info.path for info in gone]  # type: ignore[misc]

    def _rel_of(self, url: str) -> str:
        return url[len(self._store.url) + 1 :]

    def prune(self) -> list[Path]:
        with self._writing:
            self._ensure_lock()
            return self._apply_retention(just_saved=None)

    def gc(self, *, grace_period: float | None = None) -> list[Path]:
        """Delete attempt prefixes that no commit record names and that nothing has written
        to for ``grace_period`` seconds (default an hour: a save may still be uploading);
        return their URLs. Committed steps are never touched, nor any attempt of a step
        whose commit record cannot be read (a newer tdckpt's, a damaged one: it may name
        them); those are reported with a :class:`~tdckpt.warnings.TdckptWarning`. The
        step's record is read again just before an attempt is deleted. Takes the lease."""
        if grace_period is None:
            grace_period = DEFAULT_GRACE_S
        if not grace_period >= 0:
            raise ValueError(f"grace_period must be >= 0 seconds, got {grace_period!r}")
        with self._writing:
            self._ensure_lock()
            committed, damaged, attempts = self._scan()
            named = {layout.attempt_name(s, r.attempt) for s, r in committed.items()}
            keep = protected(self._store, committed, damaged)  # incremental hook
            now = time.time()
            removed = []
            kept: dict[int, list[str]] = {}
            for name in sorted(attempts):
                if name in named:
                    continue
                step = attempts[name][0]
                if step in damaged:
                    # A record this tdckpt cannot read (a newer writer's, a damaged one) may
                    # name any attempt of its step: all of them stay, whatever their age.
                    kept.setdefault(step, []).append(self._store.show(name))
                    continue
                objects = self._store.find(name)
                times = [t for t in (mtime(i) for i in objects.values()) if t is not None]
                if times and now - max(times) < grace_period:
                    continue
                if objects and not times and grace_period > 0:
                    continue  # the store gives no times: its age is unknown, it may be uploading
                if self._named_now(step, name):
                    continue
                if remove_attempt(self._store, name, keep):  # objects others name stay
                    removed.append(self._store.show(name))
        for step, names in sorted(kept.items()):
            _background.warn(
                f"{self._store.show(layout.commit_name(step))}: gc kept {len(names)} attempt(s) "
                f"of step {step} ({shorten(', '.join(names), 300)}): the step's commit record "
                f"cannot be read ({shorten(damaged[step], 300)}), so it may name any of them. "
                "Nothing a record may name is deleted. Read it with a newer tdckpt, or delete "
                "the record and run gc() again if the step is not wanted.",
                TdckptWarning,
                stacklevel=2,
            )
        return removed  # type: ignore[return-value]

    def _named_now(self, step: int, name: str) -> bool:
        """Whether the record of ``step``, read again just before gc deletes ``name``,
        names it or cannot be read (a record committed since gc listed the root)."""
        commit = layout.commit_name(step)
        try:
            data = self._store.cat_capped(commit, layout.MAX_RECORD_BYTES, "commit record")
        except FileNotFoundError:
            return False
        except MetadataError:
            return True
        try:
            record = layout.parse_record(data, self._store.show(commit), step)
        except MetadataError:
            return True
        return layout.attempt_name(step, record.attempt) == name

    # -- verifying and restoring ---------------------------------------------------------
    def _tmp_parent(self) -> str | None:
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            return str(self.cache_dir)
        return _memory_tmp()

    def verify(self, step: int | None = None, *, progress: ProgressArg = None) -> VerifyReport:
        """Read every object of a step from the store and compare each file with the
        manifest (sizes and checksums); nothing is written anywhere but a temporary folder."""
        with progress_bar(progress, "verify") as report:
            return self._verify_remote(step, report)

    def shared_bytes(self) -> dict[int, int]:  # incremental hook
        """As :meth:`CheckpointManager.shared_bytes`: bytes of each step's files that lie
        in objects another committed record names too."""
        from tdckpt._remote.shared import shared_file_bytes

        return shared_file_bytes(self._committed())

    def verify_steps(
        self, steps: list[int] | None = None, *, progress: ProgressArg = None
    ) -> list[VerifyReport]:
        """:meth:`verify` each of ``steps`` (default: every committed step); an object
        several records name (incremental steps) is read once."""
        seen: dict[str, str] = {}  # objects several records name: read once
        with progress_bar(progress, "verify") as report:
            return [
                self._verify_remote(step, report, seen)
                for step in (self.steps() if steps is None else steps)
            ]

    def _verify_remote(
        self, step: int | None, progress: Progress | None, seen: dict[str, str] | None = None
    ) -> VerifyReport:
        if step is not None:
            step = _atomic.check_step(step)
            committed, damaged, _ = self._scan()
            if step in damaged and step not in committed:
                where = self._store.show(layout.commit_name(step))
                return VerifyReport(
                    step=step,
                    path=where,
                    problems=[
                        VerifyProblem(
                            layout.commit_name(step),
                            None,
                            "manifest",
                            "a valid commit record",
                            damaged[step],
                        )
                    ],
                )
        with self._pinned(step) as (resolved, record):
            url = self._url(resolved, record)
            report = VerifyReport(step=resolved, path=url)
            with tempfile.TemporaryDirectory(prefix="tdckpt-verify-", dir=_memory_tmp()) as tmp:
                report.bytes_checked = download_step(
                    self._store,
                    layout.attempt_name(resolved, record.attempt),
                    record,
                    Path(tmp) / "step",
                    step=resolved,
                    progress=progress,
                    report=report,
                    seen=seen,
                )
            return report

    @contextlib.contextmanager
    def _local_copy(self, step: int | None) -> Iterator[tuple[int, Path, str]]:
        """The step downloaded and verified into a local folder, while the block runs."""
        with self._pinned(step) as (resolved, record):
            prefix = layout.attempt_name(resolved, record.attempt)
            url = self._store.show(prefix)
            if self.cache_dir is not None:
                cached = self.cache_dir / prefix
                if cached.is_dir():
                    from tdckpt._manage.verify import verify_files

                    if verify_files(resolved, cached, record.manifest).ok:
                        yield resolved, cached, url
                        return
                    shutil.rmtree(cached, ignore_errors=True)
                part = Path(tempfile.mkdtemp(prefix=f".{prefix}.part-", dir=self._tmp_parent()))
                try:
                    download_step(self._store, prefix, record, part / "step", step=resolved)
                    try:
                        (part / "step").rename(cached)
                    except OSError:  # another restore cached it first
                        if not cached.is_dir():
                            raise
                finally:
                    shutil.rmtree(part, ignore_errors=True)
                yield resolved, cached, url
                return
            tmp = Path(tempfile.mkdtemp(prefix="tdckpt-restore-", dir=self._tmp_parent()))
            try:
                download_step(self._store, prefix, record, tmp / "step", step=resolved)
                yield resolved, tmp / "step", url
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _mode(mode: str | None) -> str:
        if mode == "r+":
            raise ValueError(
                "mode='r+' maps the checkpoint's files shared so writes reach them; a step in "
                "object storage is read into a private copy, so writes could never reach it. "
                "Use mode='r' (default)."
            )
        return "r"

    def restore_into(
        self,
        td: Any,
        step: int | None = None,
        *,
        allow_pickle: bool | None = None,
        mode: Literal["r", "r+"] | None = "r",
        verify: bool = False,
        strict: bool = True,
        device: Any = None,
        keys: Any = None,
        exclude: Any = None,
        report: bool = False,
    ) -> Any:
        """As :meth:`CheckpointManager.restore_into`; checksums are always verified while
        the step is read from the store (``verify`` has nothing left to add)."""
        from tdckpt._restore.engine import _check_args, restore_in_place
        from tdckpt._restore.select import RestoreReport, Selection

        _check_args(True, allow_pickle, mode)
        local_mode = self._mode(mode)
        selection = Selection.of_report(keys, exclude, report, in_place=True)
        if selection is not None and holds_live_objects(td):
            raise NotImplementedError(
                f"{self.root}: keys=, exclude= and report= of restore_into do not apply to "
                "training states yet; restore() a part into a new object."
            )
        if holds_live_objects(td):  # a training state: every entry checked, then restored
            from tdckpt._restore.engine import load_memmap

            with self._local_copy(step) as (resolved, local, url), relabel_warnings(local, url):
                _, record = self._resolve_record(resolved)
                loaded = load_memmap(
                    local, robust_key=True, allow_pickle=allow_pickle, mode=local_mode
                )
                restore_state(
                    td,
                    loaded,
                    record.manifest.state,
                    where=f"{url}: step {resolved}",
                    strict=strict,
                    device=device,
                )
            return td
        if device is not None:
            raise ValueError(
                "device= applies to a training state (a mapping of names to modules, ...); "
                "a TensorDict is restored on the CPU: move it afterwards."
            )
        done = RestoreReport()
        with self._local_copy(step) as (resolved, local, url):
            same_keys = _same_keys(td, url, resolved, selection)

            with relabel_warnings(local, url):
                restore_in_place(
                    td,
                    local,
                    True,
                    allow_pickle=allow_pickle,
                    mode=local_mode,
                    check=same_keys if strict else None,
                    selection=selection,
                    strict=strict,
                    report=done,
                )
        return (td, done) if report else td

    def save_async(
        self,
        step: int,
        state: Any,
        *,
        metadata: dict[str, Any] | None = None,
        replicated: Any = (),
        incremental: bool | None = None,
    ) -> SaveFuture:
        """As :meth:`CheckpointManager.save_async`: ``state`` is copied now (tensors cloned,
        non-tensor values deep-copied); the upload and the conditional commit run on the
        background thread. ``result()`` gives the step's URL."""
        from tdckpt._write.snapshot import detached_copy

        step = _atomic.check_step(step)
        if tuple(replicated):
            raise ValueError(f"{self.root}: replicated= applies to a collective manager.")
        if metadata is not None:
            check_json_data(metadata)
            metadata = copy.deepcopy(metadata)
        incremental = self._wants_incremental(incremental)
        obj, record = self._saveable(state)
        with self._staging_lock:
            self._background.drain(before=f"this save of step {step} started", stacklevel=2)
            with self._writing:
                self._ensure_lock()
                if step in self._committed():
                    where = self._store.show(layout.commit_name(step))
                    raise CheckpointExistsError(
                        f"{where}: step {step} already exists; a committed step is never "
                        "overwritten. Save under another step.",
                        path=where,
                        step=step,
                    )
            answered = self._schedule.save_started()
            snapshot = detached_copy(obj)
            future = self._background.submit(
                step,
                lambda: self._save_prepared(  # type: ignore[arg-type,return-value]
                    step, snapshot, metadata, record, incremental=incremental
                ),
            )
        self._schedule.saved(step, answered)
        return future

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
        """As :meth:`CheckpointManager.restore`, from the store (checksums always verified).

        With ``keys`` / ``exclude`` the whole step is still downloaded (then only the
        selected part is restored).
        """
        from tdckpt._restore.engine import load_memmap

        if rows is not None:
            raise ValueError(
                f"{self.root}: rows= selects rows of a sharded step; sharded steps are saved "
                "to local roots. Restore the whole step and slice it."
            )

        local_mode = self._mode(mode)
        with self._local_copy(step) as (_, local, url), relabel_warnings(local, url):
            return load_memmap(
                local,
                robust_key=True,
                allow_pickle=allow_pickle,
                mode=local_mode,
                keys=keys,
                exclude=exclude,
                strict=strict,
                report=report,
                rename=rename,
                dtype=dtype,
            )
