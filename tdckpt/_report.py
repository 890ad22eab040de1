"""Problems and the reports that carry them (validation, inspection)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["Inspection", "NodeInfo", "Problem", "ValidationReport", "VerifyProblem"]

Severity = Literal["error", "warning", "info"]
ProblemKind = Literal[
    "missing", "short", "long", "changed", "extra", "not_a_file", "manifest", "unreadable"
]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with (or worth knowing about) a checkpoint.

    Attributes:
        code: a stable identifier, e.g. ``"short-file"``, ``"missing-child"``.
        severity: ``"error"`` makes the checkpoint unrestorable; ``"warning"`` and
            ``"info"`` do not.
        path: the file or directory concerned, relative to the prefix (``""`` = root).
        key: the nested key concerned, as a tuple of strings (empty when none).
        message: what was found, what was expected, what to do.
    """

    code: str
    severity: Severity
    path: str
    key: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        where = self.path or "."
        key = f" [{'.'.join(self.key)}]" if self.key else ""
        return f"{self.severity}: {where}{key}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["key"] = list(self.key)
        return data


class ProblemList:
    """``errors``, ``warnings`` and ``ok`` of a report that holds ``problems``."""

    problems: list[Problem]

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def ok(self) -> bool:
        """True when no problem is an error (nothing prevents a faithful restore)."""
        return not self.errors


@dataclass
class ValidationReport(ProblemList):
    """Every problem found in a checkpoint, all at once."""

    prefix: str
    problems: list[Problem] = field(default_factory=list)
    generation: str | None = None
    key_encoding: str | None = None

    def __bool__(self) -> bool:
        return self.ok

    def to_json(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "ok": self.ok,
            "generation": self.generation,
            "key_encoding": self.key_encoding,
            "problems": [p.to_json() for p in self.problems],
        }


@dataclass
class NodeInfo:
    """One entry of an inspected checkpoint tree."""

    key: tuple[str, ...]
    kind: str  # "tensordict" | "lazy-stack" | "tensorclass" | "leaf" | "non-tensor" | ...
    path: str
    class_name: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    batch_size: list[int] | None = None
    nbytes: int = 0
    pickled: bool = False
    children: list[NodeInfo] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        # Field by field: ``asdict`` would copy every subtree again at every level.
        return {
            "key": list(self.key),
            "kind": self.kind,
            "path": self.path,
            "class_name": self.class_name,
            "dtype": self.dtype,
            "shape": self.shape,
            "batch_size": self.batch_size,
            "nbytes": self.nbytes,
            "pickled": self.pickled,
            "children": [c.to_json() for c in self.children],
        }


@dataclass
class Inspection:
    """What a checkpoint is, read from its metadata only (no leaf byte is read)."""

    prefix: str
    storage: str  # "directory" | "archive"
    generation: str
    format_version: int
    key_encoding: str
    root: NodeInfo
    total_bytes: int
    leaf_count: int
    pickles: list[tuple[str, ...]]
    migrations: list[str]
    lost: list[str]
    manifest: dict[str, Any] | None
    problems: list[Problem]

    def to_json(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "storage": self.storage,
            "generation": self.generation,
            "format_version": self.format_version,
            "key_encoding": self.key_encoding,
            "total_bytes": self.total_bytes,
            "leaf_count": self.leaf_count,
            "pickles": [list(k) for k in self.pickles],
            "migrations": self.migrations,
            "lost": self.lost,
            "manifest": self.manifest,
            "problems": [p.to_json() for p in self.problems],
            "tree": self.root.to_json(),
        }


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
