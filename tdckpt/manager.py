"""``CheckpointManager``: numbered, atomic, verifiable checkpoints of a TensorDict in one root.

A root holds one entry per committed step - ``<root>/<step>/`` (or ``<root>/<step>.tdz``)
in tensordict 0.15.3's format plus ``tdckpt.manifest.json`` - and nothing else that the
manager lists. Every entry is committed by one atomic rename after its files, directories
and manifest are durable (:mod:`tdckpt._atomic`), so a process killed at any instant leaves
every committed step intact; what it leaves half-written is a ``*.tmp-*`` name that is
never listed and that :meth:`CheckpointManager.gc` removes.

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
import stat
import threading
import uuid
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from . import _atomic
from ._keys import decode_key
from ._lock import RootLock
from ._save import CHUNK_BYTES, DEFAULT_CHECKSUM, check_json_data, new_hasher, write_checkpoint
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    IntegrityError,
    MetadataError,
    RestoreError,
)
from .retention import KeepAll, RetentionPolicy, StepInfo, metric_value
from .schema import MANIFEST_NAME, Manifest

__all__ = ["CheckpointManager", "StepStatus", "VerifyProblem", "VerifyReport"]

#: Manifests larger than this are refused (bounded parsing).
_MAX_MANIFEST_BYTES = 256 * 1024 * 1024

ProblemKind = Literal[
    "missing", "short", "long", "changed", "extra", "not_a_file", "manifest", "unreadable"
]
Progress = Callable[[int, int], None]


# -- verification reports -----------------------------------------------------------------------


@dataclass(frozen=True)
class VerifyProblem:
    """One file that does not match the manifest.

    Attributes:
        path: the file, relative to the step (POSIX; ``""`` for the step itself).
        key: the nested key the file stores (lazy-stack members appear as their index,
            a tensorclass's fields under the tensorclass's key), or None if unknown.
        kind: ``"missing"``, ``"short"`` / ``"long"`` (size differs), ``"changed"``
            (checksum differs), ``"extra"`` (not in the manifest), ``"not_a_file"``
            (a directory, symlink or device where a file belongs), ``"manifest"`` (the
            manifest itself is missing or invalid), ``"unreadable"`` (I/O or archive error).
        expected: what the manifest records (size or checksum), if anything.
        found: what is on disk.
    """

    path: str
    key: tuple[str, ...] | None
    kind: ProblemKind
    expected: str | None = None
    found: str | None = None

    def __str__(self) -> str:
        key = f" (key {self.key!r})" if self.key is not None else ""
        detail = ""
        if self.expected is not None or self.found is not None:
            detail = f": expected {self.expected or '-'}, found {self.found or '-'}"
        return f"{self.kind}: {self.path or '.'}{key}{detail}"


@dataclass(frozen=True)
class StepStatus:
    """One entry of a checkpoint root, as ``tdckpt ls`` shows it.

    Attributes:
        step: the step number (None for a leftover whose name carries none).
        path: the folder, archive or leftover.
        kind: ``"dir"``, ``"archive"`` or ``"tmp"``.
        status: ``"committed"``, ``"damaged"`` (unreadable manifest) or ``"incomplete"``.
        size: bytes of the checkpoint's files, from the manifest.
    """

    step: int | None
    path: Path
    kind: str
    status: str
    size: int = 0
    format_version: int | None = None
    key_encoding: str | None = None
    created: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    detail: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": str(self.path),
            "kind": self.kind,
            "status": self.status,
            "size": self.size,
            "format_version": self.format_version,
            "key_encoding": self.key_encoding,
            "created": self.created,
            "metadata": self.metadata,
            "detail": self.detail,
        }


@dataclass
class VerifyReport:
    """What :meth:`CheckpointManager.verify` found: every problem, not just the first.

    Attributes:
        step: the step verified.
        path: its folder or archive.
        problems: every mismatch (empty when ``ok``).
        files_checked: files compared with the manifest.
        bytes_checked: bytes read and checksummed.
    """

    step: int
    path: Path
    problems: list[VerifyProblem] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        """True when every file matches the manifest and nothing else is there."""
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok

    def summary(self, limit: int = 20) -> str:
        """A human-readable description: one line per problem (at most ``limit``)."""
        if self.ok:
            return (
                f"step {self.step} at {self.path}: OK ({self.files_checked} files, "
                f"{self.bytes_checked} bytes checked)"
            )
        lines = [f"step {self.step} at {self.path}: {len(self.problems)} problem(s)"]
        lines += [f"  - {p}" for p in self.problems[:limit]]
        if len(self.problems) > limit:
            lines.append(f"  ... and {len(self.problems) - limit} more")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON data (for the CLI)."""
        return {
            "step": self.step,
            "path": str(self.path),
            "ok": self.ok,
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
            "problems": [
                {
                    "path": p.path,
                    "key": list(p.key) if p.key is not None else None,
                    "kind": p.kind,
                    "expected": p.expected,
                    "found": p.found,
                }
                for p in self.problems
            ],
        }


def _key_from_path(rel: str) -> tuple[str, ...]:
    """The nested key a file of the format belongs to, decoded from its path (for messages)."""
    parts = rel.split("/")
    keys = [decode_key(p) for p in parts[:-1] if p != "_tensordict"]
    name = parts[-1]
    for suffix in (".shape.memmap", ".memmap"):
        if name.endswith(suffix):
            keys.append(decode_key(name[: -len(suffix)]))
            break
    return tuple(keys)


class _Hashing:
    """Checksums files, hashing one chunk on a helper thread while reading the next."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0
        self._pool: ThreadPoolExecutor | None = None
        self._bufs = [bytearray(CHUNK_BYTES), bytearray(CHUNK_BYTES)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _tick(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)

    def digest(self, fh: Any, algorithm: str) -> tuple[str, int]:
        """Checksum what ``fh`` (a binary file object) holds; return it and the byte count."""
        hasher = new_hasher(algorithm)
        size = 0
        pending: Future[None] | None = None
        turn = 0
        try:
            while True:
                buf = self._bufs[turn]
                n = fh.readinto(buf)
                if pending is not None:
                    pending.result()
                    pending = None
                if not n:
                    break
                view = memoryview(buf)[:n]
                if n >= CHUNK_BYTES // 2:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tdckpt-verify")
                    pending = self._pool.submit(hasher.update, view)
                else:
                    hasher.update(view)
                turn ^= 1
                size += n
                self._tick(n)
        finally:
            if pending is not None:
                pending.result()
        return f"{algorithm}:{hasher.hexdigest()}", size


def _algorithm(checksum: str) -> str:
    return checksum.split(":", 1)[0]


# -- the manager --------------------------------------------------------------------------------


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

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        retention: RetentionPolicy | None = None,
        archive: bool = False,
        fsync: bool = True,
        checksum: str = DEFAULT_CHECKSUM,
        compression: str = "stored",
    ) -> None:
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
        self._manifests: dict[Path, tuple[tuple[int, ...], Manifest | MetadataError]] = {}

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
            if self._lock is None:
                if not self.root.is_dir():
                    self.root.mkdir(parents=True, exist_ok=True)
                    if self.fsync:  # the root's own name must survive a crash too
                        _atomic.fsync_dir(self.root.parent)
                lock = RootLock(self.root, manager_id=self.id, fsync=self.fsync)
                # warning -> acquire <- _ensure_lock <- save/gc <- the user's line
                lock.acquire(stacklevel=3)
                self._lock = lock

    # -- manifests and listing -------------------------------------------------------------
    def _manifest(self, path: Path, kind: str) -> Manifest:
        """The manifest of a step entry (cached by file identity). Raises MetadataError."""
        where = path / MANIFEST_NAME if kind == "dir" else path
        try:
            st = os.stat(where, follow_symlinks=False)
        except FileNotFoundError as exc:
            raise MetadataError(
                f"{where}: missing; a step is committed only with its manifest. It was not "
                "written by tdckpt, or it is damaged.",
                path=str(where),
            ) from exc
        if not stat.S_ISREG(st.st_mode):
            raise MetadataError(
                f"{where}: not a regular file (a symlink or directory?); expected the manifest.",
                path=str(where),
            )
        signature = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._state:
            cached = self._manifests.get(path)
        if cached is not None and cached[0] == signature:
            if isinstance(cached[1], MetadataError):
                raise cached[1]
            return cached[1]
        result: Manifest | MetadataError
        try:
            result = Manifest.model_validate_json(self._manifest_bytes(where, kind, st.st_size))
        except MetadataError as exc:
            result = exc
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            result = MetadataError(
                f"{where}: the tdckpt manifest is invalid ({str(exc).splitlines()[0]}); "
                "expected a manifest of schema version 1. The step is damaged or was written "
                "by a newer tdckpt.",
                path=str(where),
            )
        with self._state:
            self._manifests[path] = (signature, result)
        if isinstance(result, MetadataError):
            raise result
        return result

    @staticmethod
    def _manifest_bytes(where: Path, kind: str, size: int) -> bytes:
        if kind == "dir":
            if size > _MAX_MANIFEST_BYTES:
                raise MetadataError(
                    f"{where}: {size} bytes, too large for a manifest.", path=str(where)
                )
            with open(where, "rb") as fh:
                return fh.read(_MAX_MANIFEST_BYTES + 1)
        try:
            with zipfile.ZipFile(where) as zf:
                info = zf.getinfo(MANIFEST_NAME)
                if info.file_size > _MAX_MANIFEST_BYTES:
                    raise MetadataError(
                        f"{where}: its manifest is {info.file_size} bytes, too large.",
                        path=str(where),
                    )
                return zf.read(info)
        except KeyError as exc:
            raise MetadataError(
                f"{where}: the archive holds no {MANIFEST_NAME}; it was not written by tdckpt.",
                path=str(where),
            ) from exc
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise MetadataError(
                f"{where}: not a readable archive ({exc}); it is truncated or damaged.",
                path=str(where),
            ) from exc

    def _entries(self) -> dict[int, dict[str, Path]]:
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

    def _committed(self) -> dict[int, dict[str, tuple[Path, Manifest]]]:
        """Committed steps: step-named entries holding a valid manifest."""
        out: dict[int, dict[str, tuple[Path, Manifest]]] = {}
        for step, forms in self._entries().items():
            for kind, path in forms.items():
                try:
                    manifest = self._manifest(path, kind)
                except MetadataError:
                    continue
                out.setdefault(step, {})[kind] = (path, manifest)
        return out

    def _preferred(self, forms: dict[str, Any]) -> Any:
        first = "archive" if self.archive else "dir"
        return forms[first] if first in forms else next(iter(forms.values()))

    def steps(self) -> list[int]:
        """The committed steps, in increasing order (never a ``*.tmp-*`` or foreign entry)."""
        return sorted(self._committed())

    def latest_step(self) -> int | None:
        """The highest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def _not_found(self, step: int) -> CheckpointNotFoundError:
        steps = self.steps()
        shown = ", ".join(map(str, steps[-10:])) if steps else "none"
        return CheckpointNotFoundError(
            f"{self.root}: no committed step {step} (committed steps: {shown}). Pick one of "
            "steps(), or None for the latest.",
            path=str(self.root),
            step=step,
        )

    def _resolve(self, step: int | None) -> tuple[int, Path, Manifest]:
        committed = self._committed()
        if step is None:
            if not committed:
                raise CheckpointNotFoundError(
                    f"{self.root}: no committed checkpoint yet; save one first (or check the "
                    "root path).",
                    path=str(self.root),
                )
            step = max(committed)
        step = _atomic.check_step(step)
        forms = committed.get(step)
        if forms is None:
            existing = self._entries().get(step)
            if existing:
                path = self._preferred(existing)
                kind = "archive" if path.name.endswith(_atomic.ARCHIVE_SUFFIX) else "dir"
                try:
                    self._manifest(path, kind)
                except MetadataError as exc:
                    raise IncompleteCheckpointError(
                        f"{path}: step {step} is not a committed tdckpt checkpoint: "
                        f"{exc.message} Restore or verify another step (see steps()).",
                        path=str(path),
                        step=step,
                    ) from exc
            raise self._not_found(step)
        path, manifest = self._preferred(forms)
        return step, path, manifest

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
        for step, forms in sorted(self._committed().items()):
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
        for step, forms in sorted(self._committed().items()):
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
        rows: list[StepStatus] = []
        for step, forms in sorted(self._entries().items()):
            for kind, path in sorted(forms.items()):
                try:
                    manifest = self._manifest(path, kind)
                except MetadataError as exc:
                    rows.append(StepStatus(step, path, kind, "damaged", detail=str(exc)))
                    continue
                rows.append(
                    StepStatus(
                        step,
                        path,
                        kind,
                        "committed",
                        size=sum(f.size for f in manifest.files),
                        format_version=manifest.format_version,
                        key_encoding=manifest.key_encoding,
                        created=manifest.created,
                        metadata=dict(manifest.user_metadata),
                    )
                )
        if self.root.is_dir():
            for name in sorted(os.listdir(self.root)):
                if _atomic.is_tmp_name(name):
                    rows.append(
                        StepStatus(_atomic.tmp_step(name), self.root / name, "tmp", "incomplete")
                    )
        return rows

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
            forms = self._entries().get(step, {})
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
        for _, aside in retired:
            _atomic.remove_retired(aside)
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
            entries = self._entries()
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
                    gone = _atomic.recover_or_remove(self.root, name, fsync=self.fsync)
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
                return self._verify(resolved, path, manifest, progress)
        step = _atomic.check_step(step)
        with self._state:
            while step in self._overwriting:
                self._swapped.wait()
            forms = self._entries().get(step)
            if not forms:
                raise self._not_found(step)
            path = self._preferred(forms)
            self._in_use[step] += 1
        try:
            kind = "archive" if path.name.endswith(_atomic.ARCHIVE_SUFFIX) else "dir"
            try:
                manifest = self._manifest(path, kind)
            except MetadataError as exc:
                return VerifyReport(
                    step=step,
                    path=path,
                    problems=[
                        VerifyProblem(
                            path=MANIFEST_NAME,
                            key=None,
                            kind="manifest",
                            expected="a valid tdckpt manifest",
                            found=exc.message,
                        )
                    ],
                )
            return self._verify(step, path, manifest, progress)
        finally:
            with self._state:
                self._in_use[step] -= 1
                if self._in_use[step] <= 0:
                    del self._in_use[step]

    def _verify(
        self, step: int, path: Path, manifest: Manifest, progress: Progress | None
    ) -> VerifyReport:
        report = VerifyReport(step=step, path=path)
        hashing = _Hashing(progress, sum(r.size for r in manifest.files))
        try:
            if path.name.endswith(_atomic.ARCHIVE_SUFFIX) and path.is_file():
                self._verify_archive(path, manifest, report, hashing)
            else:
                self._verify_dir(path, manifest, report, hashing)
        finally:
            hashing.close()
        report.bytes_checked = hashing.done
        return report

    @staticmethod
    def _verify_dir(
        path: Path, manifest: Manifest, report: VerifyReport, hashing: _Hashing
    ) -> None:
        on_disk: dict[str, os.stat_result] = {}
        for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
            base = Path(dirpath)
            for name in [*filenames, *(d for d in dirnames if (base / d).is_symlink())]:
                full = base / name
                with contextlib.suppress(OSError):
                    on_disk[full.relative_to(path).as_posix()] = os.lstat(full)
        expected = {record.path: record for record in manifest.files}
        for rel in sorted(expected):
            record = expected[rel]
            key = tuple(record.key) if record.key is not None else _key_from_path(rel)
            st = on_disk.get(rel)
            if st is None:
                # A record for a directory that is now a file, or vice versa.
                found = "a directory" if (path / rel).is_dir() else None
                kind: ProblemKind = "not_a_file" if found else "missing"
                report.problems.append(VerifyProblem(rel, key, kind, f"{record.size} bytes", found))
                continue
            if not stat.S_ISREG(st.st_mode):
                what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                report.problems.append(
                    VerifyProblem(rel, key, "not_a_file", "a regular file", what)
                )
                continue
            report.files_checked += 1
            if st.st_size != record.size:
                report.problems.append(
                    VerifyProblem(
                        rel,
                        key,
                        "short" if st.st_size < record.size else "long",
                        f"{record.size} bytes",
                        f"{st.st_size} bytes",
                    )
                )
                continue
            if record.checksum is None:
                continue
            try:
                with open(path / rel, "rb", buffering=0) as fh:
                    digest, _ = hashing.digest(fh, _algorithm(record.checksum))
            except OSError as exc:
                report.problems.append(
                    VerifyProblem(rel, key, "unreadable", record.checksum, str(exc))
                )
                continue
            if digest != record.checksum:
                report.problems.append(VerifyProblem(rel, key, "changed", record.checksum, digest))
        for rel in sorted(set(on_disk) - set(expected) - {MANIFEST_NAME}):
            report.problems.append(
                VerifyProblem(
                    rel, _key_from_path(rel), "extra", None, f"{on_disk[rel].st_size} bytes"
                )
            )

    @staticmethod
    def _verify_archive(
        path: Path, manifest: Manifest, report: VerifyReport, hashing: _Hashing
    ) -> None:
        try:
            zf = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            report.problems.append(VerifyProblem("", None, "unreadable", "a zip archive", str(exc)))
            return
        with zf:
            infos = {i.filename: i for i in zf.infolist() if not i.is_dir()}
            expected = {record.path: record for record in manifest.files}
            for rel in sorted(expected):
                record = expected[rel]
                key = tuple(record.key) if record.key is not None else _key_from_path(rel)
                info = infos.get(rel)
                if info is None:
                    report.problems.append(
                        VerifyProblem(rel, key, "missing", f"{record.size} bytes", None)
                    )
                    continue
                report.files_checked += 1
                if info.file_size != record.size:
                    report.problems.append(
                        VerifyProblem(
                            rel,
                            key,
                            "short" if info.file_size < record.size else "long",
                            f"{record.size} bytes",
                            f"{info.file_size} bytes",
                        )
                    )
                    continue
                if record.checksum is None:
                    continue
                try:
                    with zf.open(info) as fh:
                        digest, _ = hashing.digest(_Reader(fh), _algorithm(record.checksum))
                except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
                    report.problems.append(
                        VerifyProblem(rel, key, "changed", record.checksum, f"unreadable ({exc})")
                    )
                    continue
                if digest != record.checksum:
                    report.problems.append(
                        VerifyProblem(rel, key, "changed", record.checksum, digest)
                    )
            for rel in sorted(set(infos) - set(expected) - {MANIFEST_NAME}):
                report.problems.append(
                    VerifyProblem(
                        rel, _key_from_path(rel), "extra", None, f"{infos[rel].file_size} bytes"
                    )
                )

    # -- restoring -------------------------------------------------------------------------
    def _verified(self, step: int, path: Path, manifest: Manifest) -> None:
        report = self._verify(step, path, manifest, None)
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
                ``td``'s keys differ from the checkpoint's; with False, ``td`` takes the
                checkpoint's structure (keys the checkpoint lacks are removed).

        Raises:
            CheckpointNotFoundError: no such step.
            IntegrityError: ``verify=True`` and the step is damaged (every problem listed).
            RestoreError: ``strict=True`` and the keys differ (``.missing``/``.unexpected``).
        """
        from ._restore import load_memmap, load_memmap_

        with self._using(step) as (resolved, path, manifest):
            if verify:
                self._verified(resolved, path, manifest)
            if strict:
                probe = load_memmap(path, robust_key=True, allow_pickle=allow_pickle, mode=mode)
                saved, target = _structure(probe), _structure(td)
                if saved != target:
                    missing = sorted(target - saved)
                    unexpected = sorted(saved - target)
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
            load_memmap_(td, path, True, allow_pickle=allow_pickle, mode=mode)
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
        from ._restore import load_memmap

        with self._using(step) as (resolved, path, manifest):
            if verify:
                self._verified(resolved, path, manifest)
            return load_memmap(path, robust_key=True, allow_pickle=allow_pickle, mode=mode)


def _structure(obj: Any) -> set[tuple[str, ...]]:
    """Every nested key of ``obj`` (inner nodes and leaves; non-tensor data are leaves)."""
    out: set[tuple[str, ...]] = set()

    def walk(node: Any, prefix: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                out.add((*prefix, str(k)))
                walk(v, (*prefix, str(k)))
            return
        try:
            from tensordict import is_leaf_nontensor, is_tensor_collection
        except ImportError:  # pragma: no cover - no tensordict: only dicts and leaves
            return
        if is_tensor_collection(node) and not is_leaf_nontensor(type(node)):
            for key in node.keys(include_nested=True, is_leaf=is_leaf_nontensor):
                out.add((*prefix, *((key,) if isinstance(key, str) else key)))

    walk(obj, ())
    return out


def _show_keys(keys: list[tuple[str, ...]], limit: int = 10) -> str:
    if not keys:
        return "none"
    shown = ", ".join(repr(k if len(k) > 1 else k[0]) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


class _Reader:
    """readinto() over a zipfile entry (ZipExtFile has read(), not an efficient readinto)."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh

    def readinto(self, buf: bytearray) -> int:
        data = self.fh.read(len(buf))
        buf[: len(data)] = data
        return len(data)
