"""What an upgrade writes and what it reports: the data shared by planning and the journal.

:mod:`tdckpt._upgrade.upgrade` builds an :class:`UpgradePlan` on the read path and
:mod:`tdckpt._upgrade.execute` carries it out; both speak these types, so neither imports
the other for them (imports run one way: upgrade -> execute -> journal -> plan).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tdckpt import schema
from tdckpt._read.storage import Storage
from tdckpt._read.tree import VDir, VFile
from tdckpt._report import Problem

__all__ = ["FileOp", "Progress", "UpgradePlan", "UpgradeReport"]

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class FileOp:
    """One file-system operation of an upgrade.

    Attributes:
        kind: ``"write-meta"``, ``"copy"`` (a leaf, reflinked or copied), ``"link"`` (a
            leaf, hard-linked: no backup is kept), ``"write"``, ``"remove"``, ``"backup"``
            or ``"swap"``.
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
        copied: files copied because a hard link was impossible (``backup=False``).
        copied_bytes: leaf bytes copied into the upgraded tree, so that it shares no file
            with the backup.
        reflinked_bytes: leaf bytes shared copy-on-write (``FICLONE``) instead of copied,
            where the file system can: independent files at no copying cost.
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
    copied_bytes: int = 0
    reflinked_bytes: int = 0
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
            if self.copied_bytes or self.reflinked_bytes:
                lines.append(
                    f"  leaf data: {self.copied_bytes} bytes copied, {self.reflinked_bytes} "
                    "bytes reflinked (the backup shares no file with the upgraded tree)"
                )
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


@dataclass
class UpgradePlan:
    """What an upgrade writes, for :func:`tdckpt._upgrade.execute.execute` to carry out.

    The migrated tree, every ``meta.json`` and new file by its path in the new layout, the
    manifest, the directories (parents first), and the report whose ``operations`` list
    every step in order.
    """

    prefix: Path
    storage: Storage
    tree: VDir
    report: UpgradeReport
    manifest: schema.Manifest | None = None
    new_files: list[tuple[str, VFile]] = field(default_factory=list)
    metas: list[tuple[str, bytes]] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    #: new path -> the checksum the old tdckpt manifest recorded for the same bytes.
    kept_checksums: dict[str, str] = field(default_factory=dict)
    #: leaf bytes the staging copies (a backup is kept) - for the out-of-space message.
    copy_bytes: int = 0

    def manifest_bytes(self, checksums: dict[str, str]) -> bytes:
        """The manifest, with ``checksums`` (new path -> checksum) filled in."""
        assert self.manifest is not None
        files = [
            r.model_copy(update={"checksum": checksums[r.path]})
            if r.checksum is None and r.path in checksums
            else r
            for r in self.manifest.files
        ]
        data = self.manifest.model_copy(update={"files": files}).model_dump(mode="json")
        return (json.dumps(data, indent=1, allow_nan=False) + "\n").encode("utf-8")
