"""G1 -> G2: tensordict <= 0.2 ``meta.pt`` metadata becomes the 0.3 ``meta.json`` form.

What changed: tensordict's first loadable layout (tag v0.0.2b, PR #189; PyPI 0.0.3 to 0.2.1)
stored each directory's batch size and device in ``meta.pt`` and each leaf's shape, dtype
and device in ``<key>.meta.pt``, all ``torch.save`` zips. The big refactor of 0.3.0
(PR #559, 2023-11-21) replaced them by one ``meta.json`` per directory holding every
leaf's ``{"device", "shape", "dtype"}`` plus ``"shape"`` (the batch), ``"device"`` and
``"_type"``. tensordict 0.15.3 cannot read ``meta.pt`` at all.

What this step does, per G1 directory (the ``.pt`` files were read by the metadata stage
with ``torch.load(weights_only=True)``; nothing is unpickled here):

* a TensorDict directory gets a ``meta.json`` dict built from its ``meta.pt`` and the
  ``<key>.meta.pt`` of its leaves; a device of None becomes the string ``"None"`` (what
  tensordict writes, and what its loader maps back to None). The ``.meta.pt`` files are
  not carried over. A leaf whose key holds ``/`` was written one directory down
  (``a/b.memmap`` with ``a/b.meta.pt``) and becomes the entry ``"a/b"``;
* a root ``LazyStackedTensorDict`` (``meta.pt = {"stack_dim": d}``) becomes
  ``{"_type": LazyStackedTensorDict, "stack_dim": d}``;
* a lazy stack *nested* in a TensorDict had its ``meta.pt`` overwritten by the parent
  with a plain batch size, losing ``stack_dim`` (v0.2.1's own loader then fails). It is
  recognised by its members ``0/ .. n-1/`` being one batch dimension short of it, and
  rebuilt; ``stack_dim`` is inferred from where the batch sizes differ and the inference
  is recorded as lost content (ambiguous when several dimensions fit);
* a lazy view (``meta.pt`` with ``custom_op``/``inv_op``) wrote its source's leaves in its
  own directory; they move to ``_source/`` as in 0.3+;
* child collections stay unlisted: that is the G2 form, listed by the next step.

Lost for good in this generation (recorded once per tree): tensorclass identity and
non-tensor fields (a tensorclass saved through its inner TensorDict), and dimension
names (no release before 0.15.3 saved them).
"""

from __future__ import annotations

from typing import Any

from tdckpt._read.migrate import LAZY_STACK_TYPE, TENSORDICT_TYPE, MigrationContext, Target, VDir

FROM_VERSION = 1
TO_VERSION = 2

_VIEW_CLASSES = {
    "unsqueeze": "_UnsqueezedTensorDict",
    "squeeze": "_SqueezedTensorDict",
    "permute": "_PermutedTensorDict",
    "transpose": "_TransposedTensorDict",
    "view": "_ViewedTensorDict",
}
_LEAF_PT = ".meta.pt"
#: More dimensions than any tensor has are not a size (and would cost quadratic work in
#: the stack inference below); validation allows 64 too.
_MAX_DIMS = 64


def upgrade(tree: VDir, ctx: MigrationContext) -> VDir:
    converted = False
    # Post-order: a nested lazy stack is recognised from its members' converted metadata.
    for target in ctx.targets(tree, order="post"):
        if target.node.pt is None or target.node.meta is not None:
            continue
        if "meta.pt" not in target.node.pt:
            if target.parent is None:
                ctx.problem(
                    "missing-meta",
                    "error",
                    target,
                    "a tensordict <= 0.2 checkpoint without its top-level meta.pt (batch size "
                    "and device); the checkpoint is incomplete, restore the file from a backup.",
                )
            continue  # leaves of a "/" key, collected by the parent
        _convert(target, ctx)
        converted = True
    if converted:
        ctx.lose(
            "the checkpoint",
            "written by tensordict <= 0.2 (meta.pt), which saved a tensorclass through its "
            "inner TensorDict only: if a tensorclass was saved, its class and its non-tensor "
            "fields were never stored, and it restores as a TensorDict of its tensor fields.",
        )
    return tree


def _convert(target: Target, ctx: MigrationContext) -> None:
    node = target.node
    assert node.pt is not None
    head = node.pt["meta.pt"]
    node.leaf_encoding = node.dir_encoding = "legacy"  # G1 had raw names only
    if "stack_dim" in head and "batch_size" not in head:
        node.meta = {"_type": LAZY_STACK_TYPE, "stack_dim": _int(head["stack_dim"])}
        node.pt = None
        return
    batch = _size(head.get("batch_size"))
    if batch is None:
        ctx.problem(
            "bad-meta-pt",
            "error",
            target,
            f"meta.pt holds no batch size ({sorted(head)!r}); expected "
            "{'batch_size': torch.Size, 'device': ...}. The file is damaged.",
        )
        node.pt = None
        return
    device = _device(head.get("device"))
    leaves = _leaf_entries(node, "", target, ctx)
    node.pt = None
    if "custom_op" in head:
        _convert_view(target, head, leaves, batch, device, ctx)
        return
    stack_dim = _nested_stack_dim(target, leaves, batch, ctx)
    if stack_dim is not None:
        node.meta = {"_type": LAZY_STACK_TYPE, "stack_dim": stack_dim}
        return
    node.meta = {**leaves, "shape": batch, "device": device, "_type": TENSORDICT_TYPE}


def _leaf_entries(
    node: VDir, prefix: str, target: Target, ctx: MigrationContext, depth: int = 0
) -> dict[str, Any]:
    """``<key>.meta.pt`` of ``node`` (and of meta.pt-less sub-directories: "/" keys)."""
    out: dict[str, Any] = {}
    for name, info in sorted((node.pt or {}).items()):
        if name == "meta.pt" or not name.endswith(_LEAF_PT):
            continue
        key = prefix + name[: -len(_LEAF_PT)]
        entry = _leaf_entry(info)
        if entry is None:
            ctx.problem(
                "bad-meta-pt",
                "error",
                target,
                f"{name} does not hold a leaf's shape, dtype and device (found "
                f"{sorted(info) if isinstance(info, dict) else type(info).__name__}); the leaf "
                "cannot be described. The file is damaged.",
                key=key,
            )
            continue
        out[key] = entry
    if depth < 64:
        for name, sub in sorted(node.dirs.items()):
            if sub.meta is not None or (sub.pt is not None and "meta.pt" in sub.pt):
                continue  # a child collection (listed by the next step)
            out.update(_leaf_entries(sub, f"{prefix}{name}/", target, ctx, depth + 1))
            sub.pt = None  # its leaf metadata now lives in this directory's meta.json
    return out


def _leaf_entry(info: Any) -> dict[str, Any] | None:
    if not isinstance(info, dict):
        return None
    shape = _size(info.get("shape"))
    dtype = info.get("dtype")
    if shape is None or dtype is None:
        return None
    dtype_str = str(dtype)
    if not dtype_str.startswith("torch."):
        return None
    return {"device": _device(info.get("device")), "shape": shape, "dtype": dtype_str}


def _size(value: Any) -> list[int] | None:
    if (
        isinstance(value, (list, tuple))
        and len(value) <= _MAX_DIMS
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value)
    ):
        return [int(d) for d in value]
    return None


def _device(value: Any) -> str:
    return "None" if value is None else str(value)


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _nested_stack_dim(
    target: Target, leaves: dict[str, Any], batch: list[int], ctx: MigrationContext
) -> int | None:
    """The stack dimension of a lazy stack whose ``meta.pt`` its parent overwrote."""
    node = target.node
    n = len(node.dirs)
    if leaves or n == 0 or set(node.dirs) != {str(i) for i in range(n)}:
        return None
    member_batches = []
    for i in range(n):
        meta = node.dirs[str(i)].meta
        shape = meta.get("shape") if meta else None
        if not isinstance(shape, list):
            return None
        member_batches.append(shape)
    first = member_batches[0]
    # A nested TensorDict's batch always extends its parent's; members one dimension
    # *shorter* than the directory can only be the members of a stack.
    if any(b != first for b in member_batches) or len(batch) != len(first) + 1:
        return None
    fits = [d for d in range(len(batch)) if batch[d] == n and batch[:d] + batch[d + 1 :] == first]
    if not fits:
        return None
    dim = fits[0]
    if len(fits) == 1:
        ctx.lose(
            target,
            f"a lazy stack whose stack_dim tensordict <= 0.2 did not save (its parent "
            f"overwrote it); inferred as {dim}, the only dimension where the stack's batch "
            f"size {batch} and its members' {first} differ.",
        )
    else:
        ctx.lose(
            target,
            f"a lazy stack whose stack_dim tensordict <= 0.2 did not save (its parent "
            f"overwrote it); its batch size {batch} fits stacking {n} members of batch "
            f"{first} along any of the dimensions {fits}: restored along {dim}, which may "
            "differ from the original.",
        )
    return dim


def _convert_view(
    target: Target,
    head: dict[str, Any],
    leaves: dict[str, Any],
    batch: list[int],
    device: str,
    ctx: MigrationContext,
) -> None:
    node = target.node
    op, inv = head.get("custom_op"), head.get("inv_op")
    kwargs, inv_kwargs = (
        _jsonable(head.get("custom_op_kwargs") or {}),
        _jsonable(head.get("inv_op_kwargs") or {}),
    )
    cls = _VIEW_CLASSES.get(op) if isinstance(op, str) else None
    if cls is None:
        ctx.problem(
            "unsupported-view",
            "error",
            target,
            f"a lazy view with the operation {op!r}, which current tensordict cannot load "
            f"(it loads {sorted(_VIEW_CLASSES)}). Load it with tensordict <= 0.2 and save a "
            "materialized copy (`td.to_tensordict()`).",
        )
        node.meta = {**leaves, "shape": batch, "device": device, "_type": TENSORDICT_TYPE}
        return
    # The directory holds the *source's* leaves; decide which batch size meta.pt recorded.
    shapes = [e["shape"] for e in leaves.values()]
    if shapes and all(s[: len(batch)] == batch for s in shapes):
        source_batch, view_batch = batch, _apply(op, kwargs, batch)
    else:
        source_batch, view_batch = _apply(inv, inv_kwargs, batch), batch
    if source_batch is None or view_batch is None:
        ctx.problem(
            "unsupported-view",
            "error",
            target,
            f"a lazy {op} view whose batch sizes cannot be recovered from {batch}.",
        )
        node.meta = {**leaves, "shape": batch, "device": device, "_type": TENSORDICT_TYPE}
        return
    source = VDir(
        source=node.source,
        meta={**leaves, "shape": source_batch, "device": device, "_type": TENSORDICT_TYPE},
        files=node.files,
        dirs=node.dirs,
        leaf_encoding="legacy",
        dir_encoding="legacy",
    )
    node.files, node.dirs = {}, {"_source": source}
    node.meta = {
        "shape": view_batch,
        "device": device,
        "_type": f"<class 'tensordict._lazy.{cls}'>",
        "custom_op": op,
        "inv_op": inv,
        "custom_op_kwargs": kwargs,
        "inv_op_kwargs": inv_kwargs,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _apply(op: Any, kwargs: dict[str, Any], shape: list[int]) -> list[int] | None:
    """The batch size after a view operation, or None when it cannot be computed."""
    try:
        n = len(shape)
        if op == "unsqueeze":
            dim = kwargs["dim"]
            dim = dim + n + 1 if dim < 0 else dim
            return [*shape[:dim], 1, *shape[dim:]]
        if op == "squeeze":
            dim = kwargs.get("dim")
            if dim is None:
                return [d for d in shape if d != 1]
            dim = dim + n if dim < 0 else dim
            return shape[:dim] + shape[dim + 1 :] if shape[dim] == 1 else list(shape)
        if op == "permute":
            return [shape[d] for d in kwargs["dims"]]
        if op == "transpose":
            out = list(shape)
            a, b = kwargs["dim0"], kwargs["dim1"]
            out[a], out[b] = out[b], out[a]
            return out
        if op == "view":
            size = list(kwargs["size"])
            if -1 in size:
                known = 1
                for d in size:
                    known *= d if d != -1 else 1
                total = 1
                for d in shape:
                    total *= d
                size[size.index(-1)] = total // known if known else 0
            return size
    except (KeyError, IndexError, TypeError):
        return None
    return None
