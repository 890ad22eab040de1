"""The read path, one direction: storage -> metadata -> detect -> migrate -> names -> validate.

``open_checkpoint`` runs every stage that can fail before anything is restored and returns
an :class:`OpenedCheckpoint`: the storage (kept open for mapping), the validated node
tree, every problem, and what the checkpoint is (generation, key encoding, migrations
applied, content the writer lost). ``validate``, ``inspect`` and the restore engine all
start here, so they agree on what a checkpoint holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pydantic

from tdckpt import schema
from tdckpt._read.detect import CURRENT_NAME
from tdckpt._read.lane_prune import Pruned
from tdckpt._read.migrate import migrate_tree
from tdckpt._read.names import ROBUST, normalize_names
from tdckpt._read.nodes import Node
from tdckpt._read.opener import open_storage
from tdckpt._read.storage import Storage
from tdckpt._read.tree import VDir, VFile, read_tree
from tdckpt._read.validate import build_nodes
from tdckpt._report import Problem, ValidationReport
from tdckpt.errors import TdckptError

__all__ = ["OpenedCheckpoint", "open_checkpoint", "read_manifest"]


@dataclass
class OpenedCheckpoint:
    """A checkpoint read, migrated in memory and validated (no leaf byte read)."""

    prefix: str
    storage: Storage
    tree: VDir
    root: Node | None
    generation: str
    key_encoding: str
    migrations: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    #: the validated manifest, when the prefix has one
    manifest_model: schema.Manifest | None = None
    #: set when the read left out what a selection does not keep, before validating (the
    #: lane, ``lane_prune.py``): ``root`` is then the selected part only
    pruned: Pruned | None = None

    @property
    def manifest(self) -> dict[str, Any] | None:
        """The manifest as JSON data (dumped on demand: a restore never needs it)."""
        model = self.manifest_model
        return None if model is None else model.model_dump(mode="json")

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    def validation_report(self, problems: list[Problem] | None = None) -> ValidationReport:
        """What reading found (or ``problems``, when a caller found more), as ``tdckpt
        validate`` reports it."""
        return ValidationReport(
            prefix=self.prefix,
            problems=self.problems if problems is None else problems,
            generation=self.generation,
            key_encoding=self.key_encoding,
        )

    def close(self) -> None:
        self.storage.close()


def read_manifest(storage: Storage, tree: VDir) -> tuple[dict[str, Any] | None, list[Problem]]:
    """tdckpt's manifest at the prefix root, validated, when there is one."""
    model, problems = _read_manifest_model(storage, tree)
    return (None if model is None else model.model_dump(mode="json")), problems


def _read_manifest_model(
    storage: Storage, tree: VDir
) -> tuple[schema.Manifest | None, list[Problem]]:
    """:func:`read_manifest` without the dump back to JSON data."""
    vfile = tree.files.get(schema.MANIFEST_NAME)
    if vfile is None or vfile.source is None:
        return None, []
    try:
        raw = storage.read_json(vfile.source)
        model = schema.Manifest.model_validate(raw)
    except TdckptError as exc:
        return None, [Problem("bad-manifest", "error", vfile.source, (), str(exc))]
    except Exception as exc:  # pydantic.ValidationError
        what = schema.explain(exc) if isinstance(exc, pydantic.ValidationError) else str(exc)
        return None, [
            Problem(
                "bad-manifest",
                "error",
                vfile.source,
                (),
                f"does not fit the tdckpt manifest schema ({what}). The file is damaged; "
                "`tdckpt verify` can say more.",
            )
        ]
    if model.schema_version > schema.MANIFEST_SCHEMA_VERSION:
        return None, [
            Problem(
                "unsupported-format",
                "error",
                vfile.source,
                (),
                f"manifest schema version {model.schema_version}, newer than the "
                f"{schema.MANIFEST_SCHEMA_VERSION} this tdckpt reads: upgrade tdckpt.",
            )
        ]
    return model, []


def open_checkpoint(
    prefix: str | os.PathLike[str] | Storage,
    *,
    robust_key: bool | None,
    defer_leaf_sizes: bool = False,
    manifest_checked: bool = False,
) -> OpenedCheckpoint:
    """Run storage -> ... -> validate on ``prefix``; raise only if it is not a checkpoint.

    ``defer_leaf_sizes``: a restore's open. Leaf files are listed without a stat and their
    sizes are checked when they are mapped (a leaf too short is then refused there, and
    ``storage.deferred_size_refused`` says so); everything else is read and validated.
    ``manifest_checked``: the caller (the manager, restoring a step it resolved) has just
    validated the prefix's manifest: it is not read again (``manifest_model`` is None).
    Nothing a restore builds comes from the manifest.

    ``prefix`` may be an opened :class:`Storage` (object storage: see
    ``object_storage.py``); it is read as it is, and closed with the result.
    """
    if isinstance(prefix, Storage):
        storage = prefix
        prefix = storage.location
    else:
        storage = open_storage(prefix, defer_leaf_sizes=defer_leaf_sizes)
    if storage.verbatim_keys:
        robust_key = True  # no file names to decode: every virtual name is the robust one
    prebuilt = storage.validated_root()
    if prebuilt is not None:
        # Validated while the storage checked its own metadata (a consolidated file of
        # TensorDict levels): the tree is already current, robust, and the nodes built.
        tree = VDir(source="", generation=CURRENT_NAME)
        manifest_model = None
        try:
            if not manifest_checked:
                size = storage.listdir("").files.get(schema.MANIFEST_NAME)
                if size is not None:
                    tree.files[schema.MANIFEST_NAME] = VFile(schema.MANIFEST_NAME, size)
                    manifest_model, manifest_problems = _read_manifest_model(storage, tree)
                    if manifest_problems:  # the general read reports them, with the rest
                        prebuilt = None
        except BaseException:
            storage.close()
            raise
        if prebuilt is not None:
            return OpenedCheckpoint(
                prefix=os.fspath(prefix),
                storage=storage,
                tree=tree,
                root=prebuilt,
                generation=CURRENT_NAME,
                key_encoding=ROBUST,
                manifest_model=manifest_model,
            )
    try:
        tree = read_tree(storage)
        manifest: schema.Manifest | None = None
        problems: list[Problem] = []
        if not manifest_checked:
            manifest, problems = _read_manifest_model(storage, tree)
        # Detection runs inside the migration runner (every directory gets its generation).
        migrated = migrate_tree(tree, storage=storage)
        generation = migrated.from_generation
        problems += migrated.problems
        names = normalize_names(migrated.tree, robust_key=robust_key, storage=storage)
        problems += names.problems
        root, more = build_nodes(names.tree, storage)
        problems += more
    except BaseException:
        storage.close()
        raise
    return OpenedCheckpoint(
        prefix=os.fspath(prefix),
        storage=storage,
        tree=names.tree,
        root=root,
        generation=generation,
        key_encoding=names.encoding,
        migrations=list(migrated.applied),
        lost=list(migrated.lost) + [p.message for p in problems if p.code == "lost-key"]
        if problems
        else list(migrated.lost),
        problems=_dedupe(problems) if problems else problems,
        manifest_model=manifest,
    )


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[Problem] = set()
    out = []
    for p in problems:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out
