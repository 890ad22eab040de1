"""A saved training state read back: each entry's saved structure decoded into the plain
``state_dict`` it was (tensors as the step's leaves, tags turned back into tuples, ordered
dicts, counters, ...), checked against the encoder's budgets first.

:func:`to_state_dicts` gives every entry's ``state_dict`` of a restored step;
:func:`saved_structure` one entry's whole saved record (``restore.py`` compares it with the
live object before anything is loaded).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from tdckpt._read.state_structure import structure_problem
from tdckpt._state.encode import PICKLED, STRUCTURE_KEY
from tdckpt._state.rng import MT_WORDS
from tdckpt.errors import RestoreError
from tdckpt.schema import StateRecord

__all__ = ["saved_structure", "to_state_dicts"]

#: The dtypes a NumPy array is saved as (``encode`` stores only bool, ints, uints, floats;
#: ``np.random.get_state()``'s key is uint32).
_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
    }
)


_DICT_CLASSES: dict[str, type[dict[Any, Any]]] = {
    "dict": dict,
    "odict": OrderedDict,
    "counter": Counter,
}


def _plain(tensor: Any) -> Any:
    if isinstance(tensor, torch.Tensor) and type(tensor) is not torch.Tensor:
        return tensor.as_subclass(torch.Tensor)  # a MemoryMappedTensor: same memory
    return tensor


class _Decoder:
    def __init__(self, entry_td: Any, where: str, *, aliases: bool = True) -> None:
        self.td = entry_td
        self.where = where
        self.tensors: dict[str, Any] = {}
        #: whether the entry may hold the same tensor twice (an optimizer's state never does)
        self.aliases = aliases
        #: leaves already placed by a tensor / ndarray / npscalar tag, and by which (the
        #: encoder places each tensor once; a second place of it is an alias)
        self.placed: dict[str, str] = {}

    def _place(self, name: Any, tag: str) -> bool:
        """Record that ``tag`` places leaf ``name``; True when a tensor / ndarray / npscalar
        tag places a leaf placed before (the encoder writes a second place of the same
        tensor as an alias: such a place gets a copy of its own, never the same tensor).
        An alias must follow the tensor it names, and an entry whose state never shares
        tensors (an optimizer's) may hold none."""
        if type(name) is not str:
            return False  # tensor() says what is wrong with it
        if tag == "alias":
            if not self.aliases:
                raise RestoreError(
                    f"{self.where}: the saved structure makes two of its values one tensor "
                    f"({name!r}); this entry's state never shares tensors, so the step is "
                    "damaged or hostile. Restore another step.",
                    key=name,
                )
            if self.placed.get(name) != "tensor":
                raise RestoreError(
                    f"{self.where}: the saved structure holds an alias of {name!r:.100}, which "
                    "no earlier value is; tdckpt never writes that: the step is damaged or "
                    "hostile.",
                    key=name,
                )
            return False
        if name in self.placed:
            return True
        self.placed[name] = tag
        return False

    def _leaf(self, name: Any) -> Any:
        if type(name) is not str or name not in self.td.keys():  # noqa: SIM118 (TensorDict has no 'in')
            raise RestoreError(
                f"{self.where}: the saved structure names the leaf {name!r:.100}, which the "
                "step does not hold; the step is damaged (run verify).",
                key=name,
            )
        return self.td.get(name)

    def tensor(self, name: Any) -> Any:
        if type(name) is not str or name not in self.tensors:
            value = self._leaf(name)
            if not isinstance(value, torch.Tensor):
                raise RestoreError(
                    f"{self.where}: the leaf {name!r} should be a tensor; the step is "
                    "damaged (run verify).",
                    key=name,
                )
            self.tensors[name] = _plain(value)
        return self.tensors[name]

    def decode(self, node: Any) -> Any:
        if node is None or type(node) in (bool, int, str, float):
            return node
        if type(node) is list:
            return [self.decode(v) for v in node]
        if type(node) is dict and len(node) == 1:
            ((tag, body),) = node.items()
            if tag == "tuple" and type(body) is list:
                values = tuple(self.decode(v) for v in body)
                _check_mt19937_legacy(values, self.where)
                return values
            if tag in _DICT_CLASSES and type(body) is list:
                out: dict[Any, Any] = _DICT_CLASSES[tag]()
                for pair in body:
                    if type(pair) is not list or len(pair) != 2:
                        break
                    key = self.decode(pair[0])
                    try:
                        hash(key)
                    except TypeError:
                        break  # a key tdckpt cannot have written: refused below
                    out[key] = self.decode(pair[1])
                else:
                    _check_mt19937_dict(out, self.where)
                    return out
            if tag == "float" and body in ("nan", "inf", "-inf"):
                return float(body)
            if tag in ("tensor", "alias"):
                again = self._place(body, tag)
                return self.tensor(body).clone() if again else self.tensor(body)
            if tag == "ndarray":
                again = self._place(body, tag)
                tensor = self.tensor(body).clone() if again else self.tensor(body)
                if tensor.dtype not in _NUMPY_DTYPES:
                    raise RestoreError(
                        f"{self.where}: the leaf {body!r} should be a NumPy array, but its "
                        f"dtype {tensor.dtype} has no NumPy equivalent; the step is damaged.",
                        key=body,
                    )
                return tensor.numpy()
            if tag == "td":
                return self._leaf(body)
            if tag == "npscalar":
                self._place(body, tag)  # (a scalar is a new value either way)
                tensor = self.tensor(body)
                if tensor.dtype not in _NUMPY_DTYPES or tensor.dim() != 0:
                    raise RestoreError(
                        f"{self.where}: the leaf {body!r} should be a NumPy scalar, but it is a "
                        f"{tensor.dtype} tensor of shape {list(tensor.shape)}; the step is "
                        "damaged.",
                        key=body,
                    )
                return tensor.numpy()[()]
            if tag == "pickle":
                value = self._leaf(body)
                if hasattr(value, "data") and _is_non_tensor(value):
                    value = value.data
                if type(value) is tuple and len(value) == 2 and value[1] == PICKLED:
                    return value[0]  # a subclass of a JSON type, pickled as itself
                return value
        raise RestoreError(
            f"{self.where}: the saved structure holds {node!r:.100}, which is not what tdckpt "
            "writes; the step is damaged or was not written by tdckpt.",
        )


def _mt19937_problem(key: Any, pos: Any) -> str | None:
    """What is wrong with an MT19937 state's key and position, as NumPy would use them."""
    if type(pos) is not int or not 0 <= pos <= MT_WORDS:
        return f"position {pos!r:.40} (expected an int in 0..{MT_WORDS})"
    size = getattr(key, "shape", None)
    length = (
        int(size[0])
        if size is not None and len(size) == 1
        else len(key)
        if isinstance(key, list)
        else None
    )
    if length != MT_WORDS:
        return f"key of {length if length is not None else 'no'} words (expected {MT_WORDS})"
    return None


def _refuse_mt19937(problem: str, where: str) -> RestoreError:
    return RestoreError(
        f"{where}: the saved state holds a NumPy MT19937 generator state with a {problem}; "
        "NumPy does not check it and would read past the generator's memory, so nothing "
        "was restored. The step is damaged or hostile: restore another step.",
    )


def _check_mt19937_legacy(values: tuple[Any, ...], where: str) -> None:
    """``np.random.get_state()``'s tuple ``('MT19937', key, pos, has_gauss, gauss)`` (in any
    entry: TorchRL's ``GlobalRNGState``, an environment's state), checked as
    :class:`tdckpt.RandomState` checks its own."""
    if len(values) == 5 and values[0] == "MT19937":
        problem = _mt19937_problem(values[1], values[2])
        if problem is not None:
            raise _refuse_mt19937(problem, where)


def _check_mt19937_dict(value: dict[Any, Any], where: str) -> None:
    """A bit generator's ``state`` dict, ``{"bit_generator": "MT19937", "state": {"key",
    "pos"}, ...}``, checked likewise."""
    if value.get("bit_generator") == "MT19937":
        state = value.get("state")
        problem = (
            _mt19937_problem(state.get("key"), state.get("pos"))
            if isinstance(state, dict)
            else f"state {state!r:.40} (expected a dict of key and pos)"
        )
        if problem is not None:
            raise _refuse_mt19937(problem, where)


def _is_non_tensor(value: Any) -> bool:
    from tensordict import is_non_tensor

    return bool(is_non_tensor(value))


def saved_structure(entry_td: Any, where: str, *, aliases: bool = True) -> dict[str, Any]:
    from tensordict import is_tensor_collection

    if not is_tensor_collection(entry_td) or STRUCTURE_KEY not in entry_td.keys():  # noqa: SIM118
        raise RestoreError(
            f"{where}: the step does not hold this entry's saved structure ({STRUCTURE_KEY!r}); "
            "it is damaged or was not written by tdckpt.",
        )
    raw = entry_td[STRUCTURE_KEY]
    decoded = _Decoder(entry_td, where, aliases=aliases)
    if type(raw) is not dict or "state_dict" not in raw:
        raise RestoreError(f"{where}: the saved structure is not a dict with a state_dict.")
    beyond = structure_problem(raw)  # the encoder's budgets: depth, values, integer size
    if beyond is not None:
        raise RestoreError(
            f"{where}: the saved structure {beyond}; tdckpt never writes that, so the step "
            "is damaged or hostile. Restore the step from a backup.",
        )
    out = {key: decoded.decode(value) for key, value in raw.items()}
    if out.get("metadata") is not None and isinstance(out["state_dict"], OrderedDict):
        out["state_dict"]._metadata = out["metadata"]  # type: ignore[attr-defined]
    return out


def to_state_dicts(
    td: Any, record: StateRecord | Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The state dicts of a restored training-state step: ``{name: state_dict}``.

    ``td`` is what :meth:`CheckpointManager.restore` returns for such a step; each entry
    comes back as what its object's ``load_state_dict`` takes (a TensorDict entry as the
    sub-TensorDict). Tensors are the step's memory-mapped ones, not copies.

    Example:
        >>> import tempfile, torch, tdckpt
        >>> from tdckpt._state import to_state_dicts
        >>> model = torch.nn.Linear(2, 1)
        >>> with tempfile.TemporaryDirectory() as root:
        ...     with tdckpt.CheckpointManager(root) as mgr:
        ...         _ = mgr.save(1, {"model": model})
        ...         sd = to_state_dicts(mgr.restore(1))["model"]
        ...         torch.equal(sd["weight"], model.weight)
        True
    """
    if isinstance(record, StateRecord):
        kinds = {name: entry.kind for name, entry in record.entries.items()}
    elif record is not None:
        kinds = {name: entry["kind"] for name, entry in record["entries"].items()}
    else:
        kinds = {
            name: "tensordict" if STRUCTURE_KEY not in td[name].keys() else "stateful"  # noqa: SIM118
            for name in td.keys()  # noqa: SIM118
        }
    out: dict[str, Any] = {}
    for name, kind in kinds.items():
        if kind == "tensordict":
            out[name] = td.get(name)
        else:
            out[name] = saved_structure(td.get(name), f"entry {name!r}")["state_dict"]
    return out
