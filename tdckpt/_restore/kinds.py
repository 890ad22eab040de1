"""What kind of object a restore writes into: tensordict's classes told apart (looked up once),
its views and the tensordict that holds a view's data, tensorclasses and NonTensorData.

Without tensordict every predicate is False: a target is then a plain nested ``dict``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tdckpt._restore.plan import has_tensordict

__all__ = [
    "is_lazy_stack",
    "is_memmap",
    "is_non_tensor_data",
    "is_td",
    "is_tensorclass",
    "kind_name",
    "tensordict_types",
    "value_batch",
    "view_kind",
    "view_storage",
    "view_types",
]


@functools.cache
def tensordict_types() -> tuple[type, type, type, Callable[[Any], bool], type] | None:
    """tensordict's classes the engine tells apart, or None without tensordict (cached).

    The last one is ``TensorDict`` itself: the usual target, answered by one ``type() is``
    before the abstract-base-class checks.
    """
    if not has_tensordict():
        return None
    from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, is_tensorclass
    from tensordict.tensorclass import NonTensorDataBase

    return TensorDictBase, LazyStackedTensorDict, NonTensorDataBase, is_tensorclass, TensorDict


@functools.cache
def view_types() -> tuple[type, type] | None:
    """tensordict's view classes: ``_SubTensorDict`` and the lazy views' ``_CustomOpTensorDict``."""
    if not has_tensordict():
        return None
    from tensordict._lazy import _CustomOpTensorDict
    from tensordict._td import _SubTensorDict

    return _SubTensorDict, _CustomOpTensorDict


def view_kind(obj: Any) -> str | None:
    """``"sub"`` (a ``_SubTensorDict``), ``"lazy"`` (a lazy view) or None (not a view)."""
    types = view_types()
    if types is None or type(obj) is tensordict_types()[4]:  # type: ignore[index]
        return None
    if isinstance(obj, types[0]):
        return "sub"
    if isinstance(obj, types[1]):
        return "lazy"
    return None


def view_storage(obj: Any) -> Any:
    """The tensordict that holds a view's data (through views of views); ``obj`` if no view."""
    while view_kind(obj) is not None:
        obj = obj._source
    return obj


def is_td(obj: Any) -> bool:
    types = tensordict_types()
    return types is not None and (type(obj) is types[4] or isinstance(obj, types[0]))


def is_lazy_stack(obj: Any) -> bool:
    types = tensordict_types()
    return types is not None and type(obj) is not types[4] and isinstance(obj, types[1])


def is_tensorclass(obj: Any) -> bool:
    types = tensordict_types()
    return types is not None and type(obj) is not types[4] and types[3](obj)


def is_non_tensor_data(obj: Any) -> bool:
    types = tensordict_types()
    return (
        types is not None
        and type(obj) is not types[4]
        and isinstance(obj, types[2])
        and not isinstance(obj, types[1])
    )


def value_batch(value: Any) -> tuple[int, ...] | None:
    """The batch size of a non-leaf entry's value (leaves are checked from their metadata)."""
    if is_td(value) or is_tensorclass(value):
        return tuple(value.batch_size)
    return None


def kind_name(obj: Any) -> str:
    return type(obj).__name__


def is_memmap(td: Any) -> bool:
    try:
        return bool(td.is_memmap())
    except RuntimeError:  # a lazy stack whose members disagree
        return False
