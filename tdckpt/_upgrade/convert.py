"""An upgrade's pickles: moved into meta.json when the caller trusts them, else listed as kept.

Legacy writers pickle the non-tensor fields of tensorclasses and ``NonTensorData``
(``other.pickle``) and the values of a ``NonTensorStack`` (``pickle.pkl``). With
``convert_pickles=True`` (the caller trusts the data, as with ``allow_pickle=True``)
:func:`convert_tree_pickles` unpickles each one and, when every value is plain JSON data,
moves the values into the level's ``meta.json`` and drops the pickle, so the upgraded
checkpoint loads with ``allow_pickle=False``. Without it nothing is ever unpickled; every
pickle is listed as kept.
"""

from __future__ import annotations

import pickle
from typing import Any

from tdckpt._read.detect import level_kind
from tdckpt._read.storage import Storage, join
from tdckpt._read.tree import VDir, VFile

__all__ = ["convert_tree_pickles", "is_json_data"]

#: ``_metadata`` entries tensordict 0.5-0.14 pickled by accident (memmap bookkeeping).
_BOOKKEEPING = frozenset({"memmap_prefix", "memmaped", "_share_non_tensor"})


def is_json_data(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` round-trips through JSON unchanged (tuples do not: they are lists).

    >>> is_json_data({"a": [1, 2.5, None, True, "x"]}), is_json_data((1, 2)), is_json_data({1: 2})
    (True, False, False)
    """
    if depth > 500:
        return False
    t = type(value)
    if value is None or t in (str, int, float, bool):
        return True
    if t is list:
        return all(is_json_data(v, depth + 1) for v in value)
    if t is dict:
        return all(type(k) is str and is_json_data(v, depth + 1) for k, v in value.items())
    return False


def convert_tree_pickles(
    tree: VDir, storage: Storage, *, convert: bool
) -> tuple[list[str], list[str]]:
    """Convert (``convert``) or inventory every pickle of the tree, in place.

    Returns ``(converted, kept)``: the pickle files converted, and those kept, each with
    the reason.
    """
    converted: list[str] = []
    kept: list[str] = []
    for node in tree.walk():
        meta = node.meta
        if meta is None:
            continue
        kind = level_kind(meta)
        name = "pickle.pkl" if kind == "non-tensor-stack" else "other.pickle"
        vfile = node.files.get(name)
        if vfile is None or kind not in ("non-tensor", "tensorclass", "non-tensor-stack"):
            continue
        where = join(node.source, name) if vfile.source is None else vfile.source
        if not convert:
            kept.append(f"{where}: not converted (convert_pickles=False)")
            continue
        reason = _convert_one(node, kind, name, vfile, storage)
        if reason is None:
            converted.append(where)
        else:
            kept.append(f"{where}: {reason}")
    return converted, kept


def _convert_one(node: VDir, kind: str, name: str, vfile: VFile, storage: Storage) -> str | None:
    """Move a pickle's values into meta.json; return why not, or None when done."""
    meta = node.meta
    assert meta is not None
    try:
        raw = (
            vfile.data
            if vfile.data is not None
            else storage.read_bytes(vfile.source or "", max_bytes=max(vfile.size, 1))
        )
        value = pickle.loads(raw)  # the caller trusts this checkpoint (convert_pickles=True)
    except Exception as exc:
        return f"cannot be unpickled here ({type(exc).__name__}: {exc})"
    if kind == "non-tensor-stack":
        if not is_json_data(value) or not isinstance(value, list):
            return f"holds {_type_of(value)} values, which are not plain JSON data"
        meta["data"] = value
        del node.files[name]
        return None
    if not isinstance(value, dict):
        return f"holds a {_type_of(value)}, expected a dict of fields"
    updates: dict[str, Any] = {}
    for field_name, field_value in value.items():
        if kind == "non-tensor" and field_name == "_metadata":
            field_value = _strip_bookkeeping(field_value)
        if not isinstance(field_name, str) or not is_json_data(field_value):
            return f"{field_name!r} is a {_type_of(field_value)}, not plain JSON data"
        updates[field_name] = field_value
    if kind == "non-tensor":
        order = ["_type", "data", "_metadata", "_is_non_tensor"]
        merged = {**meta, **updates}
        node.meta = {k: merged[k] for k in order if k in merged}
        node.meta.update({k: v for k, v in merged.items() if k not in node.meta})
    else:
        meta.update(updates)
    del node.files[name]
    node.files.pop("json_types.json", None)  # described the pickle, now gone
    return None


def _strip_bookkeeping(value: Any) -> Any:
    if isinstance(value, dict) and value and set(value) & _BOOKKEEPING:
        rest = {k: v for k, v in value.items() if k not in _BOOKKEEPING}
        return rest or None
    return value


def _type_of(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
