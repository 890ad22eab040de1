"""Upgrade a checkpoint on disk to the current format: staged, crash-safe, with a backup.

``upgrade(prefix)`` runs the read path's stages - storage, metadata, detect, migrate (the
same ``migrations/`` chain as an in-memory read), names, validate - and refuses before
touching the disk when anything is wrong. Then it **materializes** the migrated tree
beside the prefix and swaps it in:

1. a journal ``<prefix>.tdckpt-upgrade.journal`` is created (it is also the lock: one
   upgrade per prefix at a time);
2. the new tree is built in ``<prefix>.tdckpt-upgrade-<id>/``: every ``meta.json`` written
   as tensordict 0.15.3 writes it (stdlib ``json.dumps`` defaults; NonTensorStack
   compact), every leaf file **hard-linked** from the old prefix (no byte is copied or
   read; a copy only where a link is impossible, e.g. across devices, and reported), new
   side files written, tdckpt's manifest last; files and directories fsynced;
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
Re-running on an upgraded prefix is a no-op.

``.tdz`` archives follow the same protocol with files: the entries are streamed out of the
archive into the staging directory, the tree is migrated there and packed by
:func:`tdckpt._archive.write_archive` into ``<prefix>.tdckpt-upgrade-<id>.tdz``; the old
archive is hard-linked to the backup name and the new one ``os.replace``-d onto the prefix.

``dry_run=True`` performs no write at all and returns the very operation list a real run
performs (:attr:`UpgradeReport.operations`). ``convert_pickles=True`` (the user trusts the
data, as with ``allow_pickle=True``) unpickles ``other.pickle``/``pickle.pkl`` and moves
plain JSON data into meta.json; without it nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pickle
import platform
import shutil
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import schema
from ._detect import class_id_for, level_kind
from ._keys import encode_key
from ._migrate import migrate_tree
from ._report import Problem, ValidationReport
from ._storage import Storage, join, open_storage
from ._tree import VDir, VFile, read_tree
from ._version import __version__
from .errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    LockError,
    MigrationError,
    TdckptError,
    UnsafePathError,
    ValidationError,
)

__all__ = ["FileOp", "UpgradeReport", "recover", "upgrade"]

Progress = Callable[[int, int, str], None]

JOURNAL_SUFFIX = ".tdckpt-upgrade.journal"
STAGING_MARK = ".tdckpt-upgrade-"
BACKUP_MARK = ".tdckpt-backup-"
_JOURNAL_VERSION = 1
_COPY_CHUNK = 16 << 20
#: ``_metadata`` entries tensordict 0.5-0.14 pickled by accident (memmap bookkeeping).
_BOOKKEEPING = frozenset({"memmap_prefix", "memmaped", "_share_non_tensor"})
#: errno values for which a hard link is impossible and a copy is made instead.
_NO_LINK = frozenset(
    {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES}
)


@dataclass(frozen=True)
class FileOp:
    """One file-system operation of an upgrade.

    Attributes:
        kind: ``"write-meta"``, ``"link"``, ``"write"``, ``"remove"``, ``"backup"`` or
            ``"swap"``.
        path: for files, the path relative to the prefix in the *new* layout; for
            ``backup``/``swap``/``remove``, the prefix or the backup.
        detail: what is done (the source of a link, the size of a write, ...).
    """

    kind: str
    path: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind:<10} {self.path}" + (f"  ({self.detail})" if self.detail else "")


@dataclass
class UpgradeReport:
    """What an upgrade did (or, with ``dry_run``, would do).

    Attributes:
        prefix: the checkpoint upgraded.
        from_generation, to_generation: layout generations (``"G1"`` .. ``"G8"``).
        steps: migration scripts applied, in order (empty: already current).
        operations: every file operation, in order; a dry run lists the same ones.
        backup: where the old prefix was kept (None: no backup, dry run, or no-op).
        lost: content the writer destroyed (one sentence per key), and keys whose files
            legacy writers put outside the prefix.
        converted_pickles: pickle files whose values moved into meta.json.
        kept_pickles: pickle files left in place, each with the reason.
        copied: files copied because a hard link was impossible.
        problems: warnings and notes met on the way (errors refuse the upgrade).
        dry_run: True when nothing was written.
        recovered: what an interrupted earlier upgrade left, and what was done about it.
    """

    prefix: str
    from_generation: str
    to_generation: str
    steps: list[str] = field(default_factory=list)
    operations: list[FileOp] = field(default_factory=list)
    backup: str | None = None
    lost: list[str] = field(default_factory=list)
    converted_pickles: list[str] = field(default_factory=list)
    kept_pickles: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    dry_run: bool = False
    recovered: str | None = None

    @property
    def changed(self) -> bool:
        """Whether the upgrade rewrote (or would rewrite) the prefix."""
        return bool(self.operations)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["operations"] = [asdict(op) for op in self.operations]
        data["problems"] = [p.to_json() for p in self.problems]
        return data

    def __str__(self) -> str:
        lines = []
        if self.recovered:
            lines.append(f"recovered an interrupted upgrade: {self.recovered}")
        if not self.operations:
            lines.append(f"{self.prefix}: already current ({self.to_generation}); nothing to do.")
        else:
            verb = "would upgrade" if self.dry_run else "upgraded"
            steps = ", ".join(self.steps) if self.steps else "no format step (file names only)"
            lines.append(
                f"{self.prefix}: {verb} {self.from_generation} -> {self.to_generation}: {steps}"
            )
            if self.dry_run:
                lines.extend(f"  {op}" for op in self.operations)
            else:
                lines.append(f"  {len(self.operations)} operations")
            if self.backup:
                lines.append(f"  backup: {self.backup}")
        for what, items in (
            ("lost (by the writer)", self.lost),
            ("pickles converted to JSON", self.converted_pickles),
            ("pickles kept", self.kept_pickles),
            ("copied (no hard link possible)", self.copied),
        ):
            if items:
                lines.append(f"  {what}:")
                lines.extend(f"    - {item}" for item in items)
        for p in self.problems:
            if p.severity != "info":
                lines.append(f"  {p}")
        return "\n".join(lines)


# -- the public function -----------------------------------------------------------------------


def upgrade(
    prefix: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    backup: bool = True,
    convert_pickles: bool = False,
    progress: Progress | None = None,
) -> UpgradeReport:
    """Upgrade a checkpoint on disk to the current format (crash-safe, with a backup).

    Args:
        prefix: a checkpoint directory or ``.tdz`` archive written by any tensordict release.
        dry_run: compute and return the plan; write nothing.
        backup: keep the old tree as ``<prefix>.tdckpt-backup-<time>`` (default). With
            False it is deleted once the new tree is in place.
        convert_pickles: unpickle ``other.pickle``/``pickle.pkl`` (only for trusted data:
            pickle runs code) and store the values that are plain JSON data in meta.json,
            so the checkpoint loads with ``allow_pickle=False``.
        progress: called as ``progress(done, total, what)`` after each operation.

    Returns:
        The report: steps applied, every file operation, the backup, what was lost.

    Raises:
        ValidationError: the checkpoint has problems an upgrade cannot fix (listed);
            nothing was written.
        UnsupportedFormatError: written by a newer tensordict format.
        IncompleteCheckpointError: a dry run found an interrupted upgrade (run without
            ``--dry-run`` to finish it).
        LockError: another upgrade is running in the same directory.

    Example:
        >>> report = upgrade("runs/old_ckpt", dry_run=True)  # doctest: +SKIP
        >>> print(report)  # doctest: +SKIP
    """
    path = Path(prefix)
    if path.is_symlink():
        raise UnsafePathError(
            f"{path}: is a symlink; an upgrade renames the prefix, which would replace the "
            f"link, not the checkpoint. Upgrade the real path ({os.path.realpath(path)}).",
            path=str(path),
        )
    if dry_run:
        return _upgrade_locked(path, dry_run=True, backup=backup, convert=convert_pickles)
    with _upgrade_lock(path):
        return _upgrade_locked(
            path, dry_run=False, backup=backup, convert=convert_pickles, progress=progress
        )


def _upgrade_locked(
    path: Path,
    *,
    dry_run: bool,
    backup: bool,
    convert: bool,
    progress: Progress | None = None,
) -> UpgradeReport:
    recovered = None
    journal = _journal_path(path)
    if journal.exists() or _journal_tmp(path).exists():
        if dry_run:
            raise IncompleteCheckpointError(
                f"{path}: an earlier upgrade was interrupted ({journal.name} exists). Run "
                "`tdckpt upgrade` without --dry-run: it finishes or undoes that upgrade "
                "first, then plans anew.",
                path=str(path),
            )
        recovered = recover(path)
    if not path.exists():
        raise CheckpointNotFoundError(
            f"{path}: no checkpoint here (neither a directory nor a .tdz archive).",
            path=str(path),
        )
    plan = _plan(path, convert_pickles=convert, keep_backup=backup)
    report = plan.report
    report.dry_run = dry_run
    report.recovered = recovered
    if dry_run or not report.operations:
        plan.storage.close()
        return report
    try:
        _execute(plan, keep_backup=backup, progress=progress)
    finally:
        plan.storage.close()
    return report


@contextlib.contextmanager
def _upgrade_lock(prefix: Path) -> Iterator[None]:
    """One upgrade at a time in the prefix's directory (``flock`` on the directory).

    The kernel drops the lock when its holder dies, so a crashed upgrade never blocks the
    re-run that recovers it. Without flock (some network file systems) the journal's
    create-if-absent still refuses a second upgrade of the same prefix.
    """
    parent = prefix.parent if str(prefix.parent) else Path(".")
    try:
        fd = os.open(
            parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
        )
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{prefix}: its directory does not exist.", path=str(prefix)
        ) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise LockError(
                f"{prefix}: another tdckpt upgrade is running in {parent}; wait for it to "
                "finish, then run this one again.",
                path=str(prefix),
            ) from exc
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
        yield
    finally:
        os.close(fd)  # releases the flock


# -- planning ----------------------------------------------------------------------------------


@dataclass
class _Plan:
    prefix: Path
    storage: Storage
    tree: VDir
    report: UpgradeReport
    manifest: bytes = b""
    new_files: list[tuple[str, VFile]] = field(default_factory=list)
    metas: list[tuple[str, bytes]] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)


def _plan(path: Path, *, convert_pickles: bool, keep_backup: bool) -> _Plan:
    from ._names import normalize_names
    from ._validate import build_nodes

    storage = open_storage(path)
    try:
        tree = read_tree(storage)
        old_manifest = _read_old_manifest(storage, tree)
        migrated = migrate_tree(tree, storage=storage)
        names = normalize_names(migrated.tree, robust_key=None, storage=storage)
        tree = names.tree
        problems = [*migrated.problems, *names.problems]
        tree.files.pop(schema.MANIFEST_NAME, None)
        report = UpgradeReport(
            prefix=str(path),
            from_generation=migrated.from_generation,
            to_generation="G8",
            steps=list(migrated.applied),
            lost=[*migrated.lost, *(p.message for p in names.problems if p.code == "lost-key")],
        )
        _pickles(tree, storage, report, convert=convert_pickles)
        _root, more = build_nodes(tree, storage)
        problems += more + _clashes(tree)
        problems = _dedupe(problems)
        errors = [p for p in problems if p.severity == "error"]
        if errors:
            listing = "\n  ".join(str(p) for p in errors)
            raise ValidationError(
                f"{path}: cannot upgrade, nothing was written: {len(errors)} problem"
                f"{'s' if len(errors) != 1 else ''} an upgrade cannot fix:\n  {listing}\n"
                "Fix or restore the files named above (`tdckpt validate` lists everything).",
                path=str(path),
                report=ValidationReport(
                    prefix=str(path),
                    problems=problems,
                    generation=migrated.from_generation,
                    key_encoding=names.encoding,
                ),
            )
        report.problems = [p for p in problems if p.severity != "error"]
        plan = _Plan(path, storage, tree, report)
        lost_keys = any(p.code == "lost-key" for p in names.problems)
        if (
            not report.steps
            and not lost_keys
            and not report.converted_pickles
            and not _renamed(tree)
        ):
            return plan  # already current: no operation
        _layout(plan, old_manifest, migrated.from_generation, keep_backup=keep_backup)
    except BaseException:
        storage.close()
        raise
    return plan


def _clashes(tree: VDir) -> list[Problem]:
    """Names the current layout cannot hold: a directory named like a file of its level."""
    out = []
    for node in tree.walk():
        taken = set(node.files)
        if node.meta is not None:
            taken.add("meta.json")
        for name in sorted(set(node.dirs) & taken):
            out.append(
                Problem(
                    "unrepresentable-key",
                    "error",
                    join(node.source, name),
                    (name,),
                    f"a child collection named {name!r} cannot be written in the current "
                    "layout: its directory would take the name of a file of the same level "
                    "(tensordict >= 0.3 refuses to save it). tdckpt restores it in memory "
                    "(tdckpt.load_memmap); to upgrade on disk, rename the key and save again.",
                )
            )
    return out


def _dedupe(problems: list[Problem]) -> list[Problem]:
    return list(dict.fromkeys(problems))


def _read_old_manifest(storage: Storage, tree: VDir) -> dict[str, Any] | None:
    vfile = tree.files.get(schema.MANIFEST_NAME)
    if vfile is None or vfile.source is None:
        return None
    try:
        raw = storage.read_json(vfile.source)
        return schema.Manifest.model_validate(raw).model_dump(mode="json")
    except Exception:  # a damaged manifest is replaced, not trusted
        return None


def _renamed(tree: VDir) -> bool:
    """Whether any entry of the final tree sits elsewhere than it does on disk."""
    stack: list[tuple[str, VDir]] = [("", tree)]
    while stack:
        rel, node = stack.pop()
        if node.source != rel:
            return True
        for name, vfile in node.files.items():
            if vfile.source != join(rel, name):
                return True
        stack.extend((join(rel, name), sub) for name, sub in node.dirs.items())
    return False


def dump_meta(meta: dict[str, Any]) -> bytes:
    """meta.json bytes exactly as tensordict 0.15.3 writes them (stdlib json defaults)."""
    if level_kind(meta) == "non-tensor-stack":
        return json.dumps(meta, separators=(",", ":")).encode("utf-8")
    return json.dumps(meta).encode("utf-8")


def _layout(
    plan: _Plan, old_manifest: dict[str, Any] | None, from_gen: str, *, keep_backup: bool
) -> None:
    """Fill the plan: directories, meta.json bytes, files, manifest, and the op list."""
    report, storage = plan.report, plan.storage
    ops: list[FileOp] = []
    records: list[schema.FileRecord] = []
    pickles: list[schema.PickleRecord] = []
    archive = storage.kind == "archive"
    keys = _key_paths(plan.tree)
    stack: list[tuple[str, VDir]] = [("", plan.tree)]
    while stack:
        rel, node = stack.pop()
        plan.dirs.append(rel)
        key = keys.get(id(node), ())
        if node.meta is not None:
            data = dump_meta(node.meta)
            where = join(rel, "meta.json")
            plan.metas.append((where, data))
            ops.append(FileOp("write-meta", where, _meta_detail(node.meta)))
            records.append(
                schema.FileRecord(path=where, size=len(data), checksum=_sha(data), key=list(key))
            )
        for name in sorted(node.files):
            vfile = node.files[name]
            where = join(rel, name)
            plan.new_files.append((where, vfile))
            leaf_key = _leaf_key(node, name)
            if vfile.data is not None:
                ops.append(FileOp("write", where, f"new content, {len(vfile.data)} bytes"))
                checksum = _sha(vfile.data)
            elif archive:
                ops.append(FileOp("write", where, f"extract {vfile.source} from the archive"))
                checksum = None
            else:
                ops.append(FileOp("link", where, f"hard link to {vfile.source}"))
                checksum = None
            records.append(
                schema.FileRecord(
                    path=where,
                    size=vfile.size,
                    checksum=checksum,
                    key=[*key, leaf_key] if leaf_key is not None else None,
                )
            )
            if name in ("other.pickle", "pickle.pkl"):
                pickles.append(schema.PickleRecord(key=list(key), file=where, kind=name))  # type: ignore[arg-type]
        for name in sorted(node.dirs, reverse=True):
            stack.append((join(rel, name), node.dirs[name]))
    root_meta = plan.tree.meta or {}
    manifest = schema.Manifest(
        schema_version=schema.MANIFEST_SCHEMA_VERSION,
        format_version=schema.FORMAT_VERSION,
        created=datetime.now(timezone.utc).isoformat(),
        writer=schema.WriterVersions(
            tdckpt=__version__,
            tensordict=None,
            torch=_torch_version(),
            python=platform.python_version(),
        ),
        key_encoding="robust",
        step=(old_manifest or {}).get("step"),
        root_type=class_id_for(root_meta),
        pickles=pickles,
        files=sorted(records, key=lambda r: r.path),
        user_metadata=(old_manifest or {}).get("user_metadata") or {},
        migrated_from=(old_manifest or {}).get("migrated_from") or from_gen,
        migrations=[*((old_manifest or {}).get("migrations") or []), *report.steps],
    )
    plan.manifest = (
        json.dumps(manifest.model_dump(mode="json"), indent=1, allow_nan=False) + "\n"
    ).encode("utf-8")
    ops.append(FileOp("write", schema.MANIFEST_NAME, "tdckpt manifest"))
    prefix = str(plan.prefix)
    if archive:
        ops.append(FileOp("write", prefix, "pack the upgraded tree into a new archive (stored)"))
        ops.append(FileOp("backup", prefix, f"hard link the old archive to {BACKUP_MARK}<time>"))
        ops.append(FileOp("swap", prefix, "replace the archive with the new one (os.replace)"))
    else:
        ops.append(
            FileOp("backup", prefix, f"move the old tree to {plan.prefix.name}{BACKUP_MARK}<time>")
        )
        ops.append(FileOp("swap", prefix, "move the upgraded tree into place"))
    if not keep_backup:
        ops.append(
            FileOp(
                "remove",
                f"{plan.prefix.name}{BACKUP_MARK}<time>",
                "delete the backup (backup=False)",
            )
        )
    report.operations = ops


def _meta_detail(meta: dict[str, Any]) -> str:
    return (
        f"{level_kind(meta)}, format v1"
        if level_kind(meta)
        in (
            "tensordict",
            "lazy-stack",
            "non-tensor-stack",
            "sub-tensordict",
            "lazy-view",
        )
        else level_kind(meta)
    )


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:  # pragma: no cover - torch is a dependency
        return "unknown"


def _key_paths(tree: VDir) -> dict[int, tuple[str, ...]]:
    """``id(VDir)`` -> the nested key it stores (lazy-stack members: their index)."""
    out: dict[int, tuple[str, ...]] = {id(tree): ()}
    stack = [tree]
    while stack:
        node = stack.pop()
        key = out[id(node)]
        names: dict[str, str] = {}
        if node.meta is not None and level_kind(node.meta) == "tensordict":
            for k, v in node.meta.items():
                if isinstance(v, dict) and "type" in v and "dtype" not in v:
                    names[encode_key(k)] = k
        for name, sub in node.dirs.items():
            if name in ("_tensordict", "_source"):
                out[id(sub)] = key
            else:
                out[id(sub)] = (*key, names.get(name, name))
            stack.append(sub)
    return out


def _leaf_key(node: VDir, name: str) -> str | None:
    if node.meta is None or level_kind(node.meta) != "tensordict":
        return None
    for suffix in (".shape.memmap", ".memmap"):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            for k, v in node.meta.items():
                if isinstance(v, dict) and "dtype" in v and encode_key(k) == stem:
                    return k
    return None


# -- pickles -----------------------------------------------------------------------------------


def is_json_data(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` round-trips through JSON unchanged (tuples do not: they are lists).

    >>> is_json_data({"a": [1, 2.5, None, True, "x"]}), is_json_data((1, 2)), is_json_data({1: 2})
    (True, False, False)
    """
    if depth > 500:
        return False
    t = type(value)
    if value is None or t in (str, int, float, bool):
        return True
    if t is list:
        return all(is_json_data(v, depth + 1) for v in value)
    if t is dict:
        return all(type(k) is str and is_json_data(v, depth + 1) for k, v in value.items())
    return False


def _pickles(tree: VDir, storage: Storage, report: UpgradeReport, *, convert: bool) -> None:
    """Convert (``convert``) or inventory every pickle of the tree."""
    for node in tree.walk():
        meta = node.meta
        if meta is None:
            continue
        kind = level_kind(meta)
        name = "pickle.pkl" if kind == "non-tensor-stack" else "other.pickle"
        vfile = node.files.get(name)
        if vfile is None or kind not in ("non-tensor", "tensorclass", "non-tensor-stack"):
            continue
        where = join(node.source, name) if vfile.source is None else vfile.source
        if not convert:
            report.kept_pickles.append(f"{where}: not converted (convert_pickles=False)")
            continue
        reason = _convert_one(node, kind, name, vfile, storage)
        if reason is None:
            report.converted_pickles.append(where)
        else:
            report.kept_pickles.append(f"{where}: {reason}")


def _convert_one(node: VDir, kind: str, name: str, vfile: VFile, storage: Storage) -> str | None:
    """Move a pickle's values into meta.json; return why not, or None when done."""
    meta = node.meta
    assert meta is not None
    try:
        raw = (
            vfile.data
            if vfile.data is not None
            else storage.read_bytes(vfile.source or "", max_bytes=max(vfile.size, 1))
        )
        value = pickle.loads(raw)  # the caller trusts this checkpoint (convert_pickles=True)
    except Exception as exc:
        return f"cannot be unpickled here ({type(exc).__name__}: {exc})"
    if kind == "non-tensor-stack":
        if not is_json_data(value) or not isinstance(value, list):
            return f"holds {_type_of(value)} values, which are not plain JSON data"
        meta["data"] = value
        del node.files[name]
        return None
    if not isinstance(value, dict):
        return f"holds a {_type_of(value)}, expected a dict of fields"
    updates: dict[str, Any] = {}
    for field_name, field_value in value.items():
        if kind == "non-tensor" and field_name == "_metadata":
            field_value = _strip_bookkeeping(field_value)
        if not isinstance(field_name, str) or not is_json_data(field_value):
            return f"{field_name!r} is a {_type_of(field_value)}, not plain JSON data"
        updates[field_name] = field_value
    if kind == "non-tensor":
        order = ["_type", "data", "_metadata", "_is_non_tensor"]
        merged = {**meta, **updates}
        node.meta = {k: merged[k] for k in order if k in merged}
        node.meta.update({k: v for k, v in merged.items() if k not in node.meta})
    else:
        meta.update(updates)
    del node.files[name]
    node.files.pop("json_types.json", None)  # described the pickle, now gone
    return None


def _strip_bookkeeping(value: Any) -> Any:
    if isinstance(value, dict) and value and set(value) & _BOOKKEEPING:
        rest = {k: v for k, v in value.items() if k not in _BOOKKEEPING}
        return rest or None
    return value


def _type_of(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# -- executing ---------------------------------------------------------------------------------


def _journal_path(prefix: Path) -> Path:
    return prefix.parent / f"{prefix.name}{JOURNAL_SUFFIX}"


def _journal_tmp(prefix: Path) -> Path:
    return prefix.parent / f".{prefix.name}{JOURNAL_SUFFIX}.tmp"


def _backup_name(prefix: Path) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = f"{prefix.name}{BACKUP_MARK}{stamp}"
    candidate, n = prefix.parent / base, 1
    while os.path.lexists(candidate):
        candidate = prefix.parent / f"{base}-{n}"
        n += 1
    return candidate


def _write_journal(prefix: Path, state: dict[str, Any], *, create: bool) -> None:
    """Write the journal durably; ``create`` refuses an existing one (the lock)."""
    tmp = _journal_tmp(prefix)
    data = json.dumps(state, indent=1).encode("utf-8")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    journal = _journal_path(prefix)
    if create:
        try:
            os.link(tmp, journal)  # atomic create-if-absent, with the content already there
        except FileExistsError as exc:
            tmp.unlink(missing_ok=True)
            raise IncompleteCheckpointError(
                f"{prefix}: another upgrade holds {journal.name}; wait for it, or run "
                "`tdckpt upgrade` again to finish an interrupted one.",
                path=str(prefix),
            ) from exc
        tmp.unlink()
    else:
        os.replace(tmp, journal)
    _fsync_dir(prefix.parent)


def _read_journal(prefix: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(_journal_path(prefix).read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _remove_journal(prefix: Path) -> None:
    _journal_path(prefix).unlink(missing_ok=True)
    _journal_tmp(prefix).unlink(missing_ok=True)
    _fsync_dir(prefix.parent)


def _fsync_dir(path: Path) -> None:
    from ._atomic import fsync_dir

    fsync_dir(path)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _ino(path: Path) -> list[int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return [st.st_dev, st.st_ino]


def _rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class _Runner:
    """Performs the planned operations in order, reporting each."""

    def __init__(self, plan: _Plan, progress: Progress | None) -> None:
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


def _execute(plan: _Plan, *, keep_backup: bool, progress: Progress | None) -> None:
    prefix = plan.prefix
    archive = plan.storage.kind == "archive"
    token = uuid.uuid4().hex[:12]
    staging = prefix.parent / f"{prefix.name}{STAGING_MARK}{token}"
    new_archive = prefix.parent / f"{prefix.name}{STAGING_MARK}{token}.tdz"
    backup = _backup_name(prefix)
    state: dict[str, Any] = {
        "version": _JOURNAL_VERSION,
        "kind": "archive" if archive else "directory",
        "prefix": prefix.name,
        "staging": staging.name,
        "new_archive": new_archive.name if archive else None,
        "backup": backup.name,
        "keep_backup": keep_backup,
        "phase": "staging",
        "old": _ino(prefix),
        "new": None,
    }
    _write_journal(prefix, state, create=True)
    runner = _Runner(plan, progress)
    try:
        _build_staging(plan, staging, runner)
        if archive:
            from ._archive import write_archive

            write_archive(staging, new_archive, compression="stored", fsync=True)
            runner.step("write")
            state["new"] = _ino(new_archive)
        else:
            state["new"] = _ino(staging)
    except BaseException:
        # Nothing was swapped: the old prefix is untouched. Undo the staging.
        with contextlib.suppress(OSError):
            _rmtree(staging)
            _rmtree(new_archive)
            _remove_journal(prefix)
        raise
    state["phase"] = "staged"
    _write_journal(prefix, state, create=False)
    _swap(prefix, state, runner)
    plan.report.backup = str(backup) if keep_backup else None


def _build_staging(plan: _Plan, staging: Path, runner: _Runner) -> None:
    storage = plan.storage
    archive = storage.kind == "archive"
    staging.mkdir()
    for rel in plan.dirs:
        if rel:
            (staging / rel).mkdir()
    metas = dict(plan.metas)
    files = {rel: vfile for rel, vfile in plan.new_files}
    zf = zipfile.ZipFile(storage.location) if archive else None
    try:
        for op in plan.report.operations:
            if op.kind == "write-meta":
                _write_file(staging / op.path, metas[op.path])
                runner.step("write-meta")
            elif op.kind in ("link", "write") and op.path in files:
                vfile = files[op.path]
                dst = staging / op.path
                if vfile.data is not None:
                    _write_file(dst, vfile.data)
                elif zf is not None:
                    _extract(zf, vfile, dst)
                else:
                    _link(storage, vfile, dst, plan.report)
                runner.step(op.kind)
            elif op.kind == "write" and op.path == schema.MANIFEST_NAME:
                _write_file(staging / schema.MANIFEST_NAME, plan.manifest)
                runner.step("write")
                break
    finally:
        if zf is not None:
            zf.close()
    for rel in reversed(plan.dirs):  # children before parents
        _fsync_dir(staging / rel if rel else staging)
    _fsync_dir(staging.parent)


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _link(storage: Storage, vfile: VFile, dst: Path, report: UpgradeReport) -> None:
    assert vfile.source is not None
    src = storage.physical_path(vfile.source)
    assert src is not None
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
        shutil.copyfile(src, dst)
        report.copied.append(f"{vfile.source}: {os.strerror(exc.errno or 0)}; copied instead")
    _fsync_file(dst)


def _extract(zf: zipfile.ZipFile, vfile: VFile, dst: Path) -> None:
    """Stream one entry out of the archive (bounded memory; CRC checked by zipfile)."""
    assert vfile.source is not None
    with zf.open(vfile.source) as src, open(dst, "xb") as out:
        while True:
            chunk = src.read(_COPY_CHUNK)
            if not chunk:
                break
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())


def _swap(prefix: Path, state: dict[str, Any], runner: _Runner | None) -> None:
    """Put the staged tree in place and the old one at the backup name (idempotent)."""
    parent = prefix.parent
    staging = parent / state["staging"]
    backup = parent / state["backup"]
    old, new = state["old"], state["new"]
    if state["kind"] == "archive":
        new_archive = parent / state["new_archive"]
        if _ino(prefix) == old and _ino(backup) is None:
            os.link(prefix, backup)
            _fsync_dir(parent)
        if runner:
            runner.step("backup")
        if _ino(prefix) == old and _ino(new_archive) == new:
            os.replace(new_archive, prefix)
            _fsync_dir(parent)
        if runner:
            runner.step("swap")
        with contextlib.suppress(OSError):
            _rmtree(staging)
    else:
        from ._atomic import _exchange, rename_noreplace

        if _ino(prefix) == old and _ino(staging) == new:
            if _exchange(staging, prefix):
                _fsync_dir(parent)
            else:
                rename_noreplace(prefix, backup)
                _fsync_dir(parent)
        if runner:
            runner.step("backup")
        if _ino(staging) == old and _ino(backup) is None:
            rename_noreplace(staging, backup)  # after an exchange
            _fsync_dir(parent)
        if _ino(prefix) is None and _ino(staging) == new:
            os.rename(staging, prefix)
            _fsync_dir(parent)
        if runner:
            runner.step("swap")
    if _ino(prefix) != new:
        raise MigrationError(
            f"{prefix}: the upgraded tree could not be put in place (journal "
            f"{_journal_path(prefix).name} kept); run `tdckpt upgrade` again to finish.",
            script=None,
        )
    state["phase"] = "swapped"
    _write_journal(prefix, state, create=False)
    if not state["keep_backup"]:
        if runner:
            runner.step("remove")
        if _ino(backup) == old:
            _rmtree(backup)
            _fsync_dir(parent)
    _remove_journal(prefix)


def recover(prefix: str | os.PathLike[str]) -> str | None:
    """Finish or undo an upgrade of ``prefix`` that was interrupted; describe what was done.

    Reads the journal beside the prefix. Before the staged tree was complete, the staging
    is removed and the old prefix stays. Once it was complete (``staged``), the swap is
    finished: the new tree ends at the prefix and the old one at the backup name. Inodes
    recorded in the journal decide which tree is where, so a re-run after a crash at any
    instant converges. Returns None when there was nothing to recover.
    """
    path = Path(prefix)
    state = _read_journal(path)
    if state is None:
        if _journal_path(path).exists() or _journal_tmp(path).exists():
            # created but never completed: nothing else was done yet
            _remove_journal(path)
            return "an upgrade that had not started writing; its journal was removed"
        return None
    if state.get("version") != _JOURNAL_VERSION or state.get("prefix") != path.name:
        raise IncompleteCheckpointError(
            f"{_journal_path(path)}: an upgrade journal tdckpt cannot read (version "
            f"{state.get('version')!r}); inspect it and remove it by hand.",
            path=str(path),
        )
    parent = path.parent
    staging = parent / str(state["staging"])
    if state.get("phase") == "staging":
        _rmtree(staging)
        if state.get("new_archive"):
            _rmtree(parent / str(state["new_archive"]))
            for tmp in parent.glob(f".{state['new_archive']}.*.tmp"):
                tmp.unlink(missing_ok=True)
        _fsync_dir(parent)
        _remove_journal(path)
        return "an upgrade interrupted while staging: the partial staging was removed"
    try:
        _swap(path, state, None)
    except TdckptError:
        raise
    except OSError as exc:
        raise IncompleteCheckpointError(
            f"{path}: cannot finish the interrupted upgrade recorded in "
            f"{_journal_path(path).name} ({exc}). The old tree is at {path} or "
            f"{parent / str(state['backup'])}.",
            path=str(path),
        ) from exc
    return "an upgrade interrupted after staging: the swap was finished"
