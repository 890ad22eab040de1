"""Verify a committed step: re-read every file and compare it with the step's manifest.

:func:`verify_files` checksums every file a manifest lists, in a step folder or a ``.tdz``
archive, hashing one chunk on a helper thread while it reads the next, and reports every
missing, short, long, changed (checksum), misplaced (not a regular file) and extra file
with the key it stores, in a :class:`VerifyReport`. It never writes.
:meth:`tdckpt.manager.CheckpointManager.verify` picks the step and keeps retention from
deleting it meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import zipfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tdckpt._keys import decode_key
from tdckpt._manage.steps import ZIP_READ_ERRORS
from tdckpt._report import ProblemKind, VerifyProblem
from tdckpt._write import atomic as _atomic
from tdckpt._write.checksum import CHUNK_BYTES, new_hasher
from tdckpt._write.incremental import note_verified
from tdckpt.schema import MANIFEST_NAME, MAX_MANIFEST_BYTES, LeafChecksumRecord, Manifest

__all__ = [
    "Progress",
    "SharedDigests",
    "VerifyProblem",
    "VerifyReport",
    "manifest_problem",
    "verify_files",
]

Progress = Callable[[int, int], None]


# -- verification reports -----------------------------------------------------------------------


@dataclass
class VerifyReport:
    """Every problem :meth:`~tdckpt.manager.CheckpointManager.verify` found, not just the first.

    Attributes:
        step: the step verified.
        path: its folder or archive.
        problems: every mismatch (empty when ``ok``).
        files_checked: files compared with the manifest.
        bytes_checked: bytes read and checksummed.
        shared_checked: files of this step that other steps share (an incremental save's
            hard links) whose checksum was compared with the one read for another step of
            the same verification (:meth:`~tdckpt.manager.CheckpointManager.verify_steps`)
            instead of being read again; counted in ``files_checked`` too.
    """

    step: int
    path: Path | str  # a URL (str) for a root in object storage
    problems: list[VerifyProblem] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    shared_checked: int = 0

    @property
    def ok(self) -> bool:
        """True when every file matches the manifest and nothing else is there."""
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok

    def summary(self, limit: int = 20) -> str:
        """A human-readable description: one line per problem (at most ``limit``)."""
        if self.ok:
            shared = (
                f", {self.shared_checked} shared files checked once for several steps"
                if self.shared_checked
                else ""
            )
            return (
                f"step {self.step} at {self.path}: OK ({self.files_checked} files, "
                f"{self.bytes_checked} bytes checked{shared})"
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
            **({"shared_checked": self.shared_checked} if self.shared_checked else {}),
            "problems": [
                {**asdict(p), "key": list(p.key) if p.key is not None else None}
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


def manifest_problem(step: int, path: Path, message: str) -> VerifyReport:
    """The report on a step whose manifest is missing or invalid (``message`` says which)."""
    return VerifyReport(
        step=step,
        path=path,
        problems=[
            VerifyProblem(
                path=MANIFEST_NAME,
                key=None,
                kind="manifest",
                expected="a valid tdckpt manifest",
                found=message,
            )
        ],
    )


# -- re-reading a step -------------------------------------------------------------------------


def verify_files(
    step: int,
    path: Path,
    manifest: Manifest,
    progress: Progress | None = None,
    *,
    archive: bool | None = None,
    shared: SharedDigests | None = None,
) -> VerifyReport:
    """Re-read every file of the step at ``path`` (folder or archive) against ``manifest``.

    ``progress`` is called as ``progress(bytes_done, bytes_total)`` while reading.
    ``archive``: whether ``path`` is an archive (None: a ``.tdz`` file is one).
    ``shared``: digests of files with several names (incremental steps' hard links), kept
    across the steps of one verification so that a shared file is read once.
    """
    report = VerifyReport(step=step, path=path)
    hashing = _Hashing(progress, sum(r.size for r in manifest.files))
    if archive is None:
        archive = path.name.endswith(_atomic.ARCHIVE_SUFFIX) and path.is_file()
    try:
        if archive:
            _verify_archive(path, manifest, report, hashing)
        else:
            _verify_dir(path, manifest, report, hashing, shared)
    finally:
        hashing.close()
    report.bytes_checked = hashing.done
    if manifest.step is not None and manifest.step != step:
        # a step folder copied or renamed onto another step's name: its data is not step's
        report.problems.append(
            VerifyProblem(MANIFEST_NAME, None, "manifest", f"step {step}", f"step {manifest.step}")
        )
    return report


#: (device, inode, size, mtime_ns, ctime_ns, algorithm) -> checksum of a file with several
#: names, computed once per verification of several steps.
SharedDigests = dict[tuple[int, int, int, int, int, str], str]


def _verify_dir(
    path: Path,
    manifest: Manifest,
    report: VerifyReport,
    hashing: _Hashing,
    shared: SharedDigests | None = None,
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
            report.problems.append(VerifyProblem(rel, key, "not_a_file", "a regular file", what))
            continue
        report.files_checked += 1
        if st.st_size != record.size:
            report.problems.append(_size_problem(rel, key, record.size, st.st_size))
            continue
        if record.checksum is None:
            continue
        ident = None
        if shared is not None and st.st_nlink > 1:
            ident = (
                st.st_dev,
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
                st.st_ctime_ns,
                _algorithm(record.checksum),
            )
            known = shared.get(ident)
            if known is not None:  # read once already, in another step of this verification
                report.shared_checked += 1
                if known != record.checksum:
                    report.problems.append(
                        VerifyProblem(rel, key, "changed", record.checksum, known)
                    )
                continue
        try:
            fh = _open_regular(path, rel)
        except OSError as exc:
            report.problems.append(VerifyProblem(rel, key, "unreadable", record.checksum, str(exc)))
            continue
        if fh is None:  # swapped for a link, FIFO or device since the walk
            report.problems.append(
                VerifyProblem(rel, key, "not_a_file", "a regular file", "not a regular file")
            )
            continue
        try:
            with fh:
                # a read-only leaf (an incremental save's) found intact is noted: the next
                # incremental save of this process links it unread
                before = os.fstat(fh.fileno()) if not st.st_mode & 0o222 else None
                digest, _ = hashing.digest(fh, _algorithm(record.checksum))
                if before is not None and digest == record.checksum:
                    note_verified(before, digest, os.fstat(fh.fileno()))
        except OSError as exc:
            report.problems.append(VerifyProblem(rel, key, "unreadable", record.checksum, str(exc)))
            continue
        if ident is not None and shared is not None:
            shared[ident] = digest
        if digest != record.checksum:
            report.problems.append(VerifyProblem(rel, key, "changed", record.checksum, digest))
            consolidated = manifest.consolidated
            if consolidated is not None and consolidated.file == rel:
                report.problems += _changed_leaves(path, rel, consolidated.leaves)
            elif getattr(manifest, "layout", None) == "consolidated":
                report.problems += _changed_shard_leaves(path, rel)
    for rel in sorted(set(on_disk) - set(expected) - {MANIFEST_NAME}):
        report.problems.append(
            VerifyProblem(rel, _key_from_path(rel), "extra", None, f"{on_disk[rel].st_size} bytes")
        )


#: The most bytes of a shard's manifest read to name its changed leaves.
_MAX_SHARD_MANIFEST = MAX_MANIFEST_BYTES


def _changed_shard_leaves(path: Path, rel: str) -> list[VerifyProblem]:
    """The leaves of a consolidated shard's data file ``rel`` (in a sharded step) that no
    longer match the per-leaf checksums of that shard's own manifest, named by key (the
    shard's manifest is one of the step's files, so a changed one is reported too)."""
    folder, _, name = rel.rpartition("/")
    if not folder:
        return []
    try:
        fh = _open_regular(path, f"{folder}/{MANIFEST_NAME}")
        if fh is None:
            return []
        with fh:
            data = fh.read(_MAX_SHARD_MANIFEST + 1)
        if len(data) > _MAX_SHARD_MANIFEST:  # not one tdckpt wrote: its own check says so
            return []
        shard = Manifest.model_validate_json(data)
    except (OSError, ValueError):
        return []
    if shard.consolidated is None or shard.consolidated.file != name:
        return []
    return _changed_leaves(path, rel, shard.consolidated.leaves)


def _changed_leaves(path: Path, rel: str, leaves: list[LeafChecksumRecord]) -> list[VerifyProblem]:
    """The leaves of the consolidated data file ``rel`` whose bytes no longer match their
    checksum (after the whole file's did not): each is named by its key."""
    try:
        fh = _open_regular(path, rel)
    except OSError:
        return []
    if fh is None:
        return []
    out = []
    with fh:
        fd = fh.fileno()
        for leaf in leaves:
            if leaf.checksum is None:
                continue
            hasher = new_hasher(_algorithm(leaf.checksum))
            done = 0
            while done < leaf.size:
                chunk = os.pread(fd, min(CHUNK_BYTES, leaf.size - done), leaf.offset + done)
                if not chunk:
                    break
                hasher.update(chunk)
                done += len(chunk)
            digest = f"{_algorithm(leaf.checksum)}:{hasher.hexdigest()}"
            if digest != leaf.checksum:
                out.append(VerifyProblem(rel, tuple(leaf.key), "changed", leaf.checksum, digest))
    return out


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_regular(path: Path, rel: str) -> Any:
    """``path/rel`` opened for reading, component by component, never through a link nor
    blocking (what the walk saw may have been swapped since); None if it is not a file."""
    parts = rel.split("/")
    fds: list[int] = []
    try:
        try:
            fds.append(os.open(path, _DIR_FLAGS))
            for part in parts[:-1]:
                fds.append(os.open(part, _DIR_FLAGS, dir_fd=fds[-1]))
            fd = os.open(
                parts[-1],
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                dir_fd=fds[-1],
            )
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link, or no longer a folder
                return None
            raise
    finally:
        for d in fds:
            os.close(d)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return open(fd, "rb", buffering=0)


def _size_problem(rel: str, key: Any, expected: int, found: int) -> VerifyProblem:
    """A file whose size differs from the manifest's."""
    kind: ProblemKind = "short" if found < expected else "long"
    return VerifyProblem(rel, key, kind, f"{expected} bytes", f"{found} bytes")


def _verify_archive(
    path: Path, manifest: Manifest, report: VerifyReport, hashing: _Hashing
) -> None:
    try:
        zf = zipfile.ZipFile(path)
    except ZIP_READ_ERRORS as exc:
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
                report.problems.append(_size_problem(rel, key, record.size, info.file_size))
                continue
            if record.checksum is None:
                continue
            try:
                with zf.open(info) as fh:  # io.BufferedIOBase.readinto: read(), then a copy
                    digest, _ = hashing.digest(fh, _algorithm(record.checksum))
            except ZIP_READ_ERRORS as exc:
                report.problems.append(
                    VerifyProblem(rel, key, "changed", record.checksum, f"unreadable ({exc})")
                )
                continue
            if digest != record.checksum:
                report.problems.append(VerifyProblem(rel, key, "changed", record.checksum, digest))
        for rel in sorted(set(infos) - set(expected) - {MANIFEST_NAME}):
            report.problems.append(
                VerifyProblem(
                    rel, _key_from_path(rel), "extra", None, f"{infos[rel].file_size} bytes"
                )
            )
