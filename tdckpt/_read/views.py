"""Sub-tensordicts and lazy views: strict decoding of what they add to a level.

A ``_SubTensorDict`` directory holds an ``index`` into the tensordict saved in its
``_source/``; a lazy view (``_UnsqueezedTensorDict``, ``_PermutedTensorDict``, ...) holds the
operation and its inverse. Both are validated here - the index decoded as tensordict 0.15.3
decodes it, within bounds; only the operations tensordict accepts, with their exact
arguments - and turned into nodes. The source itself is validated by ``validate.py``
(through ``ctx.build``), which calls this module for these two kinds of level.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tdckpt._read.nodes import (
    LazyStackNode,
    LazyViewNode,
    Node,
    SubTensorDictNode,
    TensorDictNode,
)
from tdckpt._read.storage import join
from tdckpt._read.tree import VDir
from tdckpt._report import Problem


class Ctx(Protocol):
    """What this module needs of a validation run (``validate.Ctx`` is one): problems to
    append to, ``add`` to report one, and ``build`` to validate a view's ``_source``."""

    problems: list[Problem]

    def build(
        self, vdir: VDir, key: tuple[str, ...], parent_batch: tuple[int, ...] | None
    ) -> Node | None: ...

    def add(
        self, code: str, path: str, key: tuple[str, ...], message: str, sev: str = "error"
    ) -> None: ...


__all__ = [
    "MAX_INDEX_DEPTH",
    "MAX_INDEX_ITEMS",
    "VIEW_CLASSES",
    "VIEW_KWARGS",
    "build_sub_td",
    "build_view",
    "decode_index",
    "index_batch",
    "node_batch",
]

#: Bounds on a saved sub-tensordict index (elements of the JSON, and nesting).
MAX_INDEX_ITEMS = 1_000_000
MAX_INDEX_DEPTH = 32
_INT64 = (-(2**63), 2**63 - 1)

#: The view operations tensordict 0.15.3 loads, with the exact keyword set of each
#: (``_CustomOpTensorDict._load_memmap``); ``squeeze`` may also have none.
VIEW_KWARGS: dict[str, frozenset[str]] = {
    "squeeze": frozenset({"dim"}),
    "unsqueeze": frozenset({"dim"}),
    "view": frozenset({"size"}),
    "transpose": frozenset({"dim0", "dim1"}),
    "permute": frozenset({"dims"}),
}
#: The lazy-view classes (module ``tensordict._lazy``) a ``_class`` may name.
VIEW_CLASSES = frozenset(
    {
        "_CustomOpTensorDict",
        "_UnsqueezedTensorDict",
        "_SqueezedTensorDict",
        "_ViewedTensorDict",
        "_TransposedTensorDict",
        "_PermutedTensorDict",
    }
)


class _BadIndex(Exception):
    pass


def node_batch(node: Node | None) -> tuple[int, ...] | None:
    """The batch size of a collection node (None when it has none to offer)."""
    if isinstance(node, (TensorDictNode, SubTensorDictNode, LazyViewNode)):
        return tuple(node.batch_size)
    if isinstance(node, LazyStackNode):
        batches = {node_batch(m) for m in node.members}
        if len(batches) != 1 or None in batches:
            return None
        (inner,) = batches
        assert inner is not None
        if node.stack_dim > len(inner):
            return None
        return (*inner[: node.stack_dim], len(node.members), *inner[node.stack_dim :])
    return None


def _build_source(
    vdir: VDir, key: tuple[str, ...], ctx: Ctx, what: str
) -> tuple[Node, tuple[int, ...]] | None:
    src_dir = vdir.dirs.get("_source")
    if src_dir is None:
        ctx.add(
            "missing-child",
            join(vdir.source, "_source"),
            key,
            f"a saved {what} without its _source directory (the tensordict it views); the "
            "checkpoint is incomplete. Restore the directory from a backup.",
        )
        return None
    n_problems = len(ctx.problems)
    source = ctx.build(src_dir, key, parent_batch=None)
    if source is None:
        return None
    batch = node_batch(source)
    if batch is None:
        if len(ctx.problems) == n_problems:
            ctx.add(
                "bad-source",
                join(src_dir.source, "meta.json"),
                key,
                f"the source of a saved {what} must be a tensordict with a batch size (a "
                "TensorDict, lazy stack, sub-tensordict or lazy view); "
                f"found a {type(source).__name__}.",
            )
        return None
    return source, batch


def _check_view_class(
    vdir: VDir, key: tuple[str, ...], ctx: Ctx, allowed: frozenset[str], module: str
) -> str | None:
    meta = vdir.meta or {}
    class_id = meta.get("_class")
    if (
        not isinstance(class_id, str)
        or class_id.rpartition(":")[0] != module
        or class_id.rpartition(":")[2] not in allowed
    ):
        ctx.add(
            "unknown-class",
            join(vdir.source, "meta.json"),
            key,
            f"_class {class_id!r} is not one of {sorted(f'{module}:{c}' for c in allowed)}. The "
            "metadata is damaged, or was written by a newer tensordict: upgrade tdckpt.",
        )
        return None
    return class_id


def decode_index(raw: Any) -> Any:
    """Decode a saved ``index`` as tensordict 0.15.3's ``_str_to_index`` does, strictly.

    Tagged (0.14+) and untagged (older) forms. Only ints, None, Ellipsis, slices and
    ranges of ints, lists of ints or bools and CPU index tensors are accepted; raises
    ``_BadIndex`` for anything else, for more than MAX_INDEX_ITEMS elements or nesting
    deeper than MAX_INDEX_DEPTH.
    """
    budget = [MAX_INDEX_ITEMS]

    def spend(depth: int) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise _BadIndex(f"the index has more than {MAX_INDEX_ITEMS} elements")
        if depth > MAX_INDEX_DEPTH:
            raise _BadIndex(f"the index nests deeper than {MAX_INDEX_DEPTH} levels")

    def integer(x: Any, what: str, none_ok: bool) -> Any:
        if x is None and none_ok:
            return None
        if type(x) is not int or not _INT64[0] <= x <= _INT64[1]:
            raise _BadIndex(
                f"{what} must be an int{' or null' if none_ok else ''}, found {x!r:.40}"
            )
        return x

    def content(x: Any, depth: int) -> None:
        spend(depth)
        if isinstance(x, list):
            for e in x:
                content(e, depth + 1)
        elif type(x) is bool:
            return
        else:
            integer(x, "an index tensor's element", False)

    def dec(x: Any, depth: int) -> Any:
        spend(depth)
        if isinstance(x, list):
            if not x:
                return ()
            tag = x[0]
            if tag in ("tuple", "list"):
                if len(x) != 2 or not isinstance(x[1], list):
                    raise _BadIndex(f"a {tag!r} entry must be [{tag!r}, [...]]")
                items = [dec(e, depth + 1) for e in x[1]]
                return tuple(items) if tag == "tuple" else items
            if tag in ("slice", "range"):
                if (
                    len(x) != 2
                    or not isinstance(x[1], dict)
                    or set(x[1]) != {"start", "stop", "step"}
                ):
                    raise _BadIndex(f"a {tag!r} entry must be [{tag!r}, {{start, stop, step}}]")
                c = x[1]
                start, stop, step = (
                    integer(c[k], f"{tag} {k}", tag == "slice") for k in ("start", "stop", "step")
                )
                if step is not None and step <= 0:
                    raise _BadIndex(f"a {tag} step must be positive, found {step}")
                if tag == "slice":
                    return slice(start, stop, step)
                r = range(start, stop, step)
                if len(r) > budget[0]:
                    raise _BadIndex(f"the index has more than {MAX_INDEX_ITEMS} elements")
                budget[0] -= len(r)
                return r
            if tag == "tensor":
                if len(x) != 3 or not isinstance(x[2], str):
                    raise _BadIndex("a 'tensor' entry must be ['tensor', values, device]")
                try:
                    device = torch.device(x[2])
                except (RuntimeError, ValueError):
                    raise _BadIndex(
                        f"index tensor device {x[2]!r:.40} is not a torch device"
                    ) from None
                if device.type != "cpu":
                    raise _BadIndex(
                        f"the index tensor is on {x[2]!r:.40}; "
                        "it cannot index the CPU data of the checkpoint"
                    )
                content(x[1], depth + 1)
                try:
                    return torch.tensor(x[1], device=device)
                except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
                    raise _BadIndex(
                        f"the index tensor's values do not form a tensor ({exc})"
                    ) from None
            if tag == "ellipsis":
                if len(x) != 1:
                    raise _BadIndex("an 'ellipsis' entry must be ['ellipsis']")
                return Ellipsis
            if isinstance(tag, str):
                raise _BadIndex(f"unknown index tag {tag!r:.40}")
            # The untagged form of tensordict < 0.14: a sequence of indices (a tuple).
            return tuple(dec(e, depth + 1) for e in x)
        if x is None:
            return None
        return integer(x, "an index", False)

    return dec(raw, 0)


def index_batch(index: Any, batch: tuple[int, ...]) -> tuple[int, ...]:
    """The batch size of ``source[index]`` for a source of batch ``batch`` (bounds checked)."""
    # _SubTensorDict turns a list or tuple index into a tuple of per-dimension indices.
    items = tuple(index) if isinstance(index, (tuple, list)) else (index,)
    tensors: list[Any] = []
    for item in items:
        if isinstance(item, (list, range)):
            try:
                item = torch.tensor(list(item), dtype=None)
            except (RuntimeError, ValueError, TypeError, OverflowError):
                raise _BadIndex("a list index must hold ints or bools of one shape") from None
            if item.numel() == 0:
                item = item.long()
        elif isinstance(item, tuple):
            raise _BadIndex("a tuple cannot be nested in an index")
        tensors.append(item)

    def dims_of(item: Any) -> int:
        if item is None or item is Ellipsis:
            return 0
        if isinstance(item, torch.Tensor) and item.dtype == torch.bool:
            return item.ndim
        return 1

    used = sum(dims_of(t) for t in tensors)
    if sum(t is Ellipsis for t in tensors) > 1:
        raise _BadIndex("the index holds more than one Ellipsis")
    if used > len(batch):
        raise _BadIndex(
            f"the index addresses {used} dimensions, the source has {len(batch)} {list(batch)}"
        )
    pos = 0
    conv: list[Any] = []
    for t in tensors:
        if t is Ellipsis:
            pos += len(batch) - used
            conv.append(t)
        elif t is None:
            conv.append(t)
        elif isinstance(t, int):
            size = batch[pos]
            if not -size <= t < size:
                raise _BadIndex(f"index {t} is out of range for dimension {pos} of size {size}")
            conv.append(t)
            pos += 1
        elif isinstance(t, slice):
            conv.append(t)
            pos += 1
        elif isinstance(t, torch.Tensor):
            if t.dtype == torch.bool:
                if t.ndim == 0 or tuple(t.shape) != batch[pos : pos + t.ndim]:
                    raise _BadIndex(
                        f"a mask of shape {list(t.shape)} for dimensions "
                        f"{list(batch[pos : pos + t.ndim])} of the source"
                    )
                conv.extend(i.to("meta") for i in t.nonzero(as_tuple=True))
                pos += t.ndim
            elif t.dtype in (torch.int64, torch.int32):
                size = batch[pos]
                if t.numel() and (int(t.min()) < -size or int(t.max()) >= size):
                    raise _BadIndex(
                        f"index tensor values out of range for dimension {pos} of size {size}"
                    )
                conv.append(t.to("meta"))
                pos += 1
            else:
                raise _BadIndex(f"an index tensor of {t.dtype}; indices are ints or bools")
        else:
            raise _BadIndex(f"{type(t).__name__} is not an index")
    try:
        return tuple(torch.empty(batch, device="meta")[tuple(conv)].shape)
    except (IndexError, RuntimeError, TypeError, ValueError) as exc:
        raise _BadIndex(f"the index does not apply to a batch of {list(batch)} ({exc})") from None


def build_sub_td(vdir: VDir, key: tuple[str, ...], ctx: Ctx) -> SubTensorDictNode | None:
    meta = vdir.meta or {}
    where = join(vdir.source, "meta.json")
    class_id = _check_view_class(vdir, key, ctx, frozenset({"_SubTensorDict"}), "tensordict._td")
    if "index" not in meta:
        ctx.add(
            "schema",
            where,
            key,
            "a saved sub-tensordict without its 'index' field; the metadata is damaged.",
        )
        return None
    try:
        index = decode_index(meta["index"])
        bad = None
    except _BadIndex as exc:
        index, bad = None, str(exc)
    built = _build_source(vdir, key, ctx, "sub-tensordict")
    if bad is not None:
        ctx.add(
            "bad-index",
            where,
            key,
            f"the sub-tensordict index cannot be loaded: {bad}. "
            "The metadata is damaged or hostile.",
        )
        return None
    if built is None or class_id is None:
        return None
    source, src_batch = built
    try:
        batch = index_batch(index, src_batch)
    except _BadIndex as exc:
        ctx.add(
            "bad-index",
            where,
            key,
            "the sub-tensordict index does not fit its source of batch size "
            f"{list(src_batch)}: {exc}.",
        )
        return None
    return SubTensorDictNode(
        key=key,
        path=vdir.source,
        class_id=class_id,
        index_json=meta["index"],
        index=index,
        batch_size=batch,
        source=source,
    )


def _op_error(op: Any, kwargs: Any) -> str | None:
    """tensordict 0.15.3's check of a saved operation (None: accepted)."""
    if not isinstance(op, str) or op not in VIEW_KWARGS:
        return f"operation {op!r:.40} is not one of {sorted(VIEW_KWARGS)}"
    if not isinstance(kwargs, dict):
        return f"its kwargs must be a dict, found {kwargs!r:.60}"
    if set(kwargs) != VIEW_KWARGS[op] and not (op == "squeeze" and not kwargs):
        return f"{op} takes exactly {sorted(VIEW_KWARGS[op])}, found {sorted(kwargs)!r:.80}"
    for name, value in kwargs.items():
        many = name in ("size", "dims") or (op == "squeeze" and isinstance(value, list))
        values = value if many else [value]
        if not isinstance(values, list) or any(type(v) is not int for v in values):
            wanted = "a list of ints" if many else "an int"
            return f"{op} argument {name}={value!r:.60} must be {wanted}"
        if len(values) > 64:
            return (
                f"{op} argument {name} has {len(values)} entries, "
                "more dims than a tensordict can have"
            )
        if op in ("squeeze", "unsqueeze", "transpose") and any(v < 0 for v in values):
            return (
                f"{op} argument {name}={value!r:.40} is negative: tensordict applies it to each "
                "tensor as is, so it would address feature dims, not the batch"
            )
    return None


def _argsort(dims: list[int]) -> list[int]:
    """The permutation that undoes ``permute(dims)``."""
    return sorted(range(len(dims)), key=dims.__getitem__)


def _apply_op(op: str, kwargs: dict[str, Any], batch: tuple[int, ...]) -> tuple[int, ...]:
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    return tuple(getattr(torch.empty(batch, device="meta"), op)(**args).shape)


def build_view(vdir: VDir, key: tuple[str, ...], ctx: Ctx) -> LazyViewNode | None:
    meta = vdir.meta or {}
    where = join(vdir.source, "meta.json")
    class_id = _check_view_class(vdir, key, ctx, VIEW_CLASSES, "tensordict._lazy")
    op, inv = meta.get("custom_op"), meta.get("inv_op")
    bad = None
    for field_name in ("custom_op_kwargs", "inv_op_kwargs"):
        if field_name not in meta:
            bad = f"the field {field_name!r} is missing"
    if bad is None:
        bad = _op_error(op, meta["custom_op_kwargs"])
    if bad is None and inv is not None:
        bad = _op_error(inv, meta["inv_op_kwargs"])
        bad = bad and f"inverse {bad}"
    if bad is None and inv is None and not isinstance(meta["inv_op_kwargs"], dict):
        bad = "inv_op_kwargs must be a dict"
    built = _build_source(vdir, key, ctx, "lazy view")
    if bad is not None:
        ctx.add(
            "bad-view",
            where,
            key,
            f"the lazy view cannot be loaded: {bad}. The metadata is damaged or hostile.",
        )
        return None
    if built is None or class_id is None:
        return None
    source, src_batch = built
    assert isinstance(op, str)
    kwargs, inv_kwargs = meta["custom_op_kwargs"], meta["inv_op_kwargs"]
    try:
        batch = _apply_op(op, kwargs, src_batch)
    except (IndexError, RuntimeError, TypeError, ValueError) as exc:
        ctx.add(
            "bad-view",
            where,
            key,
            f"{op}({kwargs!r:.60}) does not apply to its source of batch size "
            f"{list(src_batch)}: {exc}",
        )
        return None
    if inv is not None:
        try:
            back = _apply_op(inv, inv_kwargs, batch)
            if op == "permute" and inv == "permute":
                # tensordict writes a permute's inverse as the forward dims
                # ({"dims": [2, 0, 3, 1]} both ways) and undoes it with their argsort,
                # derived from custom_op_kwargs (_PermutedTensorDict._update_inv_op_kwargs):
                # the saved inverse need only be a permutation of the batch dims.
                back = _apply_op(op, {"dims": _argsort(kwargs["dims"])}, batch)
        except (IndexError, RuntimeError, TypeError, ValueError):
            back = None
        if back != src_batch:
            ctx.add(
                "bad-view",
                where,
                key,
                f"the inverse {inv}({inv_kwargs!r:.60}) does not turn the view's batch size "
                f"{list(batch)} back into the source's {list(src_batch)}; writes through the view "
                "would go astray. The metadata is damaged or was edited.",
            )
            return None
    saved = meta.get("shape")
    if saved is not None and (not isinstance(saved, list) or tuple(saved) != batch):
        ctx.add(
            "batch-mismatch",
            where,
            key,
            f"the saved batch size {saved!r:.60} is not the {list(batch)} that {op} gives on the "
            f"source's {list(src_batch)}. The metadata is damaged or was edited.",
        )
        return None
    device = meta.get("device")
    return LazyViewNode(
        key=key,
        path=vdir.source,
        class_id=class_id,
        op=op,
        kwargs=kwargs,
        inv_op=inv,
        inv_kwargs=inv_kwargs,
        batch_size=batch,
        device=device if isinstance(device, str) else None,
        source=source,
    )
