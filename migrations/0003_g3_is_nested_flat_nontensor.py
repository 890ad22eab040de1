"""G3 -> G4: ``is_nested`` on every leaf, flat NonTensorData, single-file NonTensorStack.

What changed in tensordict 0.5.0: strided nested tensors arrived (PR #618), so every leaf
entry gained ``"is_nested": false|true`` (a nested leaf adds ``<key>.shape.memmap``);
NonTensorData stopped writing the empty ``_tensordict/`` sub-directory that 0.3-0.4 put
under it (its batch size now comes from the parent); NonTensorStack stopped writing the
vestigial ``0/ 1/ ...`` sub-directories that 0.4.0 left beside its JSON list (PR #711);
and orjson became the JSON writer (compact files, NaN written as ``null``).

What this step does, per G3 directory:

* a leaf entry without ``is_nested`` gets ``"is_nested": false`` (nothing before 0.5
  could write a nested tensor);
* a NonTensorData's ``_tensordict/`` is dropped when it holds only its metadata and its
  batch size is the one the parent provides (or empty). When it records a batch size the
  parent cannot provide (a value with more batch dimensions than its parent, or at the
  root), it is kept: tensordict 0.15.3 still reads it, and nothing is thrown away;
* a NonTensorStack holding its values in meta.json loses its vestigial numeric
  sub-directories (tensordict never read them);
* a tensorclass's JSON fields move from its own meta.json into NonTensorData children of
  its ``_tensordict/``, where 0.5+ stores them (0.15.3 reads both forms; this is the one it
  writes). None-valued fields, fields named like a TensorDict field (``shape``,
  ``device``, ...) and pickled fields (``other.pickle``) stay where they are;
* names stay raw: 0.4 had no other convention.
"""

from __future__ import annotations

from tdckpt._read.migrate import (
    MigrationContext,
    Target,
    VDir,
    entries_of,
    insert_entry,
    level_kind,
)

FROM_VERSION = 3
TO_VERSION = 4

NON_TENSOR_DATA_TYPE = "<class 'tensordict.tensorclass.NonTensorData'>"
_TD_FIELDS = frozenset({"shape", "device", "_type", "_format_version", "_class", "_names"})


def upgrade(tree: VDir, ctx: MigrationContext) -> VDir:
    for target in ctx.targets(tree):
        node = target.node
        if node.meta is None:
            continue
        node.leaf_encoding = node.leaf_encoding or "legacy"
        node.dir_encoding = node.dir_encoding or "legacy"
        kind = level_kind(node.meta)
        if kind == "tensordict":
            leaves, _children = entries_of(node.meta)
            for key in leaves:
                entry = node.meta[key]
                if "dtype" in entry and "is_nested" not in entry:
                    entry["is_nested"] = False
        elif kind == "non-tensor":
            _flatten_non_tensor(target, ctx)
        elif kind == "tensorclass":
            _fields_to_non_tensor_children(target)
        elif kind == "non-tensor-stack" and "data" in node.meta:
            for name in [n for n in node.dirs if n.isdigit()]:
                del node.dirs[name]
    return tree


def _flatten_non_tensor(target: Target, ctx: MigrationContext) -> None:
    node = target.node
    inner = node.dirs.get("_tensordict")
    if inner is None:
        return
    batch = inner.meta.get("shape") if inner.meta else None
    parent_meta = target.parent.meta if target.parent is not None else None
    parent_batch = (
        parent_meta.get("shape")
        if parent_meta is not None and level_kind(parent_meta) == "tensordict"
        else None
    )
    holds_data = bool(inner.files) or bool(inner.dirs)
    if not holds_data and (batch in (None, []) or batch == parent_batch):
        del node.dirs["_tensordict"]
        return
    ctx.problem(
        "kept-non-tensor-batch",
        "info",
        target,
        f"kept the _tensordict/ of this non-tensor value: it records the batch size {batch}, "
        f"which its parent ({parent_batch}) cannot provide in the current format. tensordict "
        "reads it; tdckpt restores the value with its parent's batch size.",
    )


def _fields_to_non_tensor_children(target: Target) -> None:
    node = target.node
    meta = node.meta
    inner = node.dirs.get("_tensordict")
    if meta is None or inner is None or level_kind(inner.meta) != "tensordict":
        return
    assert inner.meta is not None
    for field, value in list(meta.items()):
        if field == "_type" or value is None or field in _TD_FIELDS:
            continue
        if field in inner.meta or field in inner.dirs or f"{field}.memmap" in inner.files:
            continue
        inner.dirs[field] = VDir(
            source=f"{inner.source}/{field}" if inner.source else field,
            meta={
                "_type": NON_TENSOR_DATA_TYPE,
                "data": value,
                "_metadata": None,
                "_is_non_tensor": True,
            },
            leaf_encoding="legacy",
            dir_encoding="legacy",
        )
        inner.meta = insert_entry(inner.meta, field, {"type": "NonTensorData"})
        del meta[field]
