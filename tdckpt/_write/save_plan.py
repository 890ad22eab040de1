"""Check an object and plan every file of its checkpoint, as tensordict 0.15.3 lays them out.

:func:`plan_checkpoint` walks the object as tensordict's ``_memmap_`` does and records,
without writing anything, every directory, ``meta.json`` (the exact bytes 0.15.3 writes),
pickle and leaf tensor of format v1, plus every key the format cannot store faithfully (a
key named ``shape``, two keys sharing a file, jagged nested tensors, names too long, ...).
:func:`tdckpt._write.save.write_checkpoint` refuses a plan with problems and executes the others.

How it mirrors tensordict (``_td_memmap.py``, ``TensorDict._memmap_``,
``LazyStackedTensorDict._memmap_``, the tensorclass / ``NonTensorData`` /
``NonTensorStack`` ``_memmap_``) is noted next to each method of the planner.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing.managers
import multiprocessing.sharedctypes
import pickle
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from tdckpt._keys import encode_key
from tdckpt.schema import FORMAT_VERSION, MANIFEST_NAME, PickleRecord

__all__ = ["Op", "Plan", "class_id", "plan_checkpoint"]

#: NAME_MAX of Linux file systems, in bytes.
_MAX_NAME_BYTES = 255
#: Keys of a TensorDict level whose entries tensordict overwrites with its own fields.
_RESERVED_KEYS = ("shape", "device", "_type")
#: NonTensorData._memmap_ drops these from _metadata: they describe a live memmap.
_LIVE_METADATA = ("memmap_prefix", "memmaped", "_share_non_tensor")
#: tensorclass._JSON_TYPE_NAMES: classes recorded in json_types.json instead of pickle only.
_JSON_TYPE_NAMES: dict[type, str] = {
    dict: "dict",
    OrderedDict: "OrderedDict",
    list: "list",
    tuple: "tuple",
}
_JSON_TYPES_FILE = "json_types.json"
_TENSORDICT_DIR = "_tensordict"


# -- tensordict's rules for non-tensor values --------------------------------------------------


def _is_json_serializable(item: Any) -> bool:
    """tensordict.utils._is_json_serializable (0.15.3): what goes inline instead of pickle."""
    if isinstance(item, dict):
        return all(isinstance(k, str) and _is_json_serializable(v) for k, v in item.items())
    if isinstance(item, (list, tuple)):
        return all(_is_json_serializable(v) for v in item)
    return isinstance(item, (str, int, float, bool)) or item is None


def _from_shared_nontensor(value: Any) -> Any:
    """tensorclass._from_shared_nontensor: the plain value behind a shared one."""
    if isinstance(value, multiprocessing.managers.ListProxy):
        return list(value)
    if isinstance(value, multiprocessing.managers.DictProxy):
        return dict(value)
    if isinstance(value, multiprocessing.sharedctypes.Synchronized):
        return value.value
    if isinstance(value, multiprocessing.sharedctypes.SynchronizedArray):
        out = []
        for byte in value[:]:
            if byte == b"\x00":
                break
            out.append(byte)
        return b"".join(out).decode("utf-8")
    return value


# -- the format's class identifiers ------------------------------------------------------------


def class_id(cls: type) -> str:
    """``"module:qualname"`` of ``cls``, with module ``tensordict`` for its exports.

    The ``"_class"`` field of format v1 (``_td_memmap._class_id``).
    """
    import tensordict

    module = cls.__module__
    if getattr(tensordict, cls.__qualname__, None) is cls:
        module = "tensordict"
    return f"{module}:{cls.__qualname__}"


def _format_metadata(cls: type) -> dict[str, Any]:
    return {"_format_version": FORMAT_VERSION, "_class": class_id(cls)}


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def _show_key(key: tuple[str, ...]) -> str:
    return "the root" if not key else f"key {key!r}"


# -- plan: check everything, decide every file, before writing any ---------------------------


@dataclass
class Op:
    """One planned directory, small file (``data``) or leaf file (``tensor``)."""

    kind: str  # "dir" | "bytes" | "tensor"
    rel: str
    key: tuple[str, ...] | None = None
    data: bytes | None = None
    tensor: torch.Tensor | None = None


@dataclass
class Plan:
    """Everything to write, in order, and every problem that forbids writing it."""

    ops: list[Op] = field(default_factory=list)
    pickles: list[PickleRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    problem_keys: list[tuple[str, ...]] = field(default_factory=list)

    def problem(self, key: tuple[str, ...], message: str) -> None:
        self.problems.append(f"{_show_key(key)}: {message}")
        self.problem_keys.append(key)


class _Planner:
    """Walks the object as tensordict's ``_memmap_`` does, recording what to write."""

    def __init__(self) -> None:
        import tensordict
        from tensordict import (
            LazyStackedTensorDict,
            NonTensorStack,
            TensorDict,
            is_non_tensor,
            is_tensor_collection,
            is_tensorclass,
        )

        self.td = tensordict
        self.TensorDict = TensorDict
        self.LazyStackedTensorDict = LazyStackedTensorDict
        self.NonTensorStack = NonTensorStack
        self.is_non_tensor = is_non_tensor
        self.is_tensor_collection = is_tensor_collection
        self.is_tensorclass = is_tensorclass
        self.plan = Plan()

    # -- helpers --------------------------------------------------------------------------
    def _bytes(self, rel: str, data: bytes, key: tuple[str, ...] | None) -> None:
        self.plan.ops.append(Op("bytes", rel, key, data=data))

    def _dumps(self, obj: Any, key: tuple[str, ...], **kwargs: Any) -> bytes:
        # tensordict writes with the stdlib json (its default backend) and these defaults.
        try:
            return json.dumps(obj, **kwargs).encode("utf-8")
        except (ValueError, TypeError, RecursionError) as exc:
            self.plan.problem(key, f"its value cannot be written as JSON ({exc}).")
            return b""

    def _pickle(self, obj: Any, key: tuple[str, ...]) -> bytes:
        try:
            return pickle.dumps(obj)
        except Exception as exc:
            self.plan.problem(
                key,
                f"its non-JSON value must be pickled, and pickling failed "
                f"({type(exc).__name__}: {exc}). Store a picklable value or plain JSON data.",
            )
            return b""

    def _claim(
        self, names: dict[str, tuple[str, ...]], name: str, key: tuple[str, ...], rel: str
    ) -> None:
        """Reserve a file or directory name of one directory, refusing clashes."""
        try:
            size = len(name.encode("utf-8"))
        except UnicodeEncodeError:
            self.plan.problem(
                key,
                f"its file name {name!r} is not valid UTF-8 (a lone surrogate?); rename the key.",
            )
            return
        if size > _MAX_NAME_BYTES:
            self.plan.problem(
                key,
                f"its encoded file name is {size} bytes long, more than the {_MAX_NAME_BYTES} "
                "bytes a file system allows (each unsafe character becomes %XX). Use a "
                "shorter key.",
            )
        other = names.get(name)
        if other is not None:
            where = f"in {rel!r}" if rel else "at the top level"
            what = f"the {_show_key(other)}" if other != ("\0",) else "tdckpt's own file"
            self.plan.problem(
                key,
                f"its file {name!r} {where} is also the file of {what}, so one would "
                "overwrite the other. Rename one of the keys.",
            )
            return
        names[name] = key

    # -- dispatch -------------------------------------------------------------------------
    def collection(self, obj: Any, rel: str, key: tuple[str, ...]) -> None:
        kind = type(obj)
        if isinstance(obj, self.NonTensorStack):
            self.non_tensor_stack(obj, rel, key)
        elif self.is_non_tensor(obj):
            self.non_tensor_data(obj, rel, key)
        elif self.is_tensorclass(obj):
            self.tensorclass(obj, rel, key)
        elif isinstance(obj, self.LazyStackedTensorDict) and (
            kind._memmap_ is self.LazyStackedTensorDict._memmap_
        ):
            self.lazy_stack(obj, rel, key)
        elif isinstance(obj, self.TensorDict) and kind._memmap_ is self.TensorDict._memmap_:
            self.tensordict(obj, rel, key)
        else:
            self.plan.problem(
                key,
                f"a {kind.__module__}.{kind.__qualname__} is not one of the collections the "
                "checkpoint format stores (TensorDict, LazyStackedTensorDict, tensorclass, "
                "NonTensorData, NonTensorStack). Convert it first, e.g. with "
                ".to_tensordict().",
            )

    # -- TensorDict (TensorDict._memmap_ + _td_memmap._save_metadata) --------------------------
    def tensordict(self, obj: Any, rel: str, key: tuple[str, ...]) -> None:
        self.plan.ops.append(Op("dir", rel, key))
        # memmap() describes the new object it builds: self.empty(device="cpu").
        dest = obj.empty(device=torch.device("cpu"))
        names: dict[str, tuple[str, ...]] = {"meta.json": key}
        if not rel:
            names[MANIFEST_NAME] = ("\0",)
        metadata: dict[str, Any] = {}
        for name, value in obj.items():
            child = (*key, name)
            if name in _RESERVED_KEYS:
                self.plan.problem(
                    child,
                    f"a key named {name!r} is overwritten by the {name!r} field of meta.json, "
                    "so tensordict silently loses it. Rename the key.",
                )
                continue
            if getattr(type(value), "_pass_through", False) is True:
                self.plan.problem(
                    child,
                    "an UnbatchedTensor cannot be stored in a memmap checkpoint (tensordict "
                    "refuses it too). Exclude it, or store it as a plain tensor.",
                )
                continue
            if self.is_tensor_collection(value):
                encoded = encode_key(name)
                self._claim(names, encoded, child, rel)
                self.collection(value, _join(rel, encoded), child)
                metadata[name] = {"type": type(value).__name__}
            elif isinstance(value, torch.Tensor):
                entry = self.leaf(value, rel, name, child, names)
                if entry is not None:
                    metadata[name] = entry
            else:
                self.plan.problem(child, f"a {type(value).__name__} is not a tensor.")
        metadata.update(
            {"shape": list(dest.shape), "device": str(dest.device), "_type": str(type(dest))}
        )
        # A key named like a format field keeps its entry (tensordict does the same).
        for field_name, value in _format_metadata(type(dest)).items():
            metadata.setdefault(field_name, value)
        if not isinstance(metadata.get("_names"), dict):
            if dest._has_names():
                metadata["_names"] = list(dest.names)
            else:
                metadata.pop("_names", None)
        self._bytes(_join(rel, "meta.json"), self._dumps(metadata, key), None)

    def leaf(
        self,
        value: torch.Tensor,
        rel: str,
        name: str,
        key: tuple[str, ...],
        names: dict[str, tuple[str, ...]],
    ) -> dict[str, Any] | None:
        """Plan one tensor leaf (``_populate_memmap`` + ``_update_metadata``)."""
        if value.is_nested and value.layout == torch.jagged:
            self.plan.problem(
                key,
                "a nested tensor with the torch.jagged layout cannot be stored (tensordict "
                "refuses it too). Convert it: torch.nested.nested_tensor(list(t.unbind()), "
                "layout=torch.strided).",
            )
            return None
        if not value.is_nested and value.layout != torch.strided:
            self.plan.problem(
                key, f"a {value.layout} tensor cannot be stored; convert it with .to_dense()."
            )
            return None
        if value.is_quantized or value.device.type == "meta":
            what = "quantized" if value.is_quantized else "meta-device (data-less)"
            self.plan.problem(key, f"a {what} tensor has no bytes the format can store.")
            return None
        encoded = encode_key(name)
        file_name = encoded + ".memmap"
        self._claim(names, file_name, key, rel)
        if value.is_nested:
            sizes = value._nested_tensor_size()
            shape_name = encoded + ".shape.memmap"
            self._claim(names, shape_name, key, rel)
            if sizes.numel():
                self.plan.ops.append(Op("tensor", _join(rel, shape_name), key, tensor=sizes))
            numel = int(sizes.prod(-1).sum()) if sizes.numel() else 0
            shape = list(sizes.shape)
        else:
            numel = value.numel()
            shape = list(value.shape)
        # Zero elements: no file, as torch.from_file creates none.
        if numel:
            self.plan.ops.append(Op("tensor", _join(rel, file_name), key, tensor=value))
        return {
            "device": str(value.device),
            "shape": shape,
            "dtype": str(value.dtype),
            "is_nested": value.is_nested,
        }

    # -- LazyStackedTensorDict (LazyStackedTensorDict._memmap_) ---------------------------------
    def lazy_stack(self, obj: Any, rel: str, key: tuple[str, ...]) -> None:
        self.plan.ops.append(Op("dir", rel, key))
        meta = {
            "_type": str(type(obj)),
            **_format_metadata(type(obj)),
            "stack_dim": obj.stack_dim,
            "stack_dim_name": obj._td_dim_name,
        }
        self._bytes(_join(rel, "meta.json"), self._dumps(meta, key), None)
        for i, member in enumerate(obj.tensordicts):
            self.collection(member, _join(rel, str(i)), (*key, str(i)))

    # -- tensorclass / NonTensorData (tensorclass._memmap_) --------------------------------------
    def _class_fields(
        self, obj: Any, non_tensordict: dict[str, Any], rel: str, key: tuple[str, ...]
    ) -> None:
        """meta.json with ``_type`` and the JSON fields; other.pickle (+ json_types.json)."""
        metadata: dict[str, Any] = {"_type": str(type(obj))}
        to_pickle: dict[str, Any] = {}
        for name, value in non_tensordict.items():
            value = _from_shared_nontensor(value)
            if _is_json_serializable(value):
                metadata[name] = value
            else:
                to_pickle[name] = value
        self._bytes(_join(rel, "meta.json"), self._dumps(metadata, key), None)
        if not to_pickle:
            return
        pickled = self._pickle(to_pickle, key)
        self._bytes(_join(rel, "other.pickle"), pickled, key)
        self.plan.pickles.append(
            PickleRecord(key=list(key), file=_join(rel, "other.pickle"), kind="other.pickle")
        )
        # tensorclass._save_json_types: types only -> their names, tied to the pickle's hash.
        if all(isinstance(v, type) and v in _JSON_TYPE_NAMES for v in to_pickle.values()):
            saved = {
                "types": {name: _JSON_TYPE_NAMES[v] for name, v in to_pickle.items()},
                "pickle_sha256": hashlib.sha256(pickled).hexdigest(),
            }
            self._bytes(_join(rel, _JSON_TYPES_FILE), self._dumps(saved, key), key)

    def non_tensor_data(self, obj: Any, rel: str, key: tuple[str, ...]) -> None:
        self.plan.ops.append(Op("dir", rel, key))
        non_tensordict = dict(obj._non_tensordict)
        live = non_tensordict.get("_metadata")
        if live is not None:
            non_tensordict["_metadata"] = {
                k: v for k, v in live.items() if k not in _LIVE_METADATA
            } or None
        # No _tensordict/ directory for non-tensor data.
        self._class_fields(obj, non_tensordict, rel, key)

    def tensorclass(self, obj: Any, rel: str, key: tuple[str, ...]) -> None:
        self.plan.ops.append(Op("dir", rel, key))
        self._class_fields(obj, dict(obj._non_tensordict), rel, key)
        # Tensor fields (and, in current tensorclasses, non-tensor ones as NonTensorData)
        # live in _tensordict/; the level is transparent in keys.
        self.collection(obj._tensordict, _join(rel, _TENSORDICT_DIR), key)

    # -- NonTensorStack (NonTensorStack._memmap_) ----------------------------------------------
    def non_tensor_stack(self, obj: Any, rel: str, key: tuple[str, ...]) -> None:
        self.plan.ops.append(Op("dir", rel, key))
        data = obj.tolist()
        device = str(obj.device) if obj.device is not None else None
        jsondict: dict[str, Any] = {
            "_type": str(type(obj)),
            **_format_metadata(type(obj)),
            "stack_dim": obj.stack_dim,
            "device": device,
        }
        if _is_json_serializable(data):
            jsondict["data"] = data
        else:
            jsondict["data"] = "pickle.pkl"
            pickled = self._pickle(data, key)
            self._bytes(_join(rel, "pickle.pkl"), pickled, key)
            self.plan.pickles.append(
                PickleRecord(key=list(key), file=_join(rel, "pickle.pkl"), kind="pickle.pkl")
            )
        # The members are written by this meta.json alone (memmaped=True below it).
        self._bytes(
            _join(rel, "meta.json"), self._dumps(jsondict, key, separators=(",", ":")), None
        )


def plan_checkpoint(obj: Any) -> Plan:
    """Plan every file of ``obj`` (a tensor collection); nothing is written or changed."""
    planner = _Planner()
    planner.collection(obj, "", ())
    return planner.plan
