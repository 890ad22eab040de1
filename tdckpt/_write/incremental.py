"""Incremental saves on a local root: a leaf that did not change is not written again.

An incremental save (``CheckpointManager(..., incremental=True)``) compares each leaf it is
about to write with the file of the same path in the latest committed step (the *base*):
when the dtype and shape (from the base's ``meta.json``), the size and the checksum (the
manifest's, of the manager's algorithm, computed over the tensor's bytes at memory speed)
are equal, the new step gets the base's bytes - a reflink (``FICLONE``: a copy-on-write
clone) where the file system has it, else a hard link to the same inode - instead of a
new copy. Every step stays a plain tensordict prefix that ``TensorDict.load_memmap`` reads;
it just shares blocks (reflink) or inodes (hard link) with its neighbours.

**Steps never share mutable bytes.** Leaf files of an incremental save are created
read-only (mode ``0o444``), and only such a file is ever linked again: a file that was
written before (a save without ``incremental``), or made writable since (a restore with
``mode="r+"``, see :func:`unshare_for_write`), may be mapped writable by someone and is
never shared - the leaf is written afresh. Plain tensordict maps a read-only file
copy-on-write, so writes into a loaded step stay in memory. A restore with ``mode="r+"``
first gives each such file of the step a private, writable copy (copy, fsync, rename over
it), so its writes reach that step only. The ``root`` user ignores permission bits: tdckpt's
own restores stay safe (``"r"`` maps copy-on-write, ``"r+"`` breaks the sharing first), but
plain ``TensorDict.load_memmap`` run as root maps a hard-linked file shared and writable,
and its writes then reach every step sharing the file (a reflinked file is its own inode,
safe either way).

**References are counted by the file system.** A hard link is a second name of one inode;
deleting the step that first wrote the bytes (retention, overwrite) removes a name, never
the bytes another step still names. Retention and ``gc`` need no bookkeeping of their own.

**Equality is by checksum.** With the default CRC-32 two different byte strings of one size
have equal checksums with probability 2**-32 per changed leaf; over a very long run of
many leaves that is not negligible, and the stale bytes would be kept. Pass
``checksum="sha256"`` (or ``"sha1"``) to the manager for cryptographic equality.

**A base file is read once per process before it is linked.** The base's manifest says
what its files held when they were written; a file damaged since (bit rot that keeps its
size and modification time) would otherwise be linked into every later step while the
good bytes sit in memory. So a base file is linked only when this process has seen it
hold its checksum: because one of its own saves wrote (or linked) it - noted by file
identity, :func:`remember_files` - or a ``verify`` of its step read it
(:func:`note_verified`), or it was read and hashed before its first link (:func:`holds`;
on the prefetch threads, beside the hashing of the new bytes). A damaged one is written
afresh. The first incremental save after a restart thus reads the base's unchanged leaves
once, as a ``verify`` would (none, after a ``verify`` or a ``restore(verify=True)`` of
that step); the saves after it read nothing.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tdckpt._write.atomic import CREATE_NEW
from tdckpt._write.checksum import CHECKSUM_ALGORITHMS
from tdckpt._write.journal import clone, hash_fd
from tdckpt.schema import MANIFEST_NAME, FileRecord, Manifest

__all__ = [
    "LEAF_MODE",
    "IncrementalBase",
    "IncrementalSave",
    "check_incremental",
    "fault_point",
    "holds",
    "note_verified",
    "remember_files",
    "share_file",
    "shared_bytes",
    "unshare_for_write",
    "writes_reach_files",
]

#: Mode of the leaf files of an incremental save: read-only for everyone.
LEAF_MODE = 0o444


#: Fault injection for the crash tests: called with each stage name ("share": before a leaf
#: is linked from the base, "shared": after). None (always, outside tests) costs one compare.
_fault: Callable[[str], None] | None = None


def fault_point(stage: str) -> None:
    """Report reaching ``stage`` to the crash tests' hook (nothing outside tests)."""
    if _fault is not None:
        _fault(stage)


def _read_only(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and not st.st_mode & 0o222


#: Leaf files this process has seen hold a checksum - written or linked by one of its
#: saves, or read back before their first link: (device, inode, size, mtime in ns) ->
#: ``"<algorithm>:<hex>"``. Bounded: the entries least recently noted go first.
_SEEN: OrderedDict[tuple[int, int, int, int], str] = OrderedDict()
SEEN_MAX = 1 << 18
_SEEN_LOCK = threading.Lock()


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _note(seen: Iterable[tuple[tuple[int, int, int, int], str]]) -> None:
    with _SEEN_LOCK:
        for key, checksum in seen:
            _SEEN[key] = checksum
            _SEEN.move_to_end(key)
        while len(_SEEN) > SEEN_MAX:
            _SEEN.popitem(last=False)


def note_verified(before: os.stat_result, checksum: str, after: os.stat_result) -> None:
    """Note a file just read whole and found to hold ``checksum`` - a ``verify`` of a
    step - when it is a read-only leaf file an incremental save may link and did not change
    while it was read (``before`` / ``after``: its ``fstat`` around the read)."""
    if _read_only(before) and _identity(before) == _identity(after):
        _note([(_identity(before), checksum)])


def remember_files(dest: Path, records: Iterable[FileRecord]) -> None:
    """Note the read-only leaf files an incremental save just wrote or linked into
    ``dest`` as holding their records' checksums (one ``lstat`` each): the next save of
    this process links them without reading them back (:func:`holds`)."""
    seen = []
    for record in records:
        if record.key is None or record.checksum is None:
            continue
        try:
            st = os.lstat(dest / record.path)
        except OSError:
            continue
        if _read_only(st):
            seen.append((_identity(st), record.checksum))
    _note(seen)


def holds(path: Path, checksum: str) -> bool:
    """Whether the regular file ``path`` holds bytes of ``checksum``
    (``"<algorithm>:<hex>"``): known from this process's saves (:func:`remember_files`),
    else read and hashed now, once per file and process. Never follows a link."""
    algorithm = checksum.partition(":")[0]
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        key = _identity(st)
        with _SEEN_LOCK:
            if _SEEN.get(key) == checksum:
                return True
        if not stat.S_ISREG(st.st_mode) or algorithm not in CHECKSUM_ALGORITHMS:
            return False
        # read, not mapped: a file truncated meanwhile must not be a SIGBUS
        found = hash_fd(fd, st.st_size, algorithm, OSError)
        if found != checksum or _identity(os.fstat(fd)) != key:
            return False  # other bytes, or changed while it was read
    except OSError:  # unreadable, or shorter than it was a moment ago
        return False
    finally:
        os.close(fd)
    _note([(key, checksum)])
    return True


@dataclass
class IncrementalBase:
    """The committed step an incremental save compares its leaves with.

    Only a folder step with a plain manifest (not an archive, a sharded or a consolidated
    step) is a base; only its leaf records whose checksum has the save's algorithm count.
    """

    step: int
    path: Path
    records: dict[str, FileRecord]
    #: when the step's manifest was written (its last file): a leaf modified since - by
    #: ``root``, whom the read-only mode does not stop - is never linked
    committed_ns: int = 0
    _meta: dict[str, Any] = field(default_factory=dict)
    #: None: not tried yet; False: this file system refused a reflink (hard links then).
    reflink: bool | None = None
    #: sub-folder -> whether it is a plain folder of the step (:meth:`_plain_folder`)
    _folders: dict[str, bool] = field(default_factory=dict)

    @classmethod
    def of_step(
        cls, step: int, path: Path, manifest: Any, algorithm: str
    ) -> IncrementalBase | None:
        """The base for a save with ``algorithm``, or None when the step cannot be one."""
        if type(manifest) is not Manifest or manifest.consolidated is not None:
            return None
        if not path.is_dir() or path.is_symlink():
            return None
        prefix = f"{algorithm}:"
        records = {
            r.path: r
            for r in manifest.files
            if r.key is not None and r.checksum is not None and r.checksum.startswith(prefix)
        }
        try:
            committed_ns = os.lstat(path / MANIFEST_NAME).st_mtime_ns
        except OSError:
            return None
        if not records:
            return None
        return cls(step=step, path=path, records=records, committed_ns=committed_ns)

    def candidate(self, rel: str, size: int, entry: dict[str, Any] | None) -> FileRecord | None:
        """The base's record of ``rel`` when it may hold the new leaf's bytes: the same size,
        the same dtype and shape in ``meta.json`` (``entry``: the new step's), and a
        read-only regular file (never one that may be mapped writable)."""
        record = self.records.get(rel)
        if record is None or record.size != size:
            return None
        old = _leaf_entry(self._meta, self.path, rel, record.key)
        if (old is None) != (entry is None):
            return None
        fields = ("dtype", "shape", "is_nested")
        if old and entry and any(old.get(f) != entry.get(f) for f in fields):
            return None
        if not self._plain_folder(rel.rpartition("/")[0]):
            return None  # reached through a symlink: maybe outside the root, never linked
        try:
            st = os.lstat(self.path / rel)
        except OSError:
            return None
        if not _read_only(st) or st.st_size != size or st.st_mtime_ns > self.committed_ns:
            return None  # writable, or written after the step was committed: not shared
        return record

    def _plain_folder(self, folder: str) -> bool:
        """Whether the step's ``folder`` is one of its real folders (:func:`_plain_folder`)."""
        return _plain_folder(self.path, folder, self._folders)


def _plain_folder(root: Path, folder: str, cache: dict[str, bool]) -> bool:
    """Whether ``folder`` (relative to the step folder ``root``) is a real folder of the
    step: every component a directory, none a symlink (``lstat`` of a leaf checks only its
    last component, and a symlinked sub-folder leads anywhere). Cached in ``cache``."""
    known = cache.get(folder)
    if known is None:
        known = True
        parts = folder.split("/") if folder else []
        for i in range(len(parts)):
            try:
                st = os.lstat(root.joinpath(*parts[: i + 1]))
            except OSError:
                known = False
                break
            if not stat.S_ISDIR(st.st_mode):  # a symlink, or not a folder at all
                known = False
                break
        cache[folder] = known
    return known


def _leaf_entry(
    cache: dict[str, Any], root: Path | dict[str, bytes], rel: str, key: list[str] | None
) -> dict[str, Any] | None:
    """The leaf's entry in its folder's ``meta.json`` (None when it is not a plain one).

    ``root``: a step folder, or the new step's ``meta.json`` bytes by folder.
    """
    folder = rel.rpartition("/")[0]
    if folder not in cache:
        try:
            if isinstance(root, dict):
                raw = root.get(folder)
                cache[folder] = None if raw is None else json.loads(raw)
            else:
                with open(root / folder / "meta.json", encoding="utf-8") as fh:
                    cache[folder] = json.load(fh)
        except (OSError, ValueError):
            cache[folder] = None
    meta = cache[folder]
    if not isinstance(meta, dict) or not key:
        return None
    entry = meta.get(key[-1])
    return entry if isinstance(entry, dict) and "dtype" in entry else None


@dataclass
class IncrementalSave:
    """One incremental save: its base (None for the first one) and what it shared."""

    base: IncrementalBase | None
    #: paths (relative to the step) whose bytes came from the base, and how
    shared: dict[str, str] = field(default_factory=dict)
    shared_bytes: int = 0
    #: the new step's ``meta.json`` bytes by folder (from the plan), and their parses
    new_meta: dict[str, bytes] = field(default_factory=dict)
    _parsed: dict[str, Any] = field(default_factory=dict)

    def plan_meta(self, ops: Sequence[Any]) -> None:
        """Note the ``meta.json`` bytes the plan writes (for the leaves' dtype and shape).

        Indexes ``ops`` rather than iterating: a staged plan's iteration runs a test hook
        per leaf, meant for the writer's one pass.
        """
        for i in range(len(ops)):
            op = ops[i]
            if (
                op.kind == "bytes"
                and op.data is not None
                and op.rel.rpartition("/")[2] == ("meta.json")
            ):
                self.new_meta[op.rel.rpartition("/")[0]] = op.data

    def candidate(self, rel: str, size: int, key: tuple[str, ...] | None) -> FileRecord | None:
        """The base's record whose file may hold the new leaf ``rel`` (see
        :meth:`IncrementalBase.candidate`); None without a base."""
        if self.base is None:
            return None
        entry = _leaf_entry(self._parsed, self.new_meta, rel, list(key) if key else None)
        return self.base.candidate(rel, size, entry)


#: What ``link`` fails with where a hard link cannot be made: too many links to the file
#: (ext4: 65,000), another file system, links not supported or not permitted.
_NO_LINK = frozenset({errno.EMLINK, errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS})


def share_file(base: IncrementalBase, rel: str, dest: Path, *, fsync: bool) -> str | None:
    """Give ``dest`` (new) the bytes of the base's ``rel``: ``"reflink"`` or ``"link"``;
    None when neither can be made (``dest`` not created: the caller writes the leaf).

    A reflink is tried once per save; where the file system refuses it, hard links follow.
    """
    src = base.path / rel
    fault_point("share")
    if base.reflink is not False:
        if _reflink(src, dest, fsync=fsync):
            base.reflink = True
            fault_point("shared")
            return "reflink"
        base.reflink = False
    try:
        os.link(src, dest, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in _NO_LINK:
            return None
        raise
    fault_point("shared")
    return "link"


def _reflink(src: Path, dest: Path, *, fsync: bool) -> bool:
    sfd = os.open(src, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        dfd = os.open(dest, CREATE_NEW, LEAF_MODE)
        try:
            cloned = clone(dfd, sfd)
            if cloned and fsync:
                os.fsync(dfd)
        except OSError:
            os.close(dfd)
            os.unlink(dest)
            raise
        os.close(dfd)
        if not cloned:
            os.unlink(dest)
    finally:
        os.close(sfd)
    return cloned


def check_incremental(incremental: object, *, where: str, archive: bool, layout: str) -> bool:
    """``incremental`` as a bool, refused (ValueError) where steps cannot share files."""
    if type(incremental) is not bool:
        raise TypeError(f"incremental must be True or False, got {incremental!r}")
    if not incremental:
        return False
    if archive or layout != "memmap":
        what = "archive=True" if archive else f"layout={layout!r}"
        raise ValueError(
            f"{where}: incremental saves share leaf files between step folders of the memmap "
            f"layout; not with {what}. Drop incremental=True, or save plain folders "
            "(archive=False, layout='memmap')."
        )
    return True


def writes_reach_files(mode: str | None) -> bool:
    """Whether a restore in ``mode`` maps files shared and writable: ``"r+"``, and
    tensordict's default (None) for ``root``, whom a read-only mode does not stop."""
    return mode == "r+" or (mode is None and hasattr(os, "geteuid") and os.geteuid() == 0)


def unshare_for_write(path: Path, manifest: Any, *, fsync: bool = True) -> list[str]:
    """Before a ``mode="r+"`` restore of the step at ``path``: give every leaf file that is
    read-only or has other names (another step's) a private, writable copy.

    Each such file is copied beside itself, fsynced, made writable and renamed over its
    name: the step keeps the same bytes (its manifest stays true), the other steps keep the
    old inode, and writes through the restore reach this step only. Returns the paths
    copied (relative to the step). A crash leaves either name complete; at worst an
    ``.tdckpt-unshare-*`` file that ``verify`` reports as extra.
    """
    if type(manifest) is not Manifest or not path.is_dir():
        return []
    done: list[str] = []
    folders: dict[str, bool] = {}
    for record in manifest.files:
        if record.key is None:
            continue
        if not _plain_folder(path, record.path.rpartition("/")[0], folders):
            continue  # reached through a symlink (maybe out of the step): the restore refuses it
        target = path / record.path
        try:
            st = os.lstat(target)
        except OSError:
            continue  # missing: the restore reports it
        if not stat.S_ISREG(st.st_mode):
            continue
        if st.st_nlink <= 1 and st.st_mode & 0o200:
            continue
        tmp = target.with_name(f".{target.name}.tdckpt-unshare-{uuid.uuid4().hex}")
        try:
            src_fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(src_fd, "rb") as src:
                fd = os.open(tmp, CREATE_NEW, 0o666)
                with os.fdopen(fd, "wb") as dst:
                    shutil.copyfileobj(src, dst, 8 << 20)
                    dst.flush()
                    if fsync:
                        os.fsync(dst.fileno())
            os.replace(tmp, target)
        except BaseException:
            with _suppress_os():
                os.unlink(tmp)
            raise
        done.append(record.path)
    if done and fsync:
        from tdckpt._write.atomic import fsync_dir

        for folder in sorted({(path / rel).parent for rel in done}):
            fsync_dir(folder)
    return done


class _suppress_os:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError)


def shared_bytes(steps: Iterable[tuple[int, Path]]) -> dict[int, int]:
    """``step -> bytes of its files that another listed step also names`` (hard links).

    A step's own bytes are its size less these; deleting it frees about its own bytes.
    Reflinked blocks are not visible to ``stat`` and count as own. Steps that are not
    folders are left out.
    """
    files: dict[int, dict[tuple[int, int], int]] = {}
    for step, path in steps:
        if not path.is_dir() or path.is_symlink():
            continue
        inodes: dict[tuple[int, int], int] = {}
        for dirpath, _dirs, names in os.walk(path, followlinks=False):
            for name in names:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                    inodes[(st.st_dev, st.st_ino)] = st.st_size
        files[step] = inodes
    owners: dict[tuple[int, int], int] = {}
    for inodes in files.values():
        for inode in inodes:
            owners[inode] = owners.get(inode, 0) + 1
    return {
        step: sum(size for inode, size in inodes.items() if owners[inode] > 1)
        for step, inodes in files.items()
    }
