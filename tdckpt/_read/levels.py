"""A TensorDict level's meta.json, validated: the pydantic model, with an exact-form fast lane.

``schema.TensorDictMeta`` is the authority on what a level may hold. Building one pydantic
object per key costs about 1.5 µs, which is a tenth of a 10,000-leaf restore; yet almost
every level on disk is exactly what tensordict wrote: plain ints, strings, booleans, no
extra fields. :func:`read_td_level` recognises that exact form with plain type checks and
returns the same values the model would. Anything else - a float where an int belongs,
an extra field, a key named like a format field, a value out of range - goes to the model,
which accepts it (coercing as pydantic does) or raises ``pydantic.ValidationError`` with
every error. The fast lane only ever accepts documents the model accepts with identical
values; a property test holds it to that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tdckpt import schema

__all__ = ["ChildSpec", "LeafSpec", "TDLevel", "exact_td_level", "read_td_level"]

#: A leaf entry: (dtype, shape, device, is_nested).
LeafSpec = tuple[str, tuple[int, ...], str | None, bool]
#: A nested collection entry: its ``type`` string.
ChildSpec = str

_MAX_DIM = 2**62
_MAX_NDIM = 64
_LEAF_FIELDS = frozenset({"device", "shape", "dtype", "is_nested"})
_LEVEL_FIELDS = frozenset({"shape", "device", "_type", "_format_version", "_class", "_names"})


@dataclass
class TDLevel:
    """What a TensorDict level's meta.json says, validated."""

    class_: str
    type_: str
    shape: tuple[int, ...]
    device: str | None
    names: list[str | None] | None
    #: key -> LeafSpec (a tuple) or ChildSpec (a str), in file order.
    entries: dict[str, LeafSpec | ChildSpec]


def read_td_level(raw: dict[str, Any]) -> TDLevel:
    """Validate ``raw`` as a TensorDict level.

    Raises:
        pydantic.ValidationError: it does not fit ``schema.TensorDictMeta``.
    """
    fast = _exact_form(raw)
    if fast is not None:
        return fast
    model = schema.TensorDictMeta.model_validate(raw)
    entries: dict[str, LeafSpec | ChildSpec] = {}
    for name, entry in model.entries.items():
        if isinstance(entry, schema.LeafEntry):
            entries[name] = (entry.dtype, tuple(entry.shape), entry.device, entry.is_nested)
        else:
            entries[name] = entry.type
    return TDLevel(
        class_=model.class_,
        type_=model.type_,
        shape=tuple(model.shape),
        device=model.device,
        names=model.names,
        entries=entries,
    )


def exact_td_level(raw: dict[str, Any]) -> TDLevel | None:
    """The level if ``raw`` is in the exact form tensordict writes (the fast lane alone),
    else None: then only :func:`read_td_level` (the model) can say."""
    return _exact_form(raw)


def _dims(value: Any) -> tuple[int, ...] | None:
    """A shape of plain, in-range ints, or None."""
    if type(value) is not list or len(value) > _MAX_NDIM:
        return None
    for d in value:
        if type(d) is not int or d < 0 or d > _MAX_DIM:
            return None
    return tuple(value)


def _exact_form(raw: dict[str, Any]) -> TDLevel | None:
    """The level, if ``raw`` is in the exact form tensordict writes; else None."""
    entries: dict[str, LeafSpec | ChildSpec] = {}
    fields: dict[str, Any] = {}
    for name, value in raw.items():
        if type(value) is not dict:
            fields[name] = value
            continue
        if "dtype" in value:
            if not value.keys() <= _LEAF_FIELDS:
                return None
            dtype = value["dtype"]
            shape = _dims(value.get("shape"))
            device = value.get("device")
            nested = value.get("is_nested", False)
            if (
                type(dtype) is not str
                or shape is None
                or (device is not None and type(device) is not str)
                or type(nested) is not bool
            ):
                return None
            entries[name] = (dtype, shape, device, nested)
        elif len(value) == 1 and type(value.get("type")) is str:
            entries[name] = value["type"]
        else:
            return None
    if not fields.keys() <= _LEVEL_FIELDS:
        return None
    fv = fields.get("_format_version")
    class_ = fields.get("_class")
    type_ = fields.get("_type")
    shape = _dims(fields.get("shape"))
    device = fields.get("device")
    names = fields.get("_names")
    if (
        type(fv) is not int
        or fv != 1
        or type(class_) is not str
        or type(type_) is not str
        or shape is None
        or (device is not None and type(device) is not str)
    ):
        return None
    if names is not None and (
        type(names) is not list or any(n is not None and type(n) is not str for n in names)
    ):
        return None
    return TDLevel(
        class_=class_,
        type_=type_,
        shape=shape,
        device=None if device == "None" else device,
        names=None if names is None else list(names),
        entries=entries,
    )
