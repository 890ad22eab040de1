"""Validation: the current-form virtual tree -> typed nodes, and every problem at once.

Each level's ``meta.json`` is checked against its pydantic model (``schema.py``), then
cross-checked against what is on disk: every leaf file exists and is large enough, dtypes
are known, shapes are sane and start with their level's batch size, listed children
exist, no two keys share a file, lazy-stack members agree. Nothing here raises for a bad
checkpoint: problems are collected, so ``validate`` can show them all and the restore
engine can refuse before touching anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pydantic

from tdckpt import schema
from tdckpt._keys import encode_key
from tdckpt._read.classes import declared_fields, resolve_class
from tdckpt._read.detect import level_kind
from tdckpt._read.levels import read_td_level
from tdckpt._read.nodes import (
    LazyStackNode,
    LazyViewNode,
    LeafNode,
    Node,
    SubTensorDictNode,
    TensorClassNode,
    TensorDictNode,
)
from tdckpt._read.storage import Storage, join
from tdckpt._read.tree import VDir
from tdckpt._read.validate_checks import check_device, schema_problems
from tdckpt._read.validate_columns import usual_leaves
from tdckpt._read.validate_leaf import MAX_BYTES, build_leaf
from tdckpt._read.validate_values import build_non_tensor, build_nt_stack
from tdckpt._read.views import build_sub_td, build_view, node_batch
from tdckpt._report import Problem

__all__ = ["build_nodes", "class_kind"]


_TD_CLASSES = {
    "TensorDict",
    "PersistentTensorDict",
    "TensorDictParams",
    "TypedTensorDict",
    "TensorDictStore",
}


def class_kind(meta: dict[str, Any]) -> str:
    """What kind of level a meta.json describes (detection's classification).

    A level detection cannot place is validated as a tensorclass, whose model then says
    what is missing.
    """
    kind = level_kind(meta)
    return "tensorclass" if kind == "unknown" else kind


class Ctx:
    """What one validation run collects: problems, claimed files; ``build`` recurses."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.problems: list[Problem] = []
        self.claimed: dict[int, tuple[str, ...]] = {}

    def build(
        self, vdir: VDir, key: tuple[str, ...], parent_batch: tuple[int, ...] | None
    ) -> Node | None:
        """Validate a nested level (views validate their ``_source`` through this)."""
        return _build(vdir, key, self, parent_batch)

    def add(
        self, code: str, path: str, key: tuple[str, ...], message: str, sev: str = "error"
    ) -> None:
        self.problems.append(Problem(code, sev, path, key, message))  # type: ignore[arg-type]


def build_nodes(tree: VDir, storage: Storage) -> tuple[Node | None, list[Problem]]:
    """Validate ``tree`` and return its typed root node (None if unusable) and problems."""
    ctx = Ctx(storage)
    for vdir in tree.walk():
        ctx.problems.extend(vdir.problems)
    node = _build(tree, (), ctx, parent_batch=None)
    return node, ctx.problems


def _build(
    vdir: VDir, key: tuple[str, ...], ctx: Ctx, parent_batch: tuple[int, ...] | None
) -> Node | None:
    meta = vdir.meta
    if meta is None:
        own = [p for p in vdir.problems if p.severity == "error" and not p.key]
        if own and key:
            # read_tree does not know keys: name the key this directory holds now.
            ctx.problems = [
                dataclasses.replace(p, key=key) if p in own else p for p in ctx.problems
            ]
        if not any(p.path.startswith(vdir.source) and p.severity == "error" for p in vdir.problems):
            ctx.add(
                "missing-meta",
                join(vdir.source, "meta.json"),
                key,
                "missing: every saved collection has a meta.json. The checkpoint is "
                "incomplete; restore this directory from a backup.",
            )
        return None
    # A _format_version newer than this tdckpt reads never gets here: detection (run on
    # every directory by the migration runner, before validation) raises for it.
    kind = class_kind(meta)
    if kind == "tensordict":
        return _build_td(vdir, key, ctx)
    if kind == "lazy-stack":
        return _build_stack(vdir, key, ctx)
    if kind == "non-tensor":
        return build_non_tensor(vdir, key, ctx, parent_batch or ())
    if kind == "non-tensor-stack":
        return build_nt_stack(vdir, key, ctx, parent_batch or ())
    if kind == "tensorclass":
        return _build_tensorclass(vdir, key, ctx)
    if kind == "sub-tensordict":
        return build_sub_td(vdir, key, ctx)
    # class_kind returns one of the kinds above or "lazy-view" (level_kind's "unknown" is
    # validated as a tensorclass), so there is no unsupported class left to report here.
    assert kind == "lazy-view", kind
    return build_view(vdir, key, ctx)


#: A level of at least this many entries is first tried column by column (usual_leaves);
#: below, the per-leaf path costs less than the columns' setup.
_COLUMNS_FROM = 32


def _build_td(vdir: VDir, key: tuple[str, ...], ctx: Ctx) -> TensorDictNode | None:
    assert vdir.meta is not None
    try:
        model = vdir.exact_level or read_td_level(vdir.meta)
    except pydantic.ValidationError as exc:
        schema_problems(ctx, exc, vdir.source, key, vdir.meta)
        return None
    module, _, cls_name = model.class_.rpartition(":")
    if cls_name not in _TD_CLASSES or module.split(".")[0] != "tensordict":
        ctx.add(
            "unknown-class",
            join(vdir.source, "meta.json"),
            key,
            f"_class {model.class_!r} is not a tensordict class tdckpt knows (expected e.g. "
            "'tensordict:TensorDict'); tensordict itself refuses it ('Could not find the "
            "class'). The metadata is damaged, or was written by a newer tensordict: upgrade "
            "tdckpt.",
        )
        return None
    if not check_device(ctx, vdir, key, model.device):
        return None
    batch = model.shape
    node = TensorDictNode(
        key=key,
        path=vdir.source,
        class_id=model.class_,
        batch_size=batch,
        device=model.device,
        names=model.names,
    )
    if model.names is not None and len(model.names) != len(batch):
        ctx.add(
            "bad-names",
            join(vdir.source, "meta.json"),
            key,
            f"{len(model.names)} dimension names for a batch size of {len(batch)} dims.",
        )
    entries = node.entries
    usual = (
        usual_leaves(vdir, key, model.entries, batch, ctx.claimed, MAX_BYTES)
        if len(model.entries) >= _COLUMNS_FROM
        else None
    )
    if usual is not None:  # a level of usual leaves, all valid (the large case)
        entries.update(usual)
        return node  # no nested tensor: no size table shares a file
    for name, entry in model.entries.items():
        sub = (*key, name)
        if type(entry) is tuple:
            leaf = build_leaf(vdir, sub, name, entry, batch, ctx)
            if leaf is not None:
                entries[name] = leaf
            continue
        child = vdir.dirs.get(encode_key(name))
        if child is None:
            ctx.add(
                "missing-child",
                join(vdir.source, encode_key(name)),
                sub,
                f"meta.json lists a nested {entry} under this key, but its directory is "
                "missing. The checkpoint is incomplete; tensordict would silently drop the key.",
            )
            continue
        built = _build(child, sub, ctx, parent_batch=batch)
        if built is None:
            continue
        _check_batch_prefix(built, batch, ctx)
        node.entries[name] = built
    _check_no_shared_file(vdir, entries, ctx)
    return node


def _check_no_shared_file(vdir: VDir, entries: dict[str, Node], ctx: Ctx) -> None:
    """Refuse a level where one file would be read as two things: a nested tensor's size
    table ``<k>.shape.memmap`` is also the data file of a key ``<k>.shape``. The writer
    cannot have meant both (it wrote one over the other), so neither can be trusted."""
    if len(entries) < 2:
        return  # one leaf's two files are never one file: their names differ
    users: dict[str, tuple[str, ...]] = {}
    for leaf in entries.values():
        if type(leaf) is not LeafNode:
            continue
        for vfile in (leaf.file, leaf.shape_file):
            if vfile is None or vfile.source is None:
                continue
            other = users.setdefault(vfile.source, leaf.key)
            if other != leaf.key:
                ctx.add(
                    "shared-file",
                    vfile.source,
                    leaf.key,
                    f"this file is read both for {_describe_key(other)} and for "
                    f"{_describe_key(leaf.key)} (a nested tensor's size table is the data file "
                    "of another key): one was written over the other, so neither can be "
                    f"trusted. Remove one of the two keys from {join(vdir.source, 'meta.json')} "
                    "or restore the checkpoint from a backup.",
                )


def _describe_key(key: tuple[str, ...]) -> str:
    return f"key {'.'.join(key)!r}"


def _check_batch_prefix(node: Node, batch: tuple[int, ...], ctx: Ctx) -> None:
    child_batch: tuple[int, ...] | None = None
    if isinstance(node, TensorDictNode):
        child_batch = node.batch_size
    elif isinstance(node, TensorClassNode):
        child_batch = node.inner.batch_size
    elif isinstance(node, (SubTensorDictNode, LazyViewNode)):
        child_batch = node.batch_size
    if child_batch is not None and tuple(child_batch[: len(batch)]) != batch:
        ctx.add(
            "batch-mismatch",
            join(node.path, "meta.json"),
            node.key,
            f"batch size {list(child_batch)} does not start with the parent's {list(batch)}.",
        )


def _build_stack(vdir: VDir, key: tuple[str, ...], ctx: Ctx) -> LazyStackNode | None:
    try:
        model = schema.LazyStackMeta.model_validate(vdir.meta)
    except pydantic.ValidationError as exc:
        schema_problems(ctx, exc, vdir.source, key)
        return None
    node = LazyStackNode(
        key=key,
        path=vdir.source,
        class_id=model.class_,
        stack_dim=model.stack_dim,
        stack_dim_name=model.stack_dim_name,
    )
    i = 0
    while str(i) in vdir.dirs:
        member = _build(vdir.dirs[str(i)], (*key, str(i)), ctx, parent_batch=None)
        if member is not None:
            node.members.append(member)
        i += 1
    stray = sorted(name for name in vdir.dirs if name.isdigit() and int(name) >= i)
    if stray or i == 0:
        ctx.add(
            "stack-mismatch",
            vdir.source,
            key,
            f"lazy-stack members are the directories 0, 1, ...; found {i} of them"
            + (f", and then {stray[:5]} after a gap" if stray else "")
            + ". A member is missing; restore it from a backup.",
        )
    for m in node.members:
        if not isinstance(m, (TensorDictNode, LazyStackNode)):
            ctx.add(
                "stack-mismatch",
                join(m.path, "meta.json"),
                m.key,
                f"a lazy-stack member must be a TensorDict (or a lazy stack); found a "
                f"{type(m).__name__.removesuffix('Node')}. The metadata is damaged or was edited.",
            )
    members = [m for m in node.members if isinstance(m, (TensorDictNode, LazyStackNode))]
    batches = {b for b in map(node_batch, members) if b is not None}
    if len(batches) > 1:
        ctx.add(
            "stack-mismatch",
            vdir.source,
            key,
            f"lazy-stack members have different batch sizes {sorted(map(list, batches))}.",
        )
    devices = {d for m in members for d in _stack_devices(m)}
    if len(devices) > 1:
        ctx.add(
            "stack-mismatch",
            vdir.source,
            key,
            f"lazy-stack members are on different devices {sorted(map(str, devices))}; "
            "tensordict cannot stack them. The metadata is damaged or was edited.",
        )
    for b in batches:
        if model.stack_dim > len(b):
            ctx.add(
                "bad-shape",
                join(vdir.source, "meta.json"),
                key,
                f"stack_dim {model.stack_dim} exceeds the members' {len(b)} batch dims.",
            )
            break
    return node


def _stack_devices(node: TensorDictNode | LazyStackNode) -> set[str | None]:
    """The devices of a stack member (a nested stack's: those of its members)."""
    if isinstance(node, TensorDictNode):
        return {node.device}
    return {
        d
        for m in node.members
        if isinstance(m, (TensorDictNode, LazyStackNode))
        for d in _stack_devices(m)
    }


def _build_tensorclass(vdir: VDir, key: tuple[str, ...], ctx: Ctx) -> TensorClassNode | None:
    try:
        model = schema.TensorClassMeta.model_validate(vdir.meta)
    except pydantic.ValidationError as exc:
        schema_problems(ctx, exc, vdir.source, key)
        return None
    assert vdir.meta is not None
    inner_dir = vdir.dirs.get("_tensordict")
    if inner_dir is None:
        ctx.add(
            "missing-child",
            join(vdir.source, "_tensordict"),
            key,
            f"a saved tensorclass {model.type_} without its _tensordict directory; "
            "the checkpoint is incomplete.",
        )
        return None
    inner = _build(inner_dir, key, ctx, parent_batch=None)
    if not isinstance(inner, TensorDictNode):
        if inner is not None:
            ctx.add(
                "schema",
                join(inner_dir.source, "meta.json"),
                key,
                "a tensorclass's _tensordict must be a TensorDict level.",
            )
        return None
    fields = {k: v for k, v in vdir.meta.items() if k != "_type"}
    if not _check_tensorclass(ctx, vdir, key, model.type_, fields, set(inner.entries)):
        return None
    return TensorClassNode(
        key=key,
        path=vdir.source,
        type_str=model.type_,
        fields=fields,
        inner=inner,
        pickle=vdir.files.get("other.pickle"),
    )


def _check_tensorclass(
    ctx: Ctx,
    vdir: VDir,
    key: tuple[str, ...],
    type_str: str,
    fields: dict[str, Any],
    inner: set[str],
) -> bool:
    """A tensorclass level: no field both in meta.json and in ``_tensordict``, and the saved
    class, where this process can resolve it, a tensorclass that declares every field.

    A class whose module is not imported is not judged (the restore asks to import it).
    """
    both = sorted(k for k, v in fields.items() if k in inner and v is not None)
    if both:
        ctx.add(
            "schema",
            join(vdir.source, "meta.json"),
            key,
            f"field(s) {both} are stored both in meta.json and in _tensordict/; a tensorclass "
            "holds each field once. The metadata is damaged or was edited.",
        )
        return False
    saved = set(fields) | inner
    found = resolve_class(type_str)
    if found.problem is not None:
        ctx.add(
            "unknown-class",
            join(vdir.source, "meta.json"),
            key,
            f"_type: {found.problem}, so the tensorclass cannot be rebuilt. The metadata is "
            "damaged or was edited, or the class changed since it was saved.",
        )
        return False
    if found.cls is not None:
        unknown = sorted(saved - declared_fields(found.cls))
        if unknown:
            ctx.add(
                "unknown-field",
                join(vdir.source, "meta.json"),
                key,
                f"field(s) {unknown} that the class {found.name} does not declare. The class "
                "changed since the checkpoint was written, or the metadata was edited: restore "
                "with the class definition that saved it.",
            )
            return False
    return True
