"""Turn a training state (names -> live objects) into one TensorDict and a manifest record.

:func:`to_tensordict` is pure: it reads each object's ``state_dict()`` and builds a new
TensorDict that references (never copies) the tensors, so a caller that needs a snapshot
(``save_async``) can take one of the result. The layout of a step, which plain tensordict
``TensorDict.load_memmap`` reads like any other::

    <name>/                    one sub-TensorDict per entry of the state
        <leaf>.memmap          every tensor of the entry's state_dict: a module's under its
                               state-dict key ("fc1.weight"), others under their path
                               ("state.0.exp_avg" of an optimizer)
        __state__/meta.json    the rest of the state_dict as JSON non-tensor data, with
                               every tensor replaced by {"tensor": "<leaf>"}
        <leaf>/other.pickle    only for a value that is not JSON data (a NonTensorData that
                               tensordict pickles; listed in the manifest's pickle inventory)

A TensorDict-like entry is stored as it is. The JSON structure is tagged so that a state
dict comes back exactly - int vs str dict keys (an optimizer's param ids), tuples, ordered
dicts, non-finite floats, the same tensor twice (tied weights, saved once):

====================  ======================================
``[...]``              list
``{"tuple": [...]}``   tuple
``{"dict": [[k, v]]}`` dict (keys encoded too; order kept)
``{"odict": ...}``     OrderedDict
``{"counter": ...}``   collections.Counter (MultiStepLR's milestones)
``{"float": "nan"}``   nan, inf, -inf
``{"tensor": leaf}``   a tensor leaf
``{"alias": leaf}``    the same tensor object as an earlier leaf
``{"ndarray": leaf}``  a NumPy array, stored as a tensor leaf
``{"td": leaf}``       a TensorDict-like value, stored as a sub-TensorDict
``{"npscalar": leaf}`` a NumPy scalar (``np.float64``), stored as a 0-d tensor leaf
``{"pickle": leaf}``   any other value: a NonTensorData leaf (pickled by tensordict); a
                       subclass of a JSON type (an ``IntEnum``, a namedtuple, a
                       ``defaultdict``) is stored as ``(value, PICKLED)``, which tensordict
                       pickles rather than writing the value as plain JSON
====================  ======================================
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from tdckpt._keys import LEAF_SUFFIX, encode_key
from tdckpt._read.state_structure import (
    MAX_STATE_DEPTH,
    MAX_STATE_INT_BITS,
    MAX_STATE_NODES,
    STATE_STRUCTURE_KEY,
)
from tdckpt.errors import UnsupportedContentError
from tdckpt.schema import STATE_KINDS, StateEntryRecord, StateRecord

__all__ = [
    "KINDS",
    "STRUCTURE_KEY",
    "entry_kind",
    "holds_live_objects",
    "is_state_mapping",
    "param_signature",
    "to_tensordict",
]

#: What an entry of a training state can be, as the manifest records it.
KINDS = STATE_KINDS
#: The key, inside an entry, of its JSON structure.
STRUCTURE_KEY = STATE_STRUCTURE_KEY
#: Leaf names an entry cannot use: its structure's, and the fields of tensordict's meta.json.
_TAKEN = frozenset({STRUCTURE_KEY, "shape", "device", "_type"})
#: The dict classes stored as JSON, each under its tag.
_DICT_TAGS: dict[type, str] = {dict: "dict", OrderedDict: "odict", Counter: "counter"}
#: The types tensordict writes as JSON: a subclass of one (not stored as its own tag) is
#: pickled instead, paired with :data:`PICKLED`, so that it reads back as itself.
_JSON_BASES = (str, int, float, list, tuple, dict)
#: The mark beside a value pickled so (bytes: tensordict never writes them as JSON).
PICKLED = b"tdckpt:pickled"
#: A lazy module's parameter or buffer before its first forward pass (no values).
_UNINITIALIZED: type = torch.nn.parameter.UninitializedTensorMixin  # type: ignore[attr-defined]
#: The longest file name a file system takes (a leaf's encoded name plus its suffix).
_MAX_FILE_NAME = 255


def _is_tensor_collection(obj: Any) -> bool:
    try:
        from tensordict import is_tensor_collection
    except ImportError:  # restoring into plain dicts works without tensordict
        return False
    return bool(is_tensor_collection(obj))


def is_state_mapping(obj: Any) -> bool:
    """Whether ``save`` got a training state: a mapping that is not itself a TensorDict."""
    return isinstance(obj, Mapping) and not _is_tensor_collection(obj)


def holds_live_objects(obj: Any) -> bool:
    """Whether a ``restore_into`` target is a training state rather than a nested dict.

    A mapping holding at least one module, optimizer, scheduler, RandomState or other
    ``state_dict()`` / ``load_state_dict()`` object. A mapping of tensors, dicts and
    TensorDicts only is a nested-dict target, restored as before.
    """
    return is_state_mapping(obj) and any(_is_live(value) for value in obj.values())


def _is_live(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, Mapping)) or _is_tensor_collection(value):
        return False
    return entry_kind(value) is not None


def entry_kind(value: Any) -> str | None:
    """What a state entry is (one of :data:`KINDS`), or None when it cannot be saved."""
    from tdckpt._state.rng import RandomState

    if _is_tensor_collection(value):
        return "tensordict"
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        return "scheduler"
    if isinstance(value, RandomState):
        return "rng"
    if callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    ):
        return "stateful"
    return None


def type_name(value: Any) -> str:
    """``"module:qualname"`` of the object's class, as the manifest records it."""
    cls = type(value)
    return f"{cls.__module__}:{cls.__qualname__}"


def param_signature(optimizer: torch.optim.Optimizer) -> list[list[Any]]:
    """``[shape, dtype]`` of every parameter of ``optimizer``, in param-id order."""
    return [
        [list(p.shape), str(p.dtype).removeprefix("torch.")]
        for group in optimizer.param_groups
        for p in group["params"]
    ]


class _Encoder:
    """Splits one state_dict into tensor leaves and a tagged JSON structure."""

    def __init__(self, entry: str) -> None:
        self.entry = entry
        self.leaves: dict[str, Any] = {}
        self._seen: dict[int, str] = {}
        self._keep: list[Any] = []  # what _seen's ids refer to stays alive meanwhile
        self.nodes = 0

    def _leaf_name(self, path: str) -> str:
        # The structure records the leaf's name, so any unique name restores: a path that
        # is taken, or that tensordict keeps for its own meta.json fields, gets a suffix,
        # and one whose file name would be too long (a dict keyed by file paths, say) a
        # short one.
        name = path or "value"
        try:
            encoded = encode_key(name).encode()
        except UnicodeEncodeError:
            raise UnsupportedContentError(
                f"state entry {self.entry!r}: its state_dict key {path!r} holds a lone "
                "surrogate, which no file name (UTF-8) can hold, so nothing was written. "
                "Rename the key, e.g. key.encode('utf-8', 'backslashreplace').decode().",
                problems=[f"{self.entry}: a key not valid as UTF-8 at {path!r}"],
                keys=[(self.entry,)],
            ) from None
        if len(encoded) + len(LEAF_SUFFIX) > _MAX_FILE_NAME - 8:
            name = "leaf"
        if name in _TAKEN or name in self.leaves:
            n = 1
            while f"{name}#{n}" in self.leaves:
                n += 1
            name = f"{name}#{n}"
        return name

    def _refuse(self, what: str, path: str, fix: str = "") -> UnsupportedContentError:
        return UnsupportedContentError(
            f"state entry {self.entry!r}: its state_dict {what} at {path!r}; tdckpt reads "
            "back only what fits its budgets (see tdckpt._read.state_structure), so nothing "
            f"was written.{fix}",
            problems=[f"{self.entry}: {what} at {path!r}"],
            keys=[(self.entry,)],
        )

    def encode(self, value: Any, path: str, depth: int = 0) -> Any:
        from tensordict import NonTensorData, is_tensor_collection

        # The budgets are the decoder's (one constant each): what is written reads back.
        if depth > MAX_STATE_DEPTH:
            raise self._refuse(f"nests more than {MAX_STATE_DEPTH} levels deep", path)
        self.nodes += 1
        if self.nodes > MAX_STATE_NODES:
            raise self._refuse(f"holds more than {MAX_STATE_NODES} values", path)
        kind = type(value)
        if kind is int and value.bit_length() > MAX_STATE_INT_BITS:
            raise self._refuse(
                f"holds an integer of {value.bit_length()} bits (more than {MAX_STATE_INT_BITS})",
                path,
                " Store such a number as a str (or hex) in state_dict().",
            )
        if value is None or kind in (bool, int, str):
            return value
        if kind is float:
            return value if math.isfinite(value) else {"float": repr(value)}
        if kind is list:
            return [self.encode(v, _join(path, i), depth + 1) for i, v in enumerate(value)]
        if kind is tuple:
            return {
                "tuple": [self.encode(v, _join(path, i), depth + 1) for i, v in enumerate(value)]
            }
        if kind in _DICT_TAGS:
            items = [
                [self.encode(k, path, depth + 1), self.encode(v, _join(path, k), depth + 1)]
                for k, v in value.items()
            ]
            return {_DICT_TAGS[kind]: items}
        if isinstance(value, torch.Tensor):
            if isinstance(value, _UNINITIALIZED):
                raise UnsupportedContentError(
                    f"state entry {self.entry!r}: its state_dict holds an uninitialized "
                    f"parameter at {path!r} (a lazy module that has not run forward yet), "
                    "which has no values to save; nothing was written. Run one forward pass "
                    "first (it gives the parameter its shape), then save.",
                    problems=[f"{self.entry}: an uninitialized parameter at {path!r}"],
                    keys=[(self.entry,)],
                )
            seen = self._seen.get(id(value))
            if seen is not None:
                return {"alias": seen}
            name = self._leaf_name(path)
            tensor = value.detach()
            if type(tensor) is not torch.Tensor:
                tensor = tensor.as_subclass(torch.Tensor)  # a Parameter, a MemoryMappedTensor
            self.leaves[name] = tensor
            self._seen[id(value)] = name
            self._keep.append(value)
            return {"tensor": name}
        if is_tensor_collection(value):
            name = self._leaf_name(path)
            self.leaves[name] = value
            return {"td": name}
        if _is_ndarray(value) and value.dtype.kind in "biuf" and value.dtype.isnative:
            name = self._leaf_name(path)
            self.leaves[name] = torch.from_numpy(value.copy())
            return {"ndarray": name}
        if _is_numpy_scalar(value) and value.dtype.kind in "biuf" and value.dtype.isnative:
            name = self._leaf_name(path)
            self.leaves[name] = torch.tensor(value)  # 0-d, its dtype
            return {"npscalar": name}
        name = self._leaf_name(path)
        if isinstance(value, _JSON_BASES):
            # A subclass of a JSON type (an IntEnum, a namedtuple, a defaultdict, ...):
            # tensordict would write it as JSON, and it would read back as the plain type.
            # Paired with bytes (never JSON), it is pickled, and comes back as itself.
            value = (value, PICKLED)
        self.leaves[name] = NonTensorData(data=value, batch_size=[])
        return {"pickle": name}


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _is_numpy_scalar(value: Any) -> bool:
    """A NumPy scalar (``np.float64(1.5)``, ``np.int32(3)``), without importing NumPy."""
    cls = type(value)
    return cls.__module__ == "numpy" and cls.__name__ != "ndarray" and hasattr(value, "dtype")


def _is_ndarray(value: Any) -> bool:
    cls = type(value)
    return cls.__name__ == "ndarray" and cls.__module__ == "numpy"


def _module_state(module: torch.nn.Module) -> dict[str, Any]:
    """A module's state_dict with tied tensors as one object, and its version metadata."""
    state = module.state_dict()
    first: dict[int, str] = {}
    named = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:
        if name not in state:
            continue
        canonical = first.setdefault(id(tensor), name)
        if canonical != name and canonical in state:
            state[name] = state[canonical]  # saved once: an alias of the first name
    metadata = getattr(state, "_metadata", None)
    return {
        "state_dict": state,
        "metadata": OrderedDict(metadata) if metadata is not None else None,
    }


def to_tensordict(state: Mapping[str, Any]) -> tuple[Any, StateRecord]:
    """The TensorDict a training state is saved as, and the manifest's record of it.

    Pure: each object's ``state_dict()`` is read, nothing is modified, tensors are
    referenced, not copied.

    Raises:
        UnsupportedContentError: an entry name is not a non-empty str, or an entry is not
            a TensorDict-like, module, optimizer, scheduler, RandomState or an object
            with ``state_dict()`` and ``load_state_dict()`` (every such entry listed).
    """
    from tensordict import NonTensorData, TensorDict

    problems: list[str] = []
    keys: list[tuple[str, ...]] = []
    for name, value in state.items():
        if type(name) is not str or not name:
            problems.append(f"the entry name {name!r} is not a non-empty str")
            keys.append((str(name),))
        elif entry_kind(value) is None:
            problems.append(
                f"entry {name!r}: a {type(value).__module__}.{type(value).__qualname__} is "
                "neither a TensorDict-like, a torch.nn.Module, an optimizer, an LR scheduler, "
                "a tdckpt.RandomState nor an object with state_dict() and load_state_dict()"
            )
            keys.append((name,))
    if not state:
        problems.append("the training state has no entries")
        keys.append(())
    if problems:
        raise UnsupportedContentError(
            "cannot save this training state; nothing was written:\n  " + "\n  ".join(problems),
            problems=problems,
            keys=keys,
        )

    root = TensorDict(batch_size=[])
    entries: dict[str, StateEntryRecord] = {}
    for name, value in state.items():
        kind = entry_kind(value)
        assert kind is not None
        entries[name] = StateEntryRecord(kind=kind, type=type_name(value))
        if kind == "tensordict":
            root.set(name, value)
            continue
        if kind == "module":
            structure: dict[str, Any] = _module_state(value)
        else:
            structure = {"state_dict": value.state_dict()}
            if kind == "optimizer":
                structure["params"] = param_signature(value)
        encoder = _Encoder(name)
        encoded = {
            key: (encoder.encode(sub, "") if key == "state_dict" else encoder.encode(sub, key))
            for key, sub in structure.items()
        }
        sub_td = TensorDict(batch_size=[])
        for leaf, tensor in encoder.leaves.items():
            sub_td.set(leaf, tensor)
        sub_td.set(STRUCTURE_KEY, NonTensorData(data=encoded, batch_size=[]))  # type: ignore[arg-type,unused-ignore]
        root.set(name, sub_td)
    return root, StateRecord(entries=entries)
