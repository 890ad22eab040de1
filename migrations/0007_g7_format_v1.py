"""G7 -> G8: tensordict 0.15.3 format version 1 (``_format_version`` and ``_class``).

What changed in tensordict 0.15.3: meta.json gained a format marker. TensorDict,
LazyStackedTensorDict, NonTensorStack, ``_SubTensorDict``, lazy views and
PersistentTensorDict levels carry ``"_format_version": 1`` and ``"_class":
"<module>:<qualname>"`` (``tensordict:TensorDict`` for exported classes, the real module
for private ones); tensorclass and NonTensorData/MetaData levels carry neither. A file
without ``_format_version`` is version 0; a version above 1 is refused. Dimension names
are saved as ``"_names"`` (#3262 in tensordict's code) and lazy stacks gain
``"stack_dim_name"``. 0.15.3 still writes
meta.json with the stdlib json (``json.dumps`` defaults), NonTensorStack compact.

What this step does, per G7 directory (entries are kept; format fields are only added
where 0.15.3 writes them, and a key named like a format field keeps its entry, exactly as
tensordict's ``setdefault`` does):

* TensorDict-like levels: ``_format_version`` and ``_class`` after ``_type``; a device
  recorded as JSON null becomes the string ``"None"`` (tensordict's loader maps only that
  string back to None);
* LazyStackedTensorDict: ``{"_type", "_format_version", "_class", "stack_dim",
  "stack_dim_name": null}`` (the stack dimension name was never saved before);
* NonTensorStack: ``{"_type", "_format_version", "_class", "stack_dim", "device",
  "data"}``; a device string ``"None"`` becomes null (its loader calls
  ``torch.device(device)`` on anything else);
* sub-tensordicts and lazy views: the two fields, in tensordict's order;
* NonTensorData/MetaData: ``"_metadata": null`` and ``"_is_non_tensor": true`` when
  missing (0.5-0.9 omitted the latter, or wrote it as ``null``: the containers that
  ``from_pytree`` records), nothing else.

Lost content is recorded, naming the key: ``null`` values in files written by orjson
(0.5-0.15.1: NaN and +-inf were written as ``null``, so which ``null`` was NaN cannot be
known) and lists that may have been tuples (every release writes tuples as lists).
Dimension names were not saved before 0.15.3: whether a tensordict had any cannot be
seen, so that is an ``info`` problem (``names-not-saved``), not a loss.
"""

from __future__ import annotations

from typing import Any

from tdckpt._read.migrate import MigrationContext, Problem, Target, VDir, class_id_for, level_kind

FROM_VERSION = 7
TO_VERSION = 8

_NON_TENSOR_ORDER = ("_type", "data", "_metadata", "_is_non_tensor")


def upgrade(tree: VDir, ctx: MigrationContext) -> VDir:
    migrated = False
    for target in ctx.targets(tree):
        meta = target.node.meta
        if meta is None:
            continue
        migrated = True
        kind = level_kind(meta)
        if kind == "tensordict":
            _tensordict(target)
        elif kind == "lazy-stack":
            target.node.meta = _ordered(
                meta,
                {
                    "_type": meta.get("_type"),
                    "_format_version": 1,
                    "_class": class_id_for(meta),
                    "stack_dim": meta.get("stack_dim", 0),
                    "stack_dim_name": meta.get("stack_dim_name"),
                },
            )
        elif kind == "non-tensor-stack":
            device = meta.get("device")
            target.node.meta = _ordered(
                meta,
                {
                    "_type": meta.get("_type"),
                    "_format_version": 1,
                    "_class": class_id_for(meta),
                    "stack_dim": meta.get("stack_dim", 0),
                    "device": None if device in (None, "None") else device,
                    "data": meta.get("data"),
                },
            )
            # data is the list of the members: that list is the stack, not a value
            _note_values(
                target, ctx, meta.get("data"), "values of this NonTensorStack", members=True
            )
        elif kind == "sub-tensordict":
            target.node.meta = _ordered(
                meta,
                {
                    "_type": meta.get("_type"),
                    "_format_version": 1,
                    "_class": class_id_for(meta),
                    # a missing index stays missing (validation refuses it): written as
                    # null it read as the index None, i.e. source[None], silently
                    **({"index": meta["index"]} if "index" in meta else {}),
                },
            )
        elif kind == "lazy-view":
            meta.setdefault("_format_version", 1)
            meta.setdefault("_class", class_id_for(meta))
        elif kind == "non-tensor":
            # also beside an other.pickle (0.15.3 writes it there too; a pickled _metadata
            # still wins on load): a level left without it would keep the 0.5-0.14 marker
            # of the accidental _metadata pickle and be migrated again by every upgrade
            meta.setdefault("_metadata", None)
            if meta.get("_is_non_tensor") is None:  # absent, or null (0.5-0.9)
                meta["_is_non_tensor"] = True
            # 0.15.3's order (0.12-0.15.2 wrote _is_non_tensor before _metadata)
            target.node.meta = meta = _ordered(
                meta, {k: meta[k] for k in _NON_TENSOR_ORDER if k in meta}
            )
            if "data" in meta:
                _note_values(target, ctx, meta["data"], "this value")
        elif kind == "tensorclass":
            for field, value in meta.items():
                if field != "_type":
                    _note_values(target, ctx, value, f"its field {field!r}")
    if migrated:
        # Not a loss we can see (most tensordicts have no names), so it is an info for
        # `validate`/`inspect`, not a warning on every restore of an old checkpoint.
        ctx.problems.append(
            Problem(
                "names-not-saved",
                "info",
                "",
                (),
                "dimension names: tensordict before 0.15.3 did not save them; if the "
                "tensordict had named dimensions, the names are lost.",
            )
        )
    return tree


def _tensordict(target: Target) -> None:
    meta = target.node.meta
    assert meta is not None
    if meta.get("device", "None") is None:
        meta["device"] = "None"
    # setdefault, as tensordict: a key named "_format_version" or "_class" keeps its entry
    # (the level then reads as version 0, as it would with tensordict itself).
    meta.setdefault("_format_version", 1)
    meta.setdefault("_class", class_id_for(meta))


def _ordered(meta: dict[str, Any], head: dict[str, Any]) -> dict[str, Any]:
    """``head`` first (tensordict's order), then any other field the file had."""
    out = dict(head)
    for key, value in meta.items():
        out.setdefault(key, value)
    return out


def _note_values(
    target: Target, ctx: MigrationContext, value: Any, what: str, *, members: bool = False
) -> None:
    """Say what the old writer lost in ``value``; with ``members``, ``value`` is a stack's
    list of member values (its own list is structure, not a tuple that became a list)."""
    if ctx.is_compact(target.node) and _has(value, lambda v: v is None):
        ctx.lose(
            target,
            f"{what} holds null, written by orjson (tensordict 0.5-0.15.1), which also wrote "
            "NaN and +-inf as null: any of them that was NaN or infinite restores as None.",
        )
    values = value if members and isinstance(value, list) else [value]
    if any(_has(v, lambda v: isinstance(v, list)) for v in values):
        # An info, not a loss warned on every restore: a list is far more often a list, and
        # every tensordict release (0.15.3 too, which this chain migrates to) writes tuples
        # as JSON lists and loads them as lists, without a word. Nothing tells them apart.
        ctx.problem(
            "json-list",
            "info",
            target,
            f"{what} holds a list: tensordict writes tuples as JSON lists too, so if it was a "
            "tuple it restores as a list.",
        )


def _has(value: Any, pred: Any, depth: int = 0) -> bool:
    if pred(value):
        return True
    if depth > 100:
        return False
    if isinstance(value, list):
        return any(_has(v, pred, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_has(v, pred, depth + 1) for v in value.values())
    return False
