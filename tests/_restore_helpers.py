"""Helpers shared by the restore acceptance tests (differential, failure, pickle, property).

* :func:`state` - a complete, comparable description of a restored object: classes, batch
  sizes, devices, dimension names, keys at every level, leaf types, dtypes, shapes and raw
  bytes, non-tensor values, lock and memmap state, memmap prefixes and leaf file names (paths
  are written relative to the given roots, so two copies of a checkpoint compare equal).
* :func:`objects` / :func:`reused` - the Python objects of a target by key path, to prove that
  nested objects are reused (the same object) and leaves are replaced.
* :func:`make_target` - a target shaped like a checkpoint's content, with other values and stale
  keys at every level, built the same way twice (one for tdckpt, one for tensordict).
* :func:`reference` - a call into tensordict itself, with tensordict's own internal warnings
  silenced only there (tdckpt's calls always run under ``filterwarnings = error``).
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from _expected import tensor_bytes
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_tensorclass,
)
from tensordict.memmap import MemoryMappedTensor

__all__ = [
    "STALE",
    "diff_states",
    "drop_empty_leaf_types",
    "is_collection",
    "make_target",
    "objects",
    "reference",
    "reused",
    "settle_non_tensor_differences",
    "state",
]

#: The key added at every level of a target; every restore must remove it.
STALE = "zz_stale"


@contextmanager
def reference() -> Iterator[None]:
    """Run tensordict's own load (the reference) without its internal warnings failing the test.

    tensordict emits unrelated warnings from inside (the prototype nested-tensor UserWarning,
    its own pickle FutureWarning); the tests compare *results*, and tdckpt's warnings are
    asserted separately and never silenced.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def is_collection(obj: Any) -> bool:
    """A TensorDict level, lazy stack or tensorclass (not NonTensorData/NonTensorStack)."""
    if isinstance(obj, (NonTensorData, NonTensorStack)):
        return False
    return isinstance(obj, TensorDictBase) or is_tensorclass(obj)


def _rel(path: Any, roots: Sequence[tuple[str, str]]) -> Any:
    if path is None:
        return None
    text = os.path.abspath(os.fspath(path))
    for root, label in roots:
        root = os.path.abspath(root)
        if text == root:
            return label
        if text.startswith(root + os.sep):
            return f"{label}/{Path(text[len(root) + 1 :]).as_posix()}"
    return f"<elsewhere>/{Path(text).name}"


def _tensor_state(t: torch.Tensor, roots: Sequence[tuple[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "leaf": type(t).__name__,
        "dtype": str(t.dtype),
        "device": str(t.device),
        "is_nested": bool(t.is_nested),
    }
    if t.is_nested:
        parts = t.unbind(0)
        out["shape"] = [list(p.shape) for p in parts]
        out["sha256"] = [hashlib.sha256(tensor_bytes(p)).hexdigest() for p in parts]
    else:
        out["shape"] = list(t.shape)
        out["sha256"] = hashlib.sha256(tensor_bytes(t)).hexdigest()
    if isinstance(t, MemoryMappedTensor):
        # tensordict 0.14 maps archive leaves as MemoryMappedTensors without a file
        # (``filename`` raises there); 0.15 gives them a file name or plain tensors
        name = getattr(t, "_filename", None)
        out["filename"] = _rel(name, roots) if name is not None else None
        out["mode"] = getattr(t, "_mode", None)
    return out


def _value_state(value: Any, roots: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    text = repr(value)
    for root, label in sorted(roots, key=lambda r: -len(r[0])):
        text = text.replace(os.path.abspath(root), label)
    return {"py_type": f"{type(value).__module__}.{type(value).__qualname__}", "repr": text}


def _names(td: TensorDictBase) -> Any:
    try:
        return list(td.names)
    except Exception:  # pragma: no cover - a class without names
        return "<n/a>"


def state(obj: Any, *roots: tuple[str | os.PathLike[str], str], memmap: bool = True) -> Any:
    """Describe ``obj`` completely; paths under each ``(root, label)`` become ``label/...``.

    ``memmap=False`` leaves out lock/memmap state and file names (to compare contents only).
    """
    norm = [(os.fspath(r), label) for r, label in roots]
    return _state(obj, norm, memmap)


def _state(obj: Any, roots: Sequence[tuple[str, str]], memmap: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        out = _tensor_state(obj, roots)
        if not memmap:
            out.pop("filename", None)
            out.pop("mode", None)
        return out
    if isinstance(obj, NonTensorStack):
        return {
            "class": type(obj).__name__,
            "batch_size": list(obj.batch_size),
            "stack_dim": obj.stack_dim,
            "data": _value_state(obj.tolist(), roots),
        }
    if isinstance(obj, NonTensorData):
        out = {
            "class": type(obj).__name__,
            "batch_size": list(obj.batch_size),
            "data": _value_state(obj.data, roots),
            "metadata": _value_state(getattr(obj, "_metadata", None), roots),
            "fields": sorted(obj._non_tensordict),
        }
        if memmap:
            out["locked"] = obj.is_locked
            out["is_memmap"] = obj.is_memmap()
            out["prefix"] = _rel(obj._tensordict._memmap_prefix, roots)
        return out
    if is_tensorclass(obj):
        return {
            "class": f"{type(obj).__module__}.{type(obj).__qualname__}",
            "fields": {k: _value_state(v, roots) for k, v in sorted(obj._non_tensordict.items())},
            "td": _state(obj._tensordict, roots, memmap),
        }
    if isinstance(obj, LazyStackedTensorDict):
        out = {
            "class": type(obj).__name__,
            "batch_size": list(obj.batch_size),
            "stack_dim": obj.stack_dim,
            "members": [_state(m, roots, memmap) for m in obj.tensordicts],
        }
        if memmap:
            out["locked"] = obj.is_locked
        return out
    if isinstance(obj, TensorDictBase):
        out = {
            "class": type(obj).__name__,
            "batch_size": list(obj.batch_size),
            "device": str(obj.device),
            "names": _names(obj),
            "keys": sorted(obj._tensordict),
            "entries": {k: _state(v, roots, memmap) for k, v in sorted(obj._tensordict.items())},
        }
        if memmap:
            out["locked"] = obj.is_locked
            out["is_memmap"] = obj.is_memmap()
            out["prefix"] = _rel(obj._memmap_prefix, roots)
        return out
    if isinstance(obj, dict):
        return {"class": "dict", "entries": {k: _state(v, roots, memmap) for k, v in obj.items()}}
    return _value_state(obj, roots)


def objects(obj: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    """Every object of ``obj`` by key path (collections, leaves, non-tensor wrappers).

    Lazy-stack members are ``int`` path parts; a tensorclass's inner TensorDict is ``"<td>"``.
    The dict holds the objects, so their ids cannot be reused while it lives.
    """
    out: dict[tuple[Any, ...], Any] = {path: obj}
    if is_tensorclass(obj) and not isinstance(obj, NonTensorData):
        out.update(objects(obj._tensordict, (*path, "<td>")))
    elif isinstance(obj, NonTensorStack):
        pass
    elif isinstance(obj, LazyStackedTensorDict):
        for i, member in enumerate(obj.tensordicts):
            out.update(objects(member, (*path, i)))
    elif isinstance(obj, TensorDictBase) and not isinstance(obj, NonTensorData):
        for key, value in obj._tensordict.items():
            out.update(objects(value, (*path, key)))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            out.update(objects(value, (*path, key)))
    return out


def reused(before: dict[tuple[Any, ...], Any], after: Any) -> dict[str, list[str]]:
    """Which paths hold the very same object after a restore as before, split by kind."""
    now = objects(after)
    same = sorted(
        (p for p, obj in now.items() if p in before and before[p] is obj), key=lambda p: str(p)
    )
    return {
        "collections": [str(p) for p in same if is_collection(now[p])],
        "leaves": [str(p) for p in same if isinstance(now[p], torch.Tensor)],
        "other": [
            str(p)
            for p in same
            if not is_collection(now[p]) and not isinstance(now[p], torch.Tensor)
        ],
    }


def _perturb_tensor(t: torch.Tensor) -> torch.Tensor:
    if t.is_nested:
        with reference():  # torch's prototype-API UserWarning
            return torch.nested.nested_tensor([torch.zeros_like(p) for p in t.unbind(0)])
    if t.dtype == torch.bool:
        return (
            torch.ones(t.shape, dtype=torch.bool)
            if t.numel()
            else torch.empty(t.shape, dtype=torch.bool)
        )
    try:
        return torch.full(t.shape, 7, dtype=t.dtype)
    except RuntimeError:  # float8 and friends: fill through float32
        return torch.full(t.shape, 7.0).to(t.dtype)


def _perturb(obj: Any, *, stale: bool = True) -> Any:
    """A copy of ``obj`` with other leaf values and a stale key at every TensorDict level.

    A tensorclass's own TensorDict gets no stale key (a tensorclass refuses unknown fields).
    """
    if isinstance(obj, torch.Tensor):
        return _perturb_tensor(obj)
    if isinstance(obj, NonTensorStack):
        return (
            NonTensorStack(
                *[
                    NonTensorData("old", batch_size=obj.batch_size[1:])
                    for _ in range(obj.batch_size[0])
                ]
            )
            if obj.batch_size
            else obj.clone()
        )
    if isinstance(obj, NonTensorData):
        return NonTensorData("old", batch_size=obj.batch_size)
    if is_tensorclass(obj):
        inner = _perturb(obj._tensordict, stale=False)
        fields = {k: "old" for k in obj._non_tensordict}
        return type(obj)._from_tensordict(inner, fields)
    if isinstance(obj, LazyStackedTensorDict):
        return LazyStackedTensorDict(
            *[_perturb(m) for m in obj.tensordicts], stack_dim=obj.stack_dim
        )
    if isinstance(obj, TensorDictBase):
        td = TensorDict(batch_size=obj.batch_size, device=obj.device)
        for key, value in obj._tensordict.items():
            td._tensordict[key] = _perturb(value)
        if stale:
            td._tensordict[STALE] = torch.zeros(obj.batch_size)
        return td
    raise TypeError(type(obj))


def make_target(content: Any, *, stale_nested: bool = True) -> Any:
    """A fresh target shaped like ``content``: other values, stale keys at every level.

    With ``stale_nested``, a TensorDict root also gets a stale nested TensorDict.
    """
    target = _perturb(content)
    inner = target._tensordict if is_tensorclass(target) else target
    if stale_nested and type(inner) is TensorDict:
        inner._tensordict[f"{STALE}_nested"] = TensorDict(
            {STALE: torch.zeros(inner.batch_size)}, batch_size=inner.batch_size
        )
    return target


def paths_with_key(obj: Any, key: str) -> list[tuple[Any, ...]]:
    """Every path whose last part is ``key`` (stale keys left behind)."""
    return [p for p in objects(obj) if p and p[-1] == key]


Loader = Callable[[Any, Path], Any]


def diff_states(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Every difference between two :func:`state` results, one ``path: ours != theirs`` each."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out: list[str] = []
        for key in sorted(set(ours) | set(theirs), key=str):
            if key not in ours or key not in theirs:
                mine, other = ours.get(key, "<absent>"), theirs.get(key, "<absent>")
                out.append(f"{path}/{key}: {mine!r:.200} != {other!r:.200}")
            else:
                out.extend(diff_states(ours[key], theirs[key], f"{path}/{key}"))
        return out
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        out = []
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            out.extend(diff_states(a, b, f"{path}[{i}]"))
        return out
    return [] if ours == theirs else [f"{path}: {ours!r:.200} != {theirs!r:.200}"]


# ------------------------------------------------- differences from tensordict, settled


def non_tensor_states(st: Any) -> list[dict[str, Any]]:
    if isinstance(st, dict):
        found = [st] if st.get("class") in ("NonTensorData", "MetaData") else []
        return found + [x for v in st.values() for x in non_tensor_states(v)]
    if isinstance(st, list):
        return [x for v in st for x in non_tensor_states(v)]
    return []


def settle_non_tensor_differences(ours: Any, theirs: Any, kind: str, keeps_dir: bool) -> None:
    """Check and remove two known differences in NonTensorData entries of memmapped targets.

    ``ours`` is tdckpt's :func:`state`, ``theirs`` tensordict's; see ``TD_NTD_METADATA_BOOKKEEPING``
    and ``TD_NTD_STALE_PREFIX`` in ``test_restore.py`` for why tdckpt is right.
    """
    if kind != "memmapped":
        return
    pairs = list(zip(non_tensor_states(ours), non_tensor_states(theirs), strict=True))
    for a, b in pairs:
        if keeps_dir:  # TD_NTD_METADATA_BOOKKEEPING
            assert b["metadata"]["repr"].startswith("{'memmap_prefix': PosixPath('<ckpt>/")
            assert "memmap_prefix" not in a["metadata"]["repr"], (
                "tdckpt restores the saved _metadata"
            )
            a.pop("metadata")
            b.pop("metadata")
        elif "prefix" in b:  # TD_NTD_STALE_PREFIX (absent from a state(memmap=False))
            assert b["prefix"] is not None and b["prefix"].startswith("<own>/")
            assert a["prefix"] is None
            a.pop("prefix")
            b.pop("prefix")


def drop_empty_leaf_types(st: Any) -> None:
    """Forget leaf type, file name and mode of every zero-element leaf of a :func:`state`."""
    if isinstance(st, dict):
        shape = st.get("shape")
        flat = isinstance(shape, list) and all(isinstance(n, int) for n in shape)
        if "leaf" in st and flat and len(shape) and math.prod(shape) == 0:
            for key in ("leaf", "filename", "mode"):
                st.pop(key, None)
        for value in st.values():
            drop_empty_leaf_types(value)
    elif isinstance(st, list):
        for value in st:
            drop_empty_leaf_types(value)
