"""The step store of a root in object storage (any fsspec URL): commit records over attempts.

Commit vocabulary on object storage (see :mod:`tdckpt._remote.layout`): an attempt is a
fresh prefix ``<step>.attempt-<id>/`` that nobody lists; its objects are uploaded from memory
(checksums computed on the way) and checked with one listing; commit is the conditional
create of the record ``<step>.tdckpt.json`` naming the attempt - of two writers racing one
step exactly one create succeeds, the other gets a
:class:`~tdckpt.errors.CommitConflictError`. ``overwrite`` is refused: replacing a committed
step needs an atomic swap object stores lack. Retiring deletes the record first (the step
is gone), then its data; gc deletes attempt prefixes no record names once older than a grace
period, and keeps every attempt of a step whose record it cannot read. Incremental steps
(:mod:`tdckpt._remote.shared`): a record may name objects under an earlier step's attempt;
retention and gc delete only the objects of an attempt that no remaining record names.
Exclusive writing: the root's lease (:class:`tdckpt._remote.lease.Lease`).

A step's bytes come to this machine only through
:class:`~tdckpt._read.object_storage.ObjectStorage` (ranged reads, every file checked as it
arrives): a restore reads it in place (:meth:`ObjectStepStore.open`), ``verify`` reads every
file and reports each problem, and a ``cache_dir`` download writes the checked files there.
"""

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
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tdckpt._manage import background as _background
from tdckpt._manage.steps import StepStatus
from tdckpt._manage.verify import Progress, VerifyProblem, VerifyReport
from tdckpt._read.object_open import open_step_storage
from tdckpt._read.object_storage import ObjectStorage
from tdckpt._remote import layout
from tdckpt._remote.lease import DEFAULT_TTL_S, Lease
from tdckpt._remote.shared import Protected, orphaned_objects, protected, remove_attempt
from tdckpt._remote.store import Store, mtime, open_store, shorten
from tdckpt._store.base import Attempt, Capabilities, StepRecord
from tdckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitConflictError,
    IncompleteCheckpointError,
    MetadataError,
    RemoteError,
)
from tdckpt.schema import MANIFEST_NAME, FileRecord, StateRecord
from tdckpt.warnings import TdckptWarning

if TYPE_CHECKING:
    from tdckpt._read.storage import Storage

__all__ = ["DEFAULT_GRACE_S", "ObjectStepStore"]

#: gc leaves an uncommitted attempt alone until it is this old (a save may be uploading).
DEFAULT_GRACE_S = 3600.0

_Scan = tuple[dict[int, layout.CommitRecord], dict[int, str], dict[str, tuple[int, str, Any]]]


class ObjectStepStore:
    """The steps of one object-storage root (see the module docstring).

    Args:
        url: the root (``s3://bucket/run``, ``memory://x``, ...).
        storage_options: passed to fsspec (credentials, ``client_kwargs``...).
        state: the manager's lock guarding the record cache.
        manager_id: the lease's owner and every record's writer.
        checksum: the checksum algorithm of new steps.
        lease_ttl: seconds the writer's lease lasts without renewal.
        cache_dir: where restores keep downloaded steps (default: a temporary folder,
            removed after each restore).

    A :class:`~tdckpt.manager.CheckpointManager` whose root is a URL builds one:

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdckpt import CheckpointManager, KeepLast
        >>> with CheckpointManager("memory://doctest/run", retention=KeepLast(1)) as mgr:
        ...     for step in (1, 2):
        ...         _ = mgr.save(step, TensorDict(w=torch.full((2,), float(step))))
        ...     mgr.steps(), mgr.restore()["w"].tolist(), mgr.store.url
        ([2], [2.0, 2.0], 'memory://doctest/run')
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None,
        state: threading.RLock,
        manager_id: str,
        checksum: str,
        lease_ttl: float | None,
        cache_dir: str | os.PathLike[str] | None,
    ) -> None:
        self.store: Store = open_store(url, storage_options)
        self.root: str = self.store.url
        self.checksum = checksum
        self.capabilities = Capabilities(
            atomic_rename=False,
            file_backed=False,
            collective=False,
            verifies_reads=True,
            archives=False,
        )
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._state = state
        self._id = manager_id
        self._lease = Lease(
            self.store, manager_id, ttl=DEFAULT_TTL_S if lease_ttl is None else lease_ttl
        )
        self._records: dict[str, tuple[tuple[Any, ...], layout.CommitRecord | MetadataError]] = {}
        # the last listing's committed records and damaged steps: retention retires steps
        # it just listed, and keeps what the remaining records name without listing again
        self._last_scan: tuple[dict[int, layout.CommitRecord], dict[int, str]] = ({}, {})

    # -- listing ---------------------------------------------------------------------------
    def _scan(self) -> _Scan:
        """(committed records, damaged steps -> reason, attempt prefixes -> (step, id, info))."""
        committed: dict[int, layout.CommitRecord] = {}
        damaged: dict[int, str] = {}
        attempts: dict[str, tuple[int, str, Any]] = {}
        folders: dict[int, str] = {}
        for entry in self.store.ls(""):
            name = self.store.rel(entry["name"]).rsplit("/", 1)[-1]
            step = layout.parse_commit(name)
            if step is not None and entry.get("type") == "directory":
                # objects under a record's name: not a record tdckpt wrote, but it may be
                # one's remains; like an unreadable record it protects the step's attempts
                folders[step] = (
                    f"{self.store.show(name)}: a prefix of objects where the step's commit "
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
        with self._state:
            self._last_scan = (committed, damaged)
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
        where = self.store.show(name)
        size = entry.get("size")
        if isinstance(size, int) and size > layout.MAX_RECORD_BYTES:
            result = MetadataError(
                f"{where}: {size} bytes, more than {layout.MAX_RECORD_BYTES}, too large for a "
                "commit record; it was not read.",
                path=where,
            )
        else:  # read capped: the object may have grown since it was listed
            read = self._read_record(name, step)
            gone = MetadataError(f"{where}: deleted while being read.", path=where)
            result = gone if read is None else read
        with self._state:
            self._records[name] = (signature, result)
        return result

    def _url(self, step: int, record: layout.CommitRecord) -> str:
        return self.store.show(layout.attempt_name(step, record.attempt))

    def _step(self, step: int, record: layout.CommitRecord) -> StepRecord:
        return StepRecord(step, self._url(step, record), record.manifest, record)

    def records(self) -> dict[int, StepRecord]:
        return {step: self._step(step, r) for step, r in self._scan()[0].items()}

    def resolve(self, step: int | None) -> StepRecord:
        from tdckpt._write.atomic import check_step

        committed, damaged, _ = self._scan()
        if step is None:
            if not committed:
                raise CheckpointNotFoundError(
                    f"{self.root}: no committed checkpoint yet; save one first (or check the URL).",
                    path=self.root,
                )
            step = max(committed)
        step = check_step(step)
        if step in committed:
            return self._step(step, committed[step])
        if step in damaged:
            raise IncompleteCheckpointError(
                f"{self.store.show(layout.commit_name(step))}: step {step} is not a committed "
                f"tdckpt checkpoint: {damaged[step]} Restore or verify another step.",
                path=self.store.show(layout.commit_name(step)),
                step=step,
            )
        shown = ", ".join(map(str, sorted(committed)[-10:])) or "none"
        raise CheckpointNotFoundError(
            f"{self.root}: no committed step {step} (committed steps: {shown}). Pick one of "
            "steps(), or None for the latest.",
            path=self.root,
            step=step,
        )

    def damaged(self, step: int) -> VerifyReport | None:
        committed, damaged, _ = self._scan()
        if step not in damaged or step in committed:
            return None
        return VerifyReport(
            step=step,
            path=self.store.show(layout.commit_name(step)),
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

    def statuses(self) -> list[StepStatus]:
        committed, damaged, attempts = self._scan()
        rows: list[tuple[int, int, StepStatus]] = []
        for step, record in committed.items():
            m = record.manifest
            status = StepStatus(
                step=step,
                path=self._url(step, record),
                kind="remote",
                status="committed",
                size=sum(f.size for f in m.files),
                format_version=m.format_version,
                key_encoding=m.key_encoding,
                created=m.created,
                metadata=copy.deepcopy(m.user_metadata),
            )
            rows.append((step, 0, status))
        for step, reason in damaged.items():
            where = self.store.show(layout.commit_name(step))
            rows.append((step, 1, StepStatus(step, where, "remote", "damaged", detail=reason)))
        named = {layout.attempt_name(s, r.attempt) for s, r in committed.items()}
        for name, (step, _, _) in attempts.items():
            if name in named:
                continue
            if step in damaged:  # an unreadable record may name it: gc keeps it
                detail = "kept by gc: the step's commit record cannot be read and may name it"
                row = StepStatus(step, self.store.show(name), "tmp", "damaged", detail=detail)
            else:
                row = StepStatus(step, self.store.show(name), "tmp", "incomplete")
            rows.append((step, 2, row))
        return [row for _, _, row in sorted(rows, key=lambda r: (r[0], r[1], str(r[2].path)))]

    def exists(self) -> bool:
        return True  # a prefix of an object store exists once anything is under it

    # -- exclusive writing -----------------------------------------------------------------
    def lock(self) -> None:
        with self._state:
            self._lease.renew()

    def unlock(self) -> None:
        with self._state:
            self._lease.release()

    # -- writing ---------------------------------------------------------------------------
    def existing(self, step: int) -> bool:
        return step in self._scan()[0]

    def exists_error(self, step: int) -> CheckpointExistsError:
        where = self.store.show(layout.commit_name(step))
        return CheckpointExistsError(
            f"{where}: step {step} already exists; a committed step is never overwritten. "
            "Save under another step.",
            path=where,
            step=step,
        )

    def commit_point(self, step: int) -> str:
        return self.store.show(layout.commit_name(step))

    def begin(self, step: int, *, overwrite: bool) -> Attempt:
        """A fresh attempt prefix. A committed ``step`` is refused by the conditional create
        of :meth:`commit` (the caller checked :meth:`existing` already: no second listing)."""
        if overwrite:  # the manager refuses it first (no atomic rename); never reached
            raise ValueError(f"{self.root}: overwrite=True is not supported in object storage.")
        attempt = uuid.uuid4().hex
        return Attempt(step, layout.attempt_name(step, attempt), False, pending=attempt)

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
        """Encode ``obj`` in memory, upload it under the attempt prefix, keep its record.

        ``incremental``: an object equal to a whole object of the latest committed step is
        not uploaded; the record refers to it (:mod:`tdckpt._remote.shared`)."""
        from tdckpt._remote.encode import encode_checkpoint
        from tdckpt._remote.shared import share_objects
        from tdckpt._remote.transfer import plan_objects, upload_encoded

        step, prefix = attempt.step, str(attempt.where)
        encoded = encode_checkpoint(
            obj,
            self.store.show(prefix),
            step=step,
            user_metadata=metadata,
            checksum=self.checksum,
            state=state,
        )
        objects, locations, members = plan_objects(
            [FileRecord(path=f.rel, size=f.size) for f in encoded.files]
        )
        shared: dict[str, str] = {}
        if incremental:  # refer to the latest step's equal objects instead of uploading them
            committed = self._scan()[0]
            base = committed[max(committed)] if committed else None
            objects, shared, attempt.listed = share_objects(
                self.store, base, encoded.files, objects, members, self.checksum
            )
        total = sum(f.size for f in encoded.files)
        if progress is not None:
            progress(0, total)
        sums = upload_encoded(self.store, prefix, encoded.files, objects, members, self.checksum)
        sums.update(shared)
        if progress is not None:
            progress(total, total)
        attempt.pending = layout.CommitRecord(
            commit_version=layout.record_version(objects),
            step=step,
            attempt=str(attempt.pending),
            writer=self._id,
            objects=objects,
            locations=locations,
            manifest=encoded.manifest(sums),
        )
        # the staged copies of non-contiguous leaves, if any, go with ``encoded``

    def commit(self, attempt: Attempt, *, stacklevel: int) -> str:
        """Check the upload with one listing, renew the lease, create the record."""
        from tdckpt._remote.transfer import check_uploaded

        step, prefix, record = attempt.step, str(attempt.where), attempt.pending
        assert isinstance(record, layout.CommitRecord), "commit() before write()"
        commit = layout.commit_name(step)
        check_uploaded(self.store, prefix, record.objects, attempt.listed)
        try:
            data = record.to_bytes(self.store.show(commit))
        except MetadataError:  # larger than a reader accepts: never committed
            self.abort(attempt)
            raise
        self.lock()  # LockError if another writer took the root meanwhile
        try:
            self.store.create(commit, data)
        except FileExistsError:
            self.abort(attempt)
            raise CommitConflictError(
                f"{self.store.show(commit)}: another writer committed step {step} while this "
                "save was uploading; this save was not committed (its data is removed). "
                "Only one process should save to a root: check for a second trainer.",
                path=self.store.show(commit),
                step=step,
            ) from None
        return self.store.show(prefix)

    def abort(self, attempt: Attempt) -> None:
        with contextlib.suppress(Exception):
            self.store.rm_tree(str(attempt.where))

    # -- deleting --------------------------------------------------------------------------
    def retire(
        self, records: list[StepRecord]
    ) -> list[tuple[str, Protected, tuple[str, ...] | None]]:
        """Delete each step's commit record (from then on it is not listed); the URLs of
        their attempts, which :meth:`remove` deletes, each with what it must keep: the
        objects the remaining records name (an incremental step refers to an earlier
        step's objects)."""
        if not records:
            return []
        with self._state:
            committed, damaged = self._last_scan
        if any(committed.get(r.step) is not r.handle for r in records):  # not just listed
            committed, damaged, _ = self._scan()
        doomed = {r.step for r in records}
        remaining = {s: r for s, r in committed.items() if s not in doomed}
        try:
            keep: Protected = protected(self.store, remaining, damaged)
        except (OSError, RemoteError):
            keep = ({}, None)  # cannot tell what is named: the data is left for gc
        for record in records:
            self.store.rm_files([layout.commit_name(record.step)])
        out: list[tuple[str, Protected, tuple[str, ...] | None]] = [
            (str(record.where), keep, None) for record in records
        ]
        # An incremental step names objects of earlier attempts: these records may be the
        # last to name some of them, which go too (by name) - else they stayed until gc.
        own = [str(record.where)[len(self.store.url) + 1 :] for record in records]
        handles = [record.handle for record in records]
        for name, orphaned in orphaned_objects(handles, own, remaining, keep):
            out.append((self.store.show(name), keep, orphaned))
        return out

    def remove(self, retired: list[Any], *, stacklevel: int) -> list[Path | str]:
        """Delete the retired attempts' objects that no remaining record names, and the
        objects of earlier attempts only the retired records named; the rest is left for
        gc. Returns the retired steps' URLs."""
        for url, keep, objects in retired:
            rel = url[len(self.store.url) + 1 :]
            with contextlib.suppress(OSError, RemoteError):  # else left for gc: no record
                if objects is None:
                    remove_attempt(self.store, rel, keep)
                else:
                    self.store.rm_files(f"{rel}/{name}" for name in objects)
        return [url for url, _, objects in retired if objects is None]

    def gc(self, grace_period: float | None, *, stacklevel: int) -> list[Path | str]:
        """Delete attempt prefixes that no commit record names and that nothing has written
        to for ``grace_period`` seconds (default an hour: a save may still be uploading).
        Never any attempt of a step whose record cannot be read (a newer tdckpt's, a damaged
        one: it may name them); those are reported with a TdckptWarning. The step's record
        is read again just before an attempt is deleted."""
        if grace_period is None:
            grace_period = DEFAULT_GRACE_S
        committed, damaged, attempts = self._scan()
        named = {layout.attempt_name(s, r.attempt) for s, r in committed.items()}
        keep = protected(self.store, committed, damaged)  # objects other records name
        now = time.time()
        removed: list[Path | str] = []
        kept: dict[int, list[str]] = {}
        for name in sorted(attempts):
            if name in named:
                continue
            step = attempts[name][0]
            if step in damaged:
                # A record this tdckpt cannot read (a newer writer's, a damaged one) may
                # name any attempt of its step: all of them stay, whatever their age.
                kept.setdefault(step, []).append(self.store.show(name))
                continue
            objects = self.store.find(name)
            times = [t for t in (mtime(i) for i in objects.values()) if t is not None]
            if times and now - max(times) < grace_period:
                continue
            if objects and not times and grace_period > 0:
                continue  # the store gives no times: its age is unknown, it may be uploading
            if self._named_now(step, name):
                continue
            if remove_attempt(self.store, name, keep):  # objects others name stay
                removed.append(self.store.show(name))
        for step, names in sorted(kept.items()):
            _background.warn(
                f"{self.store.show(layout.commit_name(step))}: gc kept {len(names)} attempt(s) "
                f"of step {step} ({shorten(', '.join(names), 300)}): the step's commit record "
                f"cannot be read ({shorten(damaged[step], 300)}), so it may name any of them. "
                "Nothing a record may name is deleted. Read it with a newer tdckpt, or delete "
                "the record and run gc() again if the step is not wanted.",
                TdckptWarning,
                stacklevel=stacklevel,
            )
        return removed

    def _named_now(self, step: int, name: str) -> bool:
        """Whether the record of ``step``, read again just before gc deletes ``name``,
        names it or cannot be read (a record committed since gc listed the root)."""
        record = self._read_record(layout.commit_name(step), step)
        if isinstance(record, layout.CommitRecord):
            return layout.attempt_name(step, record.attempt) == name
        return record is not None

    def _read_record(self, name: str, step: int) -> layout.CommitRecord | MetadataError | None:
        """The commit record ``name`` of ``step``, read capped; the error if it cannot be
        read or parsed; None if there is none."""
        try:
            data = self.store.cat_capped(name, layout.MAX_RECORD_BYTES, "commit record")
            return layout.parse_record(data, self.store.show(name), step)
        except FileNotFoundError:
            return None
        except MetadataError as exc:
            return exc

    def shared_bytes(self) -> dict[int, int]:
        """Bytes of each step's files that lie in objects another committed record names."""
        from tdckpt._remote.shared import shared_file_bytes

        return shared_file_bytes(self._scan()[0])

    # -- reading ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def open(self, record: StepRecord, *, writes: bool = False) -> Iterator[Path | Storage]:
        """What a restore reads the step from, while the block runs: the step in the store
        (:func:`~tdckpt._read.object_open.open_step_storage`: ranged reads of only the
        leaves restored, every file checked as it arrives, messages naming the URL), or,
        with ``cache_dir``, its verified copy there (file-backed leaves). Either is private:
        ``writes`` needs nothing more."""
        if self.cache_dir is not None:
            yield self._cached(record, _prefix(record)[0])
            return
        yield self._storage(record)

    def _storage(
        self, record: StepRecord, problems: list[VerifyProblem] | None = None
    ) -> ObjectStorage:
        """The step read where it lies (see :func:`open_step_storage`); an incremental
        step's record may name objects of earlier steps."""
        commit = _prefix(record)[1]
        objects = [commit.object_path(i) for i in range(len(commit.objects))]
        where = str(record.where)
        return open_step_storage(self.store, where, commit, objects, record.step, problems=problems)

    def _cached(self, record: StepRecord, prefix: str) -> Path:
        """The step downloaded once into ``cache_dir`` (re-verified when reused); a damaged
        file is refused naming its URL."""
        from tdckpt._manage.verify import verify_files

        assert self.cache_dir is not None
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        cached = self.cache_dir / prefix
        if cached.is_dir():
            if verify_files(record.step, cached, record.manifest).ok:
                return cached
            shutil.rmtree(cached, ignore_errors=True)
        part = Path(tempfile.mkdtemp(prefix=f".{prefix}.part-", dir=self.cache_dir))
        try:
            problems: list[VerifyProblem] = []
            storage = self._storage(record, problems)
            if problems:
                raise storage.damage(problems[0])
            everything = (f.path for f in record.manifest.files)
            for rel, data in storage.stream(everything, read_ahead=True):
                (part / "step" / rel).parent.mkdir(parents=True, exist_ok=True)
                with open(part / "step" / rel, "xb") as fh:
                    fh.write(data)
            (part / "step" / MANIFEST_NAME).write_bytes(storage.read_bytes(MANIFEST_NAME))
            try:
                (part / "step").rename(cached)
            except OSError:  # another restore cached it first
                if not cached.is_dir():
                    raise
        finally:
            shutil.rmtree(part, ignore_errors=True)
        return cached

    def verify(
        self, record: StepRecord, progress: Progress | None, *, shared: dict[Any, Any] | None = None
    ) -> VerifyReport:
        """Read every object of the step and compare each file with the manifest (sizes
        and checksums), as it is read; nothing is written anywhere. An object gone or
        short is reported from one listing, unread. ``shared``: object -> the checksum read
        for the one file it holds; an object an earlier step of the same verification read
        is not read again (its file is compared with that checksum). A store that fails, or
        ``progress`` raising, stops the verification with that error."""
        report = VerifyReport(step=record.step, path=str(record.where))
        storage = self._storage(record, report.problems)
        spans = {f.path: storage.span(f.path) for f in record.manifest.files}
        files = Counter(s.obj for s in spans.values())
        alone = {s.obj: rel for rel, s in spans.items() if files[s.obj] == 1}  # one file each
        unread = {p.path for p in report.problems}
        total = sum(s.size for s in spans.values())
        for obj, rel in alone.items():
            known = None if shared is None else shared.get(obj)
            if known is None or rel in unread:
                continue
            unread.add(rel)  # read once already, for another step
            report.files_checked += 1
            report.shared_checked += 1
            if known != spans[rel].checksum:
                problem = VerifyProblem(rel, spans[rel].key, "changed", spans[rel].checksum, known)
                report.problems.append(problem)
        wanted = [rel for rel in spans if rel not in unread]
        for rel, _ in storage.stream(wanted, report.problems.append, read_ahead=True):
            span = spans[rel]
            if shared is not None and alone.get(span.obj) == rel and span.checksum is not None:
                shared[span.obj] = span.checksum
            report.files_checked += 1
            report.bytes_checked += span.size
            if progress is not None:
                progress(report.bytes_checked, total)
        return report


def _prefix(record: StepRecord) -> tuple[str, layout.CommitRecord]:
    """The attempt prefix and the commit record of a step this store resolved."""
    commit = record.handle
    assert isinstance(commit, layout.CommitRecord), record
    return layout.attempt_name(record.step, commit.attempt), commit
