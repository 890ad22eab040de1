"""G2 -> G3: list every child collection in its parent, as tensordict 0.4 does.

What changed: tensordict 0.3.x (PR #559) loaded every sub-directory it found. 0.4.0
(PR #719) records each child collection in its parent's meta.json as
``"<key>": {"type": "<ClassName>"}`` and loads only those. So every later release -
0.15.3 included - reads a 0.3.x checkpoint **without its nested TensorDicts,
NonTensorData, tensorclasses and lazy stacks, silently** (format-notes.md G2 hazard).
0.4.0 also introduced ``NonTensorStack`` (PR #711, BC-breaking): a stack of non-tensor
values became one JSON list instead of a LazyStackedTensorDict of NonTensorData
directories.

What this step does, per G2 directory:

* a TensorDict level gets a ``{"type": ClassName}`` entry for every sub-directory that
  holds a collection (read from the child's own ``_type``), after its leaf entries.
  A chain of directories without metadata leading to one (``a/b/meta.json``) is the
  legacy layout of a key holding ``/``: the entry is ``"a/b"``. Directories holding no
  collection are left alone (the names stage reports them);
* a LazyStackedTensorDict whose members are all NonTensorData with inline JSON data (or
  stacks already converted) becomes a NonTensorStack ``{"_type", "stack_dim", "device":
  null, "data": [...]}``, its member directories dropped. ``data`` is the nested list in
  batch order (each member's value repeated over its own batch size). Members with a
  pickled value stay a lazy stack (no unpickling here);
* names stay raw: 0.3 had no other convention (``leaf_encoding = dir_encoding =
  "legacy"``).
"""

from __future__ import annotations

from typing import Any

from tdckpt._read.migrate import (
    NON_TENSOR_STACK_TYPE,
    MigrationContext,
    Target,
    VDir,
    child_type_name,
    insert_entry,
    level_kind,
)

FROM_VERSION = 2
TO_VERSION = 3

_MAX_CHAIN = 64
#: A stack of non-tensors inlines at most this many values (its members' values repeated
#: over their batch sizes, all members together); a larger one is refused rather than
#: expanded: a few bytes of metadata (``"shape": [1000000000]``) must not cost gigabytes.
MAX_INLINE_VALUES = 1_000_000
#: Batch sizes with more dimensions are left to validation (torch allows 64).
_MAX_DIMS = 64


def upgrade(tree: VDir, ctx: MigrationContext) -> VDir:
    # Post-order: stacks of non-tensors are converted before their parent lists them.
    for target in ctx.targets(tree, order="post"):
        node = target.node
        if node.meta is None:
            continue
        node.leaf_encoding = node.leaf_encoding or "legacy"
        node.dir_encoding = node.dir_encoding or "legacy"
        kind = level_kind(node.meta)
        if kind == "lazy-stack":
            _stack_of_non_tensors(target, ctx)
        elif kind == "tensordict":
            _list_children(target, ctx)
    return tree


def _list_children(target: Target, ctx: MigrationContext) -> None:
    node = target.node
    meta = node.meta
    assert meta is not None
    for name in sorted(node.dirs):
        for parts, child in _collections(node.dirs[name], [name], 0):
            key = "/".join(parts)
            if key in meta:
                if not isinstance(meta[key], dict):
                    ctx.lose(
                        target,
                        f"the child collection {key!r} has the name of a field of its parent's "
                        "meta.json, which current tensordict cannot hold (0.4+ drops it too); "
                        "tdckpt cannot list it, so it is not restored (an upgrade keeps its files "
                        "in the backup only).",
                    )
                continue
            if not isinstance(child.meta, dict) or "_type" not in child.meta:
                ctx.problem(
                    "unlisted-child",
                    "warning",
                    target,
                    f"the sub-directory {key!r} has a meta.json without `_type`, so its "
                    "class is unknown and it is not listed; it will not be restored.",
                    key=key,
                )
                continue
            meta = insert_entry(meta, key, {"type": child_type_name(child.meta)})
    node.meta = meta


def _collections(node: VDir, parts: list[str], depth: int) -> list[tuple[list[str], VDir]]:
    """The collections at or below ``node`` reached through metadata-less directories."""
    if node.meta is not None:
        return [(parts, node)]
    if depth >= _MAX_CHAIN:
        return []
    out: list[tuple[list[str], VDir]] = []
    for name in sorted(node.dirs):
        out.extend(_collections(node.dirs[name], [*parts, name], depth + 1))
    return out


def _stack_of_non_tensors(target: Target, ctx: MigrationContext) -> None:
    node = target.node
    meta = node.meta
    assert meta is not None
    members: list[VDir] = []
    while str(len(members)) in node.dirs:
        members.append(node.dirs[str(len(members))])
    if not members:
        return
    batches: dict[int, list[int]] = ctx.state.setdefault("non_tensor_stack_batch", {})
    values: list[Any] = []
    member_batch: list[int] | None = None
    # One budget for the whole tree: a hundred small stacks cannot spend it a hundred times.
    spent: list[int] = ctx.state.setdefault("inline_budget", [MAX_INLINE_VALUES])
    for member in members:
        kind = level_kind(member.meta)
        if kind == "non-tensor":
            assert member.meta is not None
            if "data" not in member.meta:
                ctx.problem(
                    "kept-lazy-stack",
                    "info",
                    target,
                    "a stack of non-tensor values with pickled members stays a lazy stack of "
                    "NonTensorData (only JSON data can be inlined without unpickling).",
                )
                return
            inner = member.dirs.get("_tensordict")
            shape = inner.meta.get("shape") if inner is not None and inner.meta else []
            batch = list(shape) if isinstance(shape, list) else []
            if not _is_size(batch):
                return  # not a batch size: left to validation, which names the member
            spent[0] -= _numel(batch, max(spent[0], 0))
            if spent[0] < 0:
                ctx.problem(
                    "too-large",
                    "error",
                    target,
                    f"a stack of {len(members)} non-tensor values whose batch sizes (member "
                    f"{member.source!r}: {batch}) expand to more than {MAX_INLINE_VALUES} "
                    "values in all; tdckpt does not inline so many. The metadata is damaged or "
                    "hostile; if it is genuine, load it with tensordict 0.3 and save it as a "
                    "tensor.",
                )
                return
            values.append(_full(batch, member.meta["data"]))
        elif kind == "non-tensor-stack" and id(member) in batches:
            assert member.meta is not None
            batch = batches[id(member)]
            spent[0] -= _numel(batch, max(spent[0], 0))
            if spent[0] < 0:
                ctx.problem(
                    "too-large",
                    "error",
                    target,
                    f"a stack of stacks of non-tensor values holding more than "
                    f"{MAX_INLINE_VALUES} values; tdckpt does not inline them. The metadata "
                    "is damaged or hostile.",
                )
                return
            values.append(member.meta["data"])
        else:
            return  # a stack of tensordicts
        if member_batch is None:
            member_batch = batch
        elif batch != member_batch:
            return
    assert member_batch is not None
    stack_dim = meta.get("stack_dim", 0)
    if not isinstance(stack_dim, int) or not 0 <= stack_dim <= len(member_batch):
        return
    node.meta = {
        "_type": NON_TENSOR_STACK_TYPE,
        "stack_dim": stack_dim,
        "device": None,
        "data": _stack(values, stack_dim),
    }
    node.dirs = {}
    batches[id(node)] = [*member_batch[:stack_dim], len(members), *member_batch[stack_dim:]]
    if any(isinstance(v, list) for v in _elements(values, len(member_batch))):
        ctx.lose(
            target,
            "a stack of list values: tensordict's NonTensorStack loader reads list elements "
            "as one more batch dimension, so the stack restores with a larger batch size.",
        )


def _is_size(batch: list[Any]) -> bool:
    return len(batch) <= _MAX_DIMS and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in batch
    )


def _numel(batch: list[int], limit: int) -> int:
    """The product of ``batch``, or anything above ``limit`` once it passes it."""
    if 0 in batch:
        return 0
    n = 1
    for d in batch:
        n *= d
        if n > limit:
            return limit + 1
    return n


def _full(batch: list[int], value: Any) -> Any:
    """``value`` repeated over ``batch`` as a nested list (a NonTensorData's tolist())."""
    if not batch:
        return value
    return [_full(batch[1:], value) for _ in range(batch[0])]


def _stack(values: list[Any], dim: int) -> Any:
    """Stack nested lists along ``dim`` (``values[i]`` is member ``i``)."""
    if dim == 0:
        return list(values)
    return [_stack([v[j] for v in values], dim - 1) for j in range(len(values[0]))]


def _elements(values: list[Any], depth: int) -> list[Any]:
    out = list(values)
    for _ in range(depth):
        out = [x for v in out if isinstance(v, list) for x in v]
    return out
