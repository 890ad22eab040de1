"""``diff``: what differs between two checkpoints, key by key.

Both sides go through the read path (any generation, directory or archive, migrated in
memory), so a checkpoint of tensordict 0.3 and one of 0.15 that hold the same data compare
equal. Keys are compared, not files: a key is *added* or *removed*, or *changed* in its
kind (a tensor that became a sub-tensordict), its class, batch size, dtype, shape, bytes
(tensors) or value (non-tensor data; pickles by their bytes, never unpickled).

Bytes are compared cheaply first: when both sides record a checksum of the same algorithm
for the leaf's file (tdckpt's manifest), the two checksums decide; otherwise both leaves are
mapped read-only and compared byte for byte (``NaN`` equals itself: bytes, not values).
Nothing is written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tdckpt._read.nodes import (
    LazyStackNode,
    LazyViewNode,
    LeafNode,
    Node,
    NonTensorNode,
    NonTensorStackNode,
    SubTensorDictNode,
    TensorClassNode,
    TensorDictNode,
)
from tdckpt._read.pipeline import OpenedCheckpoint, open_checkpoint
from tdckpt._read.storage import MAX_JSON_BYTES
from tdckpt.errors import ValidationError

__all__ = ["DiffEntry", "DiffReport", "diff", "key_text"]

#: Bytes compared per call when two leaves are compared byte for byte.
_CHUNK = 64 << 20


@dataclass(frozen=True)
class DiffEntry:
    """One key that differs between the two checkpoints.

    Attributes:
        key: the nested key (a tuple of strings; a lazy stack's members are ``"0"``, ``"1"``...).
        change: ``"added"`` (only in ``b``), ``"removed"`` (only in ``a``) or ``"changed"``.
        fields: for a change, what differs: among ``"kind"``, ``"class"``, ``"batch_size"``,
            ``"dtype"``, ``"shape"``, ``"bytes"``, ``"value"``.
        a: the key's description in ``a`` (None when added).
        b: the key's description in ``b`` (None when removed).
    """

    key: tuple[str, ...]
    change: str
    fields: tuple[str, ...] = ()
    a: dict[str, Any] | None = None
    b: dict[str, Any] | None = None

    def __str__(self) -> str:
        name = key_text(self.key)
        if self.change == "added":
            return f"+ {name}: {_describe(self.b)}"
        if self.change == "removed":
            return f"- {name}: {_describe(self.a)}"
        return f"~ {name}: {', '.join(self.fields)}: {_describe(self.a)} -> {_describe(self.b)}"

    def to_json(self) -> dict[str, Any]:
        return {
            "key": list(self.key),
            "change": self.change,
            "fields": list(self.fields),
            "a": self.a,
            "b": self.b,
        }


@dataclass
class DiffReport:
    """Every difference between two checkpoints ``a`` and ``b``."""

    a: str
    b: str
    entries: list[DiffEntry] = field(default_factory=list)
    #: keys present on both sides and equal
    unchanged: int = 0
    #: bytes of the leaves that are new or changed in ``b`` (what an incremental save writes)
    changed_bytes: int = 0

    @property
    def equal(self) -> bool:
        """True when both checkpoints hold the same keys, types and data."""
        return not self.entries

    def __bool__(self) -> bool:
        return self.equal

    @property
    def added(self) -> list[DiffEntry]:
        return [e for e in self.entries if e.change == "added"]

    @property
    def removed(self) -> list[DiffEntry]:
        return [e for e in self.entries if e.change == "removed"]

    @property
    def changed(self) -> list[DiffEntry]:
        return [e for e in self.entries if e.change == "changed"]

    def summary(self) -> str:
        return (
            f"{self.a} -> {self.b}: {len(self.added)} added, {len(self.removed)} removed, "
            f"{len(self.changed)} changed, {self.unchanged} unchanged "
            f"({self.changed_bytes} bytes new or changed)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "equal": self.equal,
            "unchanged": self.unchanged,
            "changed_bytes": self.changed_bytes,
            "entries": [e.to_json() for e in self.entries],
        }


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    robust_key: bool | None = None,
) -> DiffReport:
    """Compare two checkpoints (directories or ``.tdz`` archives, any tensordict release).

    Args:
        a: the first (older) checkpoint prefix.
        b: the second (newer) checkpoint prefix.
        robust_key: the key encoding of both (None: decided per directory from the files).

    Returns:
        A :class:`DiffReport`; ``report.equal`` is True when nothing differs.

    Raises:
        tdckpt.errors.ValidationError: either side cannot be read faithfully (its report
            names every problem).
        tdckpt.errors.TdckptError: either side is not a checkpoint.

    Example:
        >>> import tdckpt, tempfile, torch
        >>> from tensordict import TensorDict
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = TensorDict(w=torch.zeros(3), b=torch.ones(2)).memmap(f"{d}/a")
        ...     _ = TensorDict(w=torch.zeros(3), b=torch.ones(2) * 2).memmap(f"{d}/b")
        ...     [str(e) for e in tdckpt.diff(f"{d}/a", f"{d}/b").entries]
        ['~ b: bytes: float32 [2] (8 B) -> float32 [2] (8 B)']
    """
    with _opened(a, robust_key) as left, _opened(b, robust_key) as right:
        report = DiffReport(a=left.prefix, b=right.prefix)
        entries_a = dict(_flatten(left.root, ()))
        entries_b = dict(_flatten(right.root, ()))
        side_a, side_b = _Side(left, _checksums(left)), _Side(right, _checksums(right))
        for key, node_a in entries_a.items():
            node_b = entries_b.get(key)
            if node_b is None:
                report.entries.append(DiffEntry(key, "removed", a=_info(node_a)))
                continue
            fields = _compare(node_a, node_b, side_a, side_b)
            if fields:
                report.entries.append(
                    DiffEntry(key, "changed", tuple(fields), a=_info(node_a), b=_info(node_b))
                )
                if isinstance(node_b, LeafNode):
                    report.changed_bytes += node_b.nbytes
            else:
                report.unchanged += 1
        for key, node_b in entries_b.items():
            if key not in entries_a:
                report.entries.append(DiffEntry(key, "added", b=_info(node_b)))
                if isinstance(node_b, LeafNode):
                    report.changed_bytes += node_b.nbytes
        report.entries.sort(key=lambda e: e.key)
        return report


class _opened:
    """open_checkpoint as a context manager that refuses an unreadable side."""

    def __init__(self, prefix: str | os.PathLike[str], robust_key: bool | None) -> None:
        self.prefix = prefix
        self.robust_key = robust_key
        self.opened: OpenedCheckpoint | None = None

    def __enter__(self) -> OpenedCheckpoint:
        opened = open_checkpoint(self.prefix, robust_key=self.robust_key)
        if opened.errors or opened.root is None:
            opened.close()
            report = opened.validation_report()
            first = report.errors[0] if report.errors else None
            raise ValidationError(
                f"{opened.prefix}: cannot be compared: {len(report.errors)} error(s), the "
                f"first: {first}. Run `tdckpt validate {opened.prefix}` for all of them.",
                report=report,
            )
        self.opened = opened
        return opened

    def __exit__(self, *exc: object) -> None:
        if self.opened is not None:
            self.opened.close()


def _flatten(node: Node | None, key: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Node]]:
    """Every key of the tree with its node, containers before their entries."""
    if node is None:
        return
    yield key, node
    if isinstance(node, TensorDictNode):
        for name, child in node.entries.items():
            yield from _flatten(child, (*key, name))
    elif isinstance(node, TensorClassNode):
        for name, child in node.inner.entries.items():
            yield from _flatten(child, (*key, name))
    elif isinstance(node, LazyStackNode):
        for i, member in enumerate(node.members):
            yield from _flatten(member, (*key, str(i)))
    elif isinstance(node, (SubTensorDictNode, LazyViewNode)):
        # A view is compared by what it shows: its source's entries, under the view's key.
        yield from _flatten(node.source, (*key, "<source>"))


def _kind(node: Node) -> str:
    return {
        LeafNode: "tensor",
        TensorDictNode: "tensordict",
        TensorClassNode: "tensorclass",
        LazyStackNode: "lazy-stack",
        SubTensorDictNode: "sub-tensordict",
        LazyViewNode: "lazy-view",
        NonTensorNode: "non-tensor",
        NonTensorStackNode: "non-tensor-stack",
    }[type(node)]


def _class(node: Node) -> str | None:
    if isinstance(node, TensorClassNode):
        return node.type_str.removeprefix("<class '").removesuffix("'>")
    if isinstance(node, NonTensorNode):
        return node.class_name
    if isinstance(node, LeafNode):
        return "nested" if node.is_nested else None
    return getattr(node, "class_id", None)


def _info(node: Node) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": _kind(node)}
    cls = _class(node)
    if cls is not None:
        info["class"] = cls
    if isinstance(node, LeafNode):
        info["dtype"] = str(node.dtype).removeprefix("torch.")
        info["shape"] = list(node.shape)
        info["nbytes"] = node.nbytes
    batch = getattr(node, "batch_size", None)
    if batch is not None:
        info["batch_size"] = list(batch)
    if isinstance(node, LazyStackNode):
        info["members"] = len(node.members)
    if isinstance(node, NonTensorNode) and node.pickle is None and node.has_data:
        info["value"] = _short(node.data)
    return info


def key_text(key: tuple[str, ...]) -> str:
    """A nested key for people: ``a.b``, or the tuple where a name holds a dot or is empty."""
    if not key:
        return "<root>"
    if any(not part or "." in part for part in key):
        return repr(key)
    return ".".join(key)


def _same_value(x: Any, y: Any) -> bool:
    """Equal stored values (``NaN`` equals itself: a value is compared as it is stored)."""
    if x == y:
        return True
    return _canonical(x) == _canonical(y)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def _short(value: Any, limit: int = 80) -> Any:
    text = repr(value)
    return value if len(text) <= limit else text[: limit - 3] + "..."


def _describe(info: dict[str, Any] | None) -> str:
    if info is None:
        return "-"
    if info["kind"] == "tensor":
        return f"{info['dtype']} {info['shape']} ({info['nbytes']} B)"
    if "value" in info:
        return f"{info['kind']} {info['value']!r}"
    extra = f" batch={info['batch_size']}" if "batch_size" in info else ""
    return f"{info['kind']} {info.get('class') or ''}{extra}".replace("  ", " ")


@dataclass(frozen=True)
class _Side:
    """One checkpoint being compared, with the checksums its manifest records."""

    opened: OpenedCheckpoint
    sums: dict[str, str]


def _compare(a: Node, b: Node, left: _Side, right: _Side) -> list[str]:
    if type(a) is not type(b):
        return ["kind"]
    fields = []
    if _class(a) != _class(b):
        fields.append("class")
    if getattr(a, "batch_size", None) != getattr(b, "batch_size", None):
        fields.append("batch_size")
    if isinstance(a, LeafNode):
        assert isinstance(b, LeafNode)
        if a.dtype != b.dtype:
            fields.append("dtype")
        if a.shape != b.shape:
            fields.append("shape")
        if not fields and not _same_leaf_bytes(a, b, left, right):
            fields.append("bytes")
    elif isinstance(a, LazyStackNode):
        assert isinstance(b, LazyStackNode)
        if (a.stack_dim, len(a.members)) != (b.stack_dim, len(b.members)):
            fields.append("shape")
    elif isinstance(a, (NonTensorNode, NonTensorStackNode)):
        if not _same_value(_value(a, left.opened), _value(b, right.opened)):  # type: ignore[arg-type]
            fields.append("value")
    elif isinstance(a, (SubTensorDictNode, LazyViewNode)) and _view_op(a) != _view_op(b):
        fields.append("value")
    return fields


def _view_op(node: Node) -> Any:
    if isinstance(node, SubTensorDictNode):
        return node.index_json
    return {k: v for k, v in vars(node).items() if k not in ("source", "key", "path")}


def _value(node: NonTensorNode | NonTensorStackNode, opened: OpenedCheckpoint) -> Any:
    """The stored value, or ``("pickle", bytes)`` for a pickled one (never unpickled)."""
    if node.pickle is not None:
        return ("pickle", _file_bytes(opened, node.pickle.source, node.pickle.data))
    if isinstance(node, NonTensorNode):
        return (node.has_data, node.data, node.metadata)
    return node.data


def _file_bytes(opened: OpenedCheckpoint, source: str | None, data: bytes | None) -> bytes:
    if data is not None:
        return data
    assert source is not None
    return opened.storage.read_bytes(source, max_bytes=MAX_JSON_BYTES)


def _checksums(opened: OpenedCheckpoint) -> dict[str, str]:
    """The checksum tdckpt's manifest records for each file (empty without a manifest)."""
    model = opened.manifest_model
    if model is None:
        return {}
    return {r.path: r.checksum for r in model.files if r.checksum is not None}


def _same_leaf_bytes(a: LeafNode, b: LeafNode, left: _Side, right: _Side) -> bool:
    if a.nbytes != b.nbytes:
        return False
    if a.is_nested and not torch.equal(a.sizes, b.sizes):  # type: ignore[arg-type]
        return False
    if a.nbytes == 0:
        return True
    src_a = a.file.source if a.file is not None and a.file.data is None else None
    src_b = b.file.source if b.file is not None and b.file.data is None else None
    if src_a is not None and src_b is not None:
        sum_a, sum_b = left.sums.get(src_a), right.sums.get(src_b)
        if sum_a and sum_b and sum_a.split(":", 1)[0] == sum_b.split(":", 1)[0]:
            return sum_a == sum_b
    bytes_a, bytes_b = _leaf_bytes(a, left.opened), _leaf_bytes(b, right.opened)
    for start in range(0, a.nbytes, _CHUNK):
        if not torch.equal(bytes_a[start : start + _CHUNK], bytes_b[start : start + _CHUNK]):
            return False
    return True


def _leaf_bytes(node: LeafNode, opened: OpenedCheckpoint) -> torch.Tensor:
    """The leaf's data bytes, mapped read-only (copy-on-write), as uint8."""
    assert node.file is not None
    if node.file.data is not None:
        return torch.frombuffer(bytearray(node.file.data[: node.nbytes]), dtype=torch.uint8)
    assert node.file.source is not None
    return opened.storage.map(node.file.source, torch.uint8, node.nbytes, mode="r")
