"""Validation of a non-tensor level: a ``NonTensorData`` / ``MetaData`` value (inline JSON,
or pickled with the JSON-typed record of its containers) and a ``NonTensorStack`` (its
values inline, bounded in nesting and sized for its batch, or pickled).

Problems are reported through the run's context (``validate.Ctx``), never raised; a level
with one is left out of the validated tree.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pydantic

from tdckpt import schema
from tdckpt._read.nodes import NonTensorNode, NonTensorStackNode
from tdckpt._read.storage import join
from tdckpt._read.tree import VDir
from tdckpt._read.validate_checks import check_device, schema_problems
from tdckpt._read.validate_leaf import LeafCtx
from tdckpt.errors import TdckptError

__all__ = ["build_non_tensor", "build_nt_stack"]


def _json_types(vdir: VDir, ctx: LeafCtx) -> dict[str, str] | None:
    jt = vdir.files.get("json_types.json")
    pk = vdir.files.get("other.pickle")
    if jt is None or pk is None or jt.source is None or pk.source is None:
        return None
    try:
        saved = ctx.storage.read_json(jt.source)
        digest = hashlib.sha256(
            ctx.storage.read_bytes(pk.source, max_bytes=64 * 1024 * 1024)
        ).hexdigest()
    except TdckptError:
        return None
    if not isinstance(saved, dict) or saved.get("pickle_sha256") != digest:
        return None
    types = saved.get("types")
    if not isinstance(types, dict) or not all(
        v in ("dict", "OrderedDict", "list", "tuple") for v in types.values()
    ):
        ctx.add(
            "schema",
            jt.source,
            (),
            f"unknown type names in {types!r}; expected dict, OrderedDict, list or tuple.",
        )
        return None
    return {str(k): str(v) for k, v in types.items()}


def build_non_tensor(
    vdir: VDir, key: tuple[str, ...], ctx: LeafCtx, batch: tuple[int, ...]
) -> NonTensorNode | None:
    try:
        model = schema.NonTensorDataMeta.model_validate(vdir.meta)
    except pydantic.ValidationError as exc:
        schema_problems(ctx, exc, vdir.source, key)
        return None
    assert vdir.meta is not None
    cls = "MetaData" if "MetaData" in model.type_ else "NonTensorData"
    node = NonTensorNode(
        key=key,
        path=vdir.source,
        class_name=cls,
        batch_size=batch,
        device=None,
        metadata=model.metadata,
    )
    node.has_data = "data" in vdir.meta
    node.data = vdir.meta.get("data")
    node.json_types = _json_types(vdir, ctx)
    if node.json_types is None:
        node.pickle = vdir.files.get("other.pickle")
    if not node.has_data and node.pickle is None and node.json_types is None:
        ctx.add(
            "missing-file",
            join(vdir.source, "other.pickle"),
            key,
            "a non-tensor value with neither inline data nor its other.pickle; the value is "
            "lost. Restore the file from a backup.",
        )
        return None
    return node


def build_nt_stack(
    vdir: VDir, key: tuple[str, ...], ctx: LeafCtx, parent_batch: tuple[int, ...]
) -> NonTensorStackNode | None:
    try:
        model = schema.NonTensorStackMeta.model_validate(vdir.meta)
    except pydantic.ValidationError as exc:
        schema_problems(ctx, exc, vdir.source, key)
        return None
    if not check_device(ctx, vdir, key, model.device):
        return None
    node = NonTensorStackNode(
        key=key, path=vdir.source, stack_dim=model.stack_dim, device=model.device
    )
    if isinstance(model.data, list):
        # Every level of list nesting becomes a batch dimension when the stack is rebuilt.
        if _list_depth(model.data, 64) > 64:
            ctx.add(
                "bad-shape",
                join(vdir.source, "meta.json"),
                key,
                "the stacked values nest lists more than 64 levels deep, more batch dimensions "
                "than a tensordict can have. The metadata is damaged or hostile.",
            )
            return None
        if parent_batch and len(model.data) != parent_batch[0]:
            ctx.add(
                "batch-mismatch",
                join(vdir.source, "meta.json"),
                key,
                f"a stack of {len(model.data)} values in a level of batch size "
                f"{list(parent_batch)}. The metadata is damaged or was edited.",
            )
            return None
        node.data = model.data
    else:
        node.pickle = vdir.files.get("pickle.pkl")
        if node.pickle is None:
            ctx.add(
                "missing-file",
                join(vdir.source, "pickle.pkl"),
                key,
                "meta.json says the stack is pickled, but pickle.pkl is missing; "
                "restore it from a backup.",
            )
            return None
    return node


def _list_depth(data: list[Any], limit: int) -> int:
    """How deeply ``data`` nests lists (first elements only), up to ``limit + 1``."""
    depth = 0
    cur: Any = data
    while isinstance(cur, list) and depth <= limit:
        depth += 1
        cur = cur[0] if cur else None
    return depth
