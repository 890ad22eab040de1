"""Compare a restored checkpoint with the ``expected`` record of a fixture manifest.

Every case of ``tests/fixtures/tensordict/<version>/manifest.json`` carries an ``expected``
record: what the writer was asked to save. :func:`assert_matches_expected` checks a restored
object against it and lists *every* difference, each prefixed with its key path
(``<root>['lvl1']['x']``, ``<root>[#1]['obs']`` for member 1 of a lazy stack).

Record shapes (all that occur in the corpus, versions 0.2.1 to 0.15.3)::

    collection  {"type": "TensorDict" | "LazyStackedTensorDict" | "tensorclass:<mod>.<qualname>",
                 "batch_size": [...], "entries": {key: entry}}          # root record (no "kind")
                LazyStackedTensorDict: {"type", "batch_size", "stack_dim", "items": [collection]}
    td          {"kind": "td", "type": "TensorDict", "batch_size", "entries"}   # nested TensorDict
    tc          {"kind": "tc", "type": "tensorclass:fixture_types.FixtureTC", "batch_size",
                 "entries"}                                                   # nested tensorclass
    tensor      {"kind": "tensor", "dtype": "torch.float32", "shape": [3, 2], "sha256": <hex>,
                 "nbytes": 24, "values": [[...], ...]}
    nested      {"kind": "nested_tensor", "layout": "torch.strided" | "torch.jagged",
                 "dtype": ..., "components": [tensor, ...]}   # one tensor record per component
    non_tensor  {"kind": "non_tensor", "py_type": "builtins.str", "repr": "'hello'"}

``sha256`` is the SHA-256 of the tensor's raw bytes in C-contiguous order and native byte
order (what a ``<key>.memmap`` file holds; the empty digest for zero elements). ``values`` is
``tensor.tolist()``, with complex numbers written as ``[real, imag]``; ``nbytes`` is
``numel * itemsize``. A tensorclass's non-tensor fields are ``non_tensor`` entries of its
``entries``. ``values`` is checked only when present.

The restored object may be a tensordict ``TensorDict``, ``LazyStackedTensorDict``, tensorclass
instance, ``NonTensorData`` or ``NonTensorStack`` (tensordict need not be installed otherwise),
or the *plain* form tdckpt restores into when tensordict is absent: a ``dict`` for a TensorDict
or a tensorclass, a ``list``/``tuple`` of members for a lazy stack, ``torch.Tensor`` leaves and
plain Python values for non-tensor data. A plain form carries no batch size, class name or
stack dimension, so those checks are skipped for it; everything else is compared.

``lost`` names entries that the *writer* destroyed (fixtures/tensordict/README.md): a path is a
top-level key (``"f_nan"``) or a tuple of keys (``("tc", "extra")``; an ``int`` selects a lazy-stack
member; ``()`` is the root). Only these documented losses are accepted, and only there:

* non-tensor entry: the exact value; or its JSON-degraded form (NaN and +-inf -> ``None``, tuple ->
  list, non-string dict keys -> strings, recursively; orjson writers 0.5-0.15.1 and stdlib
  writers); or no entry at all (G1 tensorclasses do not store non-tensor fields);
* tensorclass node: may come back as a ``TensorDict`` (G1 stores no class; the 0.10-0.13
  ``TensorClass``-subclass bug). Its entries are still compared.

A ``lost`` path that is not in the record, or that names a tensor or a TensorDict, is an error:
no writer loses tensor bytes, so there is nothing to excuse there.
"""

from __future__ import annotations

import ast
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

try:  # tensordict is optional: the plain-dict form needs none of it.
    from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDictBase
    from tensordict import is_tensorclass as _is_tensorclass
except ImportError:  # pragma: no cover - exercised only without tensordict
    LazyStackedTensorDict = NonTensorData = NonTensorStack = TensorDictBase = None

    def _is_tensorclass(obj: Any) -> bool:
        return False


__all__ = [
    "assert_matches_expected",
    "diff_expected",
    "iter_expected_tensors",
    "py_type_name",
    "tensor_bytes",
    "tensor_sha256",
]

Path_ = tuple[Any, ...]  # a key path: str keys, int lazy-stack members

_MISSING = object()
_NONE = object()  # sentinel for "no JSON-degraded form"


# --------------------------------------------------------------------------- public helpers


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Return the raw bytes of ``tensor`` as the generator hashed them.

    C-contiguous element order, native byte order, no header: exactly what a ``.memmap``
    leaf file holds. Works for every dtype (bool, bfloat16, float8, uint16-64, complex).
    """
    t = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """Return the hex SHA-256 of :func:`tensor_bytes`."""
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


def py_type_name(value: Any) -> str:
    """Return ``"<module>.<qualname>"`` of ``type(value)``, the manifests' ``py_type``."""
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def iter_expected_tensors(expected: Mapping[str, Any]) -> Iterator[tuple[Path_, Mapping[str, Any]]]:
    """Yield ``(path, tensor record)`` for every dense tensor record (nested components too)."""
    yield from _iter_records(expected, (), only_tensors=True)


def diff_expected(obj: Any, expected: Mapping[str, Any], *, lost: Iterable[Any] = ()) -> list[str]:
    """Return every difference between ``obj`` and the ``expected`` record (empty = match)."""
    lost_paths = _normalise_lost(lost, expected)
    out: list[str] = []
    _Comparer(out, lost_paths).node(obj, expected, ())
    return out


def assert_matches_expected(
    obj: Any, expected: Mapping[str, Any], *, lost: Iterable[Any] = ()
) -> None:
    """Assert that ``obj`` restores the manifest record ``expected``.

    Args:
        obj: the restored object (tensordict object or plain form, see the module docstring).
        expected: a manifest case's ``expected`` record.
        lost: entries the writer destroyed, where a documented loss is accepted.

    Raises:
        AssertionError: listing every difference, one line each, with its key path.
        ValueError: a ``lost`` path is unknown or names something that cannot be lost.
    """
    problems = diff_expected(obj, expected, lost=lost)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise AssertionError(
            f"restored object differs from the manifest record ({len(problems)}):\n{lines}"
        )


# --------------------------------------------------------------------------- record walking


def _is_collection_record(rec: Mapping[str, Any]) -> bool:
    return rec.get("kind") in (None, "td", "tc") and "type" in rec


def _iter_records(
    rec: Mapping[str, Any], path: Path_, *, only_tensors: bool = False
) -> Iterator[tuple[Path_, Mapping[str, Any]]]:
    kind = rec.get("kind")
    if kind == "tensor":
        yield path, rec
        return
    if kind == "nested_tensor":
        if not only_tensors:
            yield path, rec
        for i, comp in enumerate(rec.get("components", [])):
            yield (*path, f"<component {i}>"), comp
        return
    if not only_tensors:
        yield path, rec
    if rec.get("type") == "LazyStackedTensorDict":
        for i, item in enumerate(rec.get("items", [])):
            yield from _iter_records(item, (*path, i), only_tensors=only_tensors)
    for key, sub in rec.get("entries", {}).items():
        yield from _iter_records(sub, (*path, key), only_tensors=only_tensors)


def _normalise_lost(lost: Iterable[Any], expected: Mapping[str, Any]) -> set[Path_]:
    if isinstance(lost, (str, bytes)):
        raise TypeError(f"lost= takes a collection of paths, not the string {lost!r}")
    known = {path: rec for path, rec in _iter_records(expected, ())}
    paths: set[Path_] = set()
    for item in lost:
        path: Path_ = (item,) if isinstance(item, (str, int)) else tuple(item)
        if path not in known:
            raise ValueError(f"lost= names {fmt_path(path)}, which is not in the expected record")
        rec = known[path]
        losable = rec.get("kind") == "non_tensor" or str(rec.get("type", "")).startswith(
            "tensorclass:"
        )
        if not losable:
            raise ValueError(
                f"lost= names {fmt_path(path)}, a {rec.get('kind') or rec.get('type')} record: no "
                "writer destroys it (only non-tensor values and tensorclass identity can be lost)"
            )
        paths.add(path)
    return paths


def fmt_path(path: Path_) -> str:
    """Format a key path: ``<root>['a']['b']``, lazy-stack member ``[#1]``."""
    parts = ["<root>"]
    for p in path:
        parts.append(f"[#{p}]" if isinstance(p, int) else f"[{p!r}]")
    return "".join(parts)


# --------------------------------------------------------------------------- values


def _json_degraded(value: Any) -> Any:
    """What a JSON writer turns ``value`` into, or ``_NONE`` when it is unchanged."""

    def degrade(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, (list, tuple)):
            return [degrade(x) for x in v]
        if isinstance(v, dict):
            return {_json_key(k): degrade(x) for k, x in v.items()}
        return v

    out = degrade(value)
    same = py_type_name(out) == py_type_name(value) and _same_value(out, value)
    return _NONE if same else out


def _json_key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if key is True:
        return "true"
    if key is False:
        return "false"
    if key is None:
        return "null"
    return repr(key) if isinstance(key, float) else str(key)


def _literal_from_repr(text: str) -> Any:
    """Rebuild a builtin value from its repr (``nan``/``inf`` included), or ``_MISSING``."""
    specials = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
    if text in specials:
        return specials[text]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _MISSING


def _same_value(a: Any, b: Any) -> bool:
    """Structural equality where NaN equals NaN and bool is not an int."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _tensor_values(t: torch.Tensor) -> Any:
    values = t.detach().cpu().tolist()
    if t.is_complex():

        def split(v: Any) -> Any:
            if isinstance(v, list):
                return [split(x) for x in v]
            return [v.real, v.imag]

        values = split(values)
    return values


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- actual objects


def _is_nontensor_data(obj: Any) -> bool:
    return NonTensorData is not None and isinstance(obj, NonTensorData)


def _is_nontensor_stack(obj: Any) -> bool:
    return NonTensorStack is not None and isinstance(obj, NonTensorStack)


def _is_lazy_stack(obj: Any) -> bool:
    return (
        LazyStackedTensorDict is not None
        and isinstance(obj, LazyStackedTensorDict)
        and not _is_nontensor_stack(obj)
    )


def _is_tensordict(obj: Any) -> bool:
    return (
        TensorDictBase is not None
        and isinstance(obj, TensorDictBase)
        and not _is_nontensor_stack(obj)
    )


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        if obj.is_nested:
            return f"nested tensor ({obj.layout}, {obj.dtype})"
        return f"tensor {obj.dtype}{list(obj.shape)}"
    if _is_nontensor_data(obj) or _is_nontensor_stack(obj):
        return type(obj).__name__
    if _is_tensorclass(obj):
        return f"tensorclass {py_type_name(obj)}"
    if _is_tensordict(obj):
        return type(obj).__name__
    return f"{py_type_name(obj)} {_short(obj, 60)}"


def _nontensor_value(obj: Any) -> Any:
    if _is_nontensor_data(obj):
        return obj.data
    if _is_nontensor_stack(obj):
        return obj.tolist()
    return obj


def _children(obj: Any) -> dict[Any, Any] | None:
    """Return the entries of a TensorDict / tensorclass / plain dict; None for anything else."""
    if _is_tensorclass(obj) and not _is_nontensor_data(obj):
        out: dict[Any, Any] = {}
        inner = obj._tensordict
        # .keys(): iterating a TensorDict walks its first batch dimension, not its keys.
        for key in inner.keys():  # noqa: SIM118
            out[key] = inner.get(key)
        for key, value in (getattr(obj, "_non_tensordict", None) or {}).items():
            out.setdefault(key, value)
        return out
    if _is_tensordict(obj) and not _is_lazy_stack(obj):
        return {key: obj.get(key) for key in obj.keys()}  # noqa: SIM118
    if isinstance(obj, Mapping) and not _is_tensordict(obj):
        return dict(obj)
    return None


class _Comparer:
    def __init__(self, out: list[str], lost: set[Path_]) -> None:
        self.out = out
        self.lost = lost

    def fail(self, path: Path_, message: str) -> None:
        self.out.append(f"{fmt_path(path)}: {message}")

    # -- dispatch
    def node(self, obj: Any, rec: Mapping[str, Any], path: Path_) -> None:
        kind = rec.get("kind")
        if kind == "tensor":
            self.tensor(obj, rec, path)
        elif kind == "nested_tensor":
            self.nested_tensor(obj, rec, path)
        elif kind == "non_tensor":
            self.non_tensor(obj, rec, path)
        elif kind in (None, "td", "tc") and rec.get("type") == "LazyStackedTensorDict":
            self.lazy_stack(obj, rec, path)
        elif kind in (None, "td", "tc") and "type" in rec:
            self.collection(obj, rec, path)
        else:
            raise ValueError(
                f"{fmt_path(path)}: unsupported expected record (kind={kind!r}, "
                f"keys={sorted(rec)}); teach tests/_expected.py this shape"
            )

    # -- collections
    def collection(self, obj: Any, rec: Mapping[str, Any], path: Path_) -> None:
        children = _children(obj)
        if children is None:
            self.fail(path, f"expected {rec['type']}, got {_describe(obj)}")
            return
        plain = not (_is_tensordict(obj) or _is_tensorclass(obj))
        if not plain:
            self.check_type(obj, rec, path)
            self.check_batch(obj, rec, path)
        entries: Mapping[str, Any] = rec.get("entries", {})
        for key, sub in entries.items():
            sub_path = (*path, key)
            if key not in children:
                if sub_path in self.lost and sub.get("kind") == "non_tensor":
                    continue  # the writer did not store it (documented loss)
                self.fail(path, f"missing key {key!r} (expected {_record_summary(sub)})")
                continue
            self.node(children[key], sub, sub_path)
        for key in children:
            if key not in entries:
                self.fail(path, f"unexpected key {key!r} ({_describe(children[key])})")

    def check_type(self, obj: Any, rec: Mapping[str, Any], path: Path_) -> None:
        want = rec["type"]
        got = f"tensorclass:{py_type_name(obj)}" if _is_tensorclass(obj) else type(obj).__name__
        if got == want:
            return
        if path in self.lost and want.startswith("tensorclass:") and got == "TensorDict":
            return  # class identity not stored by the writer (documented loss)
        self.fail(path, f"type {got!r} != expected {want!r}")

    def check_batch(self, obj: Any, rec: Mapping[str, Any], path: Path_) -> None:
        if "batch_size" not in rec:
            return
        got = list(obj.batch_size)
        if got != list(rec["batch_size"]):
            self.fail(path, f"batch_size {got} != expected {rec['batch_size']}")

    def lazy_stack(self, obj: Any, rec: Mapping[str, Any], path: Path_) -> None:
        items: Sequence[Mapping[str, Any]] = rec.get("items", [])
        if _is_lazy_stack(obj):
            self.check_type(obj, rec, path)
            self.check_batch(obj, rec, path)
            if "stack_dim" in rec and obj.stack_dim != rec["stack_dim"]:
                self.fail(path, f"stack_dim {obj.stack_dim} != expected {rec['stack_dim']}")
            members = list(obj.tensordicts)
        elif isinstance(obj, (list, tuple)):
            members = list(obj)  # plain form: the members in order
        else:
            self.fail(
                path,
                f"expected LazyStackedTensorDict of {len(items)} members, got {_describe(obj)}",
            )
            return
        if len(members) != len(items):
            self.fail(path, f"{len(members)} lazy-stack members != expected {len(items)}")
        for i, (member, item) in enumerate(zip(members, items, strict=False)):
            self.node(member, item, (*path, i))

    # -- leaves
    def tensor(self, obj: Any, rec: Mapping[str, Any], path: Path_) -> None:
        if not isinstance(obj, torch.Tensor) or obj.is_nested:
            self.fail(path, f"expected tensor {rec['dtype']}{rec['shape']}, got {_describe(obj)}")
            return
        self.tensor_body(obj, rec, path)

    def tensor_body(self, t: torch.Tensor, rec: Mapping[str, Any], path: Path_) -> None:
        if str(t.dtype) != rec["dtype"]:
            self.fail(path, f"dtype {t.dtype} != expected {rec['dtype']}")
            return  # bytes and values cannot match either; one line is enough
        if list(t.shape) != list(rec["shape"]):
            self.fail(path, f"shape {list(t.shape)} != expected {rec['shape']}")
            return
        if "nbytes" in rec and t.numel() * t.element_size() != rec["nbytes"]:
            self.fail(path, f"nbytes {t.numel() * t.element_size()} != expected {rec['nbytes']}")
        if "sha256" in rec:
            got = tensor_sha256(t)
            if got != rec["sha256"]:
                self.fail(path, f"sha256 of the raw bytes {got} != expected {rec['sha256']}")
        if "values" in rec:
            got_values = _tensor_values(t)
            if not _same_value(got_values, rec["values"]):
                self.fail(path, f"values {_short(got_values)} != expected {_short(rec['values'])}")

    def nested_tensor(self, obj: Any, rec: Mapping[str, Any], path: Path_) -> None:
        if not isinstance(obj, torch.Tensor) or not obj.is_nested:
            self.fail(
                path,
                f"expected nested tensor ({rec.get('layout')}, {rec.get('dtype')}), "
                f"got {_describe(obj)}",
            )
            return
        if "layout" in rec and str(obj.layout) != rec["layout"]:
            self.fail(path, f"nested layout {obj.layout} != expected {rec['layout']}")
        if "dtype" in rec and str(obj.dtype) != rec["dtype"]:
            self.fail(path, f"dtype {obj.dtype} != expected {rec['dtype']}")
            return
        components = list(obj.unbind(0))
        want = rec.get("components", [])
        if len(components) != len(want):
            self.fail(path, f"{len(components)} nested components != expected {len(want)}")
        for i, (comp, crec) in enumerate(zip(components, want, strict=False)):
            self.tensor(comp, crec, (*path, f"<component {i}>"))

    def non_tensor(self, obj: Any, rec: Mapping[str, Any], path: Path_) -> None:
        if isinstance(obj, torch.Tensor) or (
            (_is_tensordict(obj) or _is_tensorclass(obj))
            and not (_is_nontensor_data(obj) or _is_nontensor_stack(obj))
        ):
            self.fail(
                path, f"expected non-tensor {rec['py_type']} {rec['repr']}, got {_describe(obj)}"
            )
            return
        value = _nontensor_value(obj)
        got_type, got_repr = py_type_name(value), repr(value)
        if got_type == rec["py_type"] and got_repr == rec["repr"]:
            return
        if path in self.lost:
            original = _literal_from_repr(rec["repr"])
            if original is not _MISSING:
                degraded = _json_degraded(original)
                if (
                    degraded is not _NONE
                    and py_type_name(value) == py_type_name(degraded)
                    and _same_value(value, degraded)
                ):
                    return  # the documented JSON degradation of what was written
        if got_type != rec["py_type"]:
            self.fail(
                path, f"python type {got_type} != expected {rec['py_type']} (value {_short(value)})"
            )
        else:
            self.fail(path, f"value {got_repr} != expected {rec['repr']}")


def _record_summary(rec: Mapping[str, Any]) -> str:
    kind = rec.get("kind")
    if kind == "tensor":
        return f"tensor {rec['dtype']}{rec['shape']}"
    if kind == "nested_tensor":
        return f"nested tensor {rec.get('layout')} {rec.get('dtype')}"
    if kind == "non_tensor":
        return f"non-tensor {rec['py_type']} {rec['repr']}"
    return str(rec.get("type"))
