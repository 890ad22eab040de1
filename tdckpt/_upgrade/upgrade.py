"""Upgrade a checkpoint on disk to the current format: staged, crash-safe, with a backup.

``upgrade(prefix)`` runs the read path's stages - storage, metadata, detect, migrate (the
same ``migrations/`` chain as an in-memory read), names, validate - and refuses before
touching the disk when anything is wrong. Then it plans the new tree - every ``meta.json``
written as tensordict 0.15.3 writes it (stdlib ``json.dumps`` defaults; NonTensorStack
compact), every leaf's bytes as they are (copied or reflinked, so the backup stays
independent; checksummed), tdckpt's manifest - and the list of file operations
that materialize it beside the prefix and swap it in, crash-safely and with a backup
(:mod:`tdckpt._upgrade.execute` carries the plan out, and finishes or undoes an interrupted
upgrade first). Re-running on an upgraded prefix is a no-op.

``dry_run=True`` performs no write at all and returns the very operation list a real run
performs (:attr:`UpgradeReport.operations`). ``convert_pickles=True`` (the user trusts the
data, as with ``allow_pickle=True``) unpickles ``other.pickle``/``pickle.pkl`` and moves
plain JSON data into meta.json (:mod:`tdckpt._upgrade.convert`); without it nothing is ever
unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tdckpt import schema
from tdckpt._keys import encode_key
from tdckpt._progress import progress_bar
from tdckpt._read.detect import class_id_for, level_kind
from tdckpt._read.migrate import migrate_tree
from tdckpt._read.opener import open_storage
from tdckpt._read.storage import Storage, join
from tdckpt._read.tree import VDir, read_tree
from tdckpt._remote.urls import is_url, require_local_options
from tdckpt._report import Problem, ValidationReport
from tdckpt._upgrade.convert import convert_tree_pickles
from tdckpt._upgrade.execute import execute, recover, write_error
from tdckpt._upgrade.journal import (
    BACKUP_MARK,
    journal_path,
    journal_tmp,
    read_journal,
    upgrade_lock,
)
from tdckpt._upgrade.plan import FileOp, Progress, UpgradePlan, UpgradeReport
from tdckpt._version import __version__
from tdckpt.errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    MetadataError,
    TdckptError,
    UnsafePathError,
    ValidationError,
)

__all__ = ["FileOp", "UpgradeReport", "recover", "upgrade"]


# -- the public function -----------------------------------------------------------------------


def upgrade(
    prefix: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    backup: bool = True,
    convert_pickles: bool = False,
    progress: Progress | bool | None = None,
    storage_options: dict[str, Any] | None = None,
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
        progress: ``True`` draws a progress bar (tqdm, on stderr, only when it is a
            terminal); a callable is called as ``progress(done, total, what)`` after each
            operation.
        storage_options: for an fsspec URL prefix (``s3://...``; ``dry_run=True`` only: the
            plan is computed on a private local copy), the filesystem's options.

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
    if is_url(prefix):
        return _plan_url(
            str(prefix), storage_options, dry_run=dry_run, backup=backup, convert=convert_pickles
        )
    require_local_options(prefix, storage_options)
    path = _prefix_path(prefix)
    if path.is_symlink():
        raise UnsafePathError(
            f"{path}: is a symlink; an upgrade renames the prefix, which would replace the "
            f"link, not the checkpoint. Upgrade the real path ({os.path.realpath(path)}).",
            path=str(path),
        )
    try:
        if dry_run:
            return _upgrade_locked(path, dry_run=True, backup=backup, convert=convert_pickles)
        with upgrade_lock(path), progress_bar(progress, "upgrade", unit="op") as report:
            return _upgrade_locked(
                path, dry_run=False, backup=backup, convert=convert_pickles, progress=report
            )
    except TdckptError:
        raise
    except OSError as exc:  # anything the stages above did not already name
        raise write_error(path, exc) from exc


def _prefix_path(prefix: str | os.PathLike[str]) -> Path:
    """The prefix as a path whose last component names it (``.``, ``..``, ``a/..`` resolved).

    An upgrade renames the prefix and writes beside it, so it needs the prefix's name in
    its parent: ``tdckpt upgrade .`` means the current directory, by its real path.
    """
    path = Path(prefix)
    if path.name in ("", ".", ".."):
        real = Path(os.path.realpath(path))
        if real.parent == real:
            raise UnsafePathError(
                f"{prefix}: is the file-system root, which cannot be renamed; an upgrade "
                "renames the prefix and writes its new tree beside it. Nothing was changed.",
                path=str(prefix),
            )
        return real
    return path


def _upgrade_locked(
    path: Path,
    *,
    dry_run: bool,
    backup: bool,
    convert: bool,
    progress: Progress | None = None,
) -> UpgradeReport:
    recovered = None
    journal = journal_path(path)
    if os.path.lexists(journal) or os.path.lexists(journal_tmp(path)):
        if dry_run:
            read_journal(path)  # a journal tdckpt did not write is refused as such
            with upgrade_lock(path):  # LockError while that upgrade is still running
                pass
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
        execute(plan, keep_backup=backup, progress=progress)
    finally:
        plan.storage.close()
    return report


# -- planning ----------------------------------------------------------------------------------


def _plan_url(
    url: str, storage_options: dict[str, Any] | None, *, dry_run: bool, backup: bool, convert: bool
) -> UpgradeReport:
    """``upgrade(url, dry_run=True)``: the plan, read from object storage in place (its
    metadata only; see ``object_storage.py``). An upgrade that would write is refused."""
    if not dry_run:
        raise MetadataError(
            f"{url}: an upgrade of a checkpoint in object storage is not supported (it would "
            "rewrite objects in place). Download it, run it locally, and upload the result; or "
            "use --dry-run to see the plan.",
            path=url,
        )
    from tdckpt._read.object_open import open_url_storage

    storage = open_url_storage(url, storage_options)
    plan = _plan(Path(url), convert_pickles=convert, keep_backup=backup, storage=storage)
    plan.storage.close()
    plan.report.dry_run = True
    return plan.report


def _plan(
    path: Path, *, convert_pickles: bool, keep_backup: bool, storage: Storage | None = None
) -> UpgradePlan:
    """The upgrade of ``path`` (or of ``storage``, an opened one: messages then name its
    location, a URL, not ``path``)."""
    from tdckpt._read.names import normalize_names
    from tdckpt._read.validate import build_nodes

    if storage is None:
        storage = open_storage(path)
        shown = str(path)
    else:
        shown = storage.location
    try:
        tree = read_tree(storage)
        old_manifest = _read_old_manifest(storage, tree)
        migrated = migrate_tree(tree, storage=storage)
        names = normalize_names(migrated.tree, robust_key=None, storage=storage)
        tree = names.tree
        problems = [*migrated.problems, *names.problems]
        tree.files.pop(schema.MANIFEST_NAME, None)
        report = UpgradeReport(
            prefix=shown,
            from_generation=migrated.from_generation,
            to_generation="G8",
            steps=list(migrated.applied),
            lost=[*migrated.lost, *(p.message for p in names.problems if p.code == "lost-key")],
        )
        report.converted_pickles, report.kept_pickles = convert_tree_pickles(
            tree, storage, convert=convert_pickles
        )
        _root, more = build_nodes(tree, storage)
        problems += more + _clashes(tree)
        problems = _dedupe(problems)
        errors = [p for p in problems if p.severity == "error"]
        if errors:
            listing = "\n  ".join(str(p) for p in errors)
            raise ValidationError(
                f"{shown}: cannot upgrade, nothing was written: {len(errors)} problem"
                f"{'s' if len(errors) != 1 else ''} an upgrade cannot fix:\n  {listing}\n"
                "Fix or restore the files named above (`tdckpt validate` lists everything).",
                path=shown,
                report=ValidationReport(
                    prefix=shown,
                    problems=problems,
                    generation=migrated.from_generation,
                    key_encoding=names.encoding,
                ),
            )
        report.problems = [p for p in problems if p.severity != "error"]
        plan = UpgradePlan(path, storage, tree, report)
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


def _old_checksums(old_manifest: dict[str, Any] | None) -> dict[str, tuple[int, str]]:
    """Old path -> (size, checksum) of each file the old tdckpt manifest checksummed.

    Only algorithms ``verify`` can compute are kept; the size must still match (checked
    by the caller), else the record describes other bytes.
    """
    from tdckpt._write.checksum import CHECKSUM_ALGORITHMS

    out: dict[str, tuple[int, str]] = {}
    for record in (old_manifest or {}).get("files") or []:
        checksum = record.get("checksum")
        if isinstance(checksum, str) and checksum.split(":", 1)[0] in CHECKSUM_ALGORITHMS:
            out[str(record.get("path"))] = (int(record.get("size", -1)), checksum)
    return out


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
    plan: UpgradePlan, old_manifest: dict[str, Any] | None, from_gen: str, *, keep_backup: bool
) -> None:
    """Fill the plan: directories, meta.json bytes, files, manifest, and the op list."""
    report, storage = plan.report, plan.storage
    ops: list[FileOp] = []
    records: list[schema.FileRecord] = []
    pickles: list[schema.PickleRecord] = []
    archive = storage.kind == "archive"
    keys = _key_paths(plan.tree)
    old_sums = _old_checksums(old_manifest)
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
            else:
                checksum = None
                kept = old_sums.get(vfile.source or "")
                if kept is not None and kept[0] == vfile.size:
                    plan.kept_checksums[where] = kept[1]
                if archive:
                    ops.append(FileOp("write", where, f"extract {vfile.source} from the archive"))
                elif keep_backup:
                    plan.copy_bytes += vfile.size
                    ops.append(
                        FileOp(
                            "copy",
                            where,
                            f"copy of {vfile.source} (a reflink where the file system can), "
                            "so that the backup shares no file with the upgraded tree",
                        )
                    )
                else:
                    ops.append(FileOp("link", where, f"hard link to {vfile.source} (no backup)"))
            records.append(
                schema.FileRecord(
                    path=where,
                    size=vfile.size,
                    checksum=checksum,
                    key=[*key, leaf_key] if leaf_key is not None else None,
                )
            )
            if name in ("other.pickle", "pickle.pkl"):
                pickles.append(schema.PickleRecord(key=list(key), file=where, kind=name))
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
        state=(old_manifest or {}).get("state"),
    )
    plan.manifest = manifest  # leaf checksums are filled in as the staging reads the leaves
    ops.append(FileOp("write", schema.MANIFEST_NAME, "tdckpt manifest"))
    prefix = plan.report.prefix  # as the user named it (a URL stays a URL)
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
