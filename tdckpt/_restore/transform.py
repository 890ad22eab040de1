"""Transforms on restore: key renames, dtype casts and the device of a restored (new) object.

``rename`` is a mapping of nested keys to nested keys (``{"encoder": "model.encoder"}``: the
key and everything below it move; a key is a tuple or a string split on ``.``), or a list of
``(regex, replacement)`` pairs applied, in order, to each leaf's dotted name
(``[(r"^layers\\.(\\d+)\\.", r"blocks.\\1.")]``). ``dtype`` is a torch dtype every floating-point
leaf is cast to, or a mapping of source dtypes to target dtypes (any kind, e.g.
``{torch.float32: torch.bfloat16, torch.int64: torch.int32}``).

Both run on the object the restore built, before it is returned: a restore with a transform
that cannot apply (two keys renamed onto one, a rename onto an existing key, a cast torch
refuses) raises and returns nothing. Leaves that are cast are copies (no longer mapped);
the others stay memory-mapped.

``device`` (:func:`check_device`) is checked before anything is read; the leaves are moved as
the object is built, after every check of the restore (validation, selection, strict), so a
restore that fails returns nothing.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from tdckpt.errors import RestoreError

__all__ = ["apply_transforms", "check_device", "check_transforms"]

Key = tuple[str, ...]


def _key(value: Any, what: str) -> Key:
    if isinstance(value, str) and value:
        return tuple(value.split("."))
    if isinstance(value, tuple) and value and all(isinstance(p, str) and p for p in value):
        return value
    raise TypeError(f"{what}: a key is a non-empty str ('a.b') or a tuple of str, not {value!r}")


def check_transforms(rename: Any, dtype: Any) -> None:
    """Refuse malformed ``rename`` / ``dtype`` arguments before anything is read."""
    if rename is not None:
        if isinstance(rename, Mapping):
            for old, new in rename.items():
                _key(old, "rename"), _key(new, "rename")
        elif isinstance(rename, (list, tuple)):
            for pair in rename:
                if not (
                    isinstance(pair, tuple)
                    and len(pair) == 2
                    and all(isinstance(p, str) for p in pair)
                ):
                    raise TypeError(
                        f"rename: a list of (regex, replacement) string pairs, got {pair!r}"
                    )
                try:
                    re.compile(pair[0])
                except re.error as exc:
                    raise ValueError(f"rename: {pair[0]!r} is not a regex ({exc})") from None
        else:
            raise TypeError(
                "rename must be a mapping of keys to keys or a list of (regex, replacement) "
                f"pairs, not {type(rename).__name__}"
            )
    if dtype is not None:
        pairs = dtype.items() if isinstance(dtype, Mapping) else [(None, dtype)]
        for src, dst in pairs:
            if (src is not None and not isinstance(src, torch.dtype)) or not isinstance(
                dst, torch.dtype
            ):
                raise TypeError(
                    "dtype must be a torch.dtype (the floating leaves' new dtype) or a mapping "
                    f"of torch dtypes to torch dtypes, not {dtype!r}"
                )


def check_device(device: Any, where: str) -> torch.device | None:
    """``device`` as a :class:`torch.device`, refused before anything is read or changed.

    ``"cpu"`` keeps leaves memory-mapped; ``"meta"`` is tensordict's structure-only load
    (no file read). Any other device must exist in this process: an accelerator that torch
    reports unavailable, or an index past its count, is a RestoreError naming it.
    """
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise RestoreError(
            f"{where}: device={device!r} is not a torch device ({exc}); nothing was read. "
            "Pass 'cpu', 'cuda', 'cuda:1', a torch.device, or None."
        ) from None
    if dev.type in ("cpu", "meta"):
        return dev
    backend = getattr(torch, dev.type, None)
    is_available = getattr(backend, "is_available", None)
    if not callable(is_available):
        is_available = getattr(getattr(torch.backends, dev.type, None), "is_available", None)
    if not callable(is_available):
        return dev  # a backend torch cannot be asked about (a plug-in): moving tells
    if not is_available():
        raise RestoreError(
            f"{where}: device={device!r}, but this process has no {dev.type} device (torch "
            f"{torch.__version__}); nothing was read. Restore on the CPU (device=None) and "
            "move the result, or run where that device is."
        )
    count = getattr(backend, "device_count", None)
    if dev.index is not None and callable(count) and dev.index >= count():
        raise RestoreError(
            f"{where}: device={device!r}, but this process sees {count()} {dev.type} "
            f"device(s) (indices 0..{count() - 1}); nothing was read."
        )
    return dev


def apply_transforms(obj: Any, *, rename: Any, dtype: Any, where: str) -> Any:
    """``obj`` with its keys renamed and leaves cast (a new object when anything changes)."""
    if rename is None and dtype is None:
        return obj
    from tensordict import is_tensor_collection

    if not is_tensor_collection(obj):
        raise RestoreError(
            f"{where}: rename= and dtype= apply to a TensorDict-like checkpoint; this one holds "
            f"a {type(obj).__name__}."
        )
    if dtype is not None:
        obj = obj.apply(_caster(dtype), filter_empty=False)
    if rename is not None:
        from tensordict import is_tensorclass

        if is_tensorclass(obj):
            raise RestoreError(
                f"{where}: rename= cannot move the fields of a tensorclass "
                f"({type(obj).__name__}); restore it, then build the object you need."
            )
        obj = _renamed(obj, rename, where)
    return obj


def _caster(dtype: Any) -> Any:
    if isinstance(dtype, Mapping):
        table = dict(dtype)

        def cast(t: torch.Tensor) -> torch.Tensor:
            target = table.get(t.dtype)
            return t if target is None or target == t.dtype else t.to(target)

        return cast

    def cast_floating(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return cast_floating


def _renamed(td: Any, rename: Any, where: str) -> Any:
    """``td`` (the restore's own new object) with its keys moved, in place."""
    if isinstance(rename, Mapping):
        for old_arg, new_arg in rename.items():
            old, new = _key(old_arg, "rename"), _key(new_arg, "rename")
            if not _has(td, old) or old == new:
                continue
            if new[: len(old)] == old:
                raise RestoreError(
                    f"{where}: rename= moves {_text(old)!r} into itself ({_text(new)!r})."
                )
            if _has(td, new):
                raise _onto_existing(where, old, new)
            td.rename_key_(_arg(old), _arg(new))
            _drop_emptied(td, old)
        return td
    leaves = [(k,) if isinstance(k, str) else tuple(k) for k in td.keys(True, True)]
    moves = {}
    for key in leaves:
        name = ".".join(key)
        for pattern, replacement in rename:
            name = re.sub(pattern, replacement, name)
        new = tuple(name.split("."))
        if new != key:
            if not all(new):
                raise RestoreError(
                    f"{where}: rename= turns {_text(key)!r} into {name!r}, not a key."
                )
            moves[key] = new
    targets: dict[Key, Key] = {}
    for old, new in moves.items():
        if new in targets:
            raise RestoreError(
                f"{where}: rename= maps both {_text(targets[new])!r} and {_text(old)!r} onto "
                f"{_text(new)!r}; nothing was restored."
            )
        targets[new] = old
    # one key moved onto a level above another moved key (a -> p, b -> p.q): p would be
    # both a leaf and a level
    above = {new[:i] for new in targets for i in range(1, len(new))}
    for new, old in targets.items():
        if new in above:
            below = next(n for n in targets if n[: len(new)] == new and n != new)
            raise RestoreError(
                f"{where}: rename= maps {_text(old)!r} onto {_text(new)!r} and "
                f"{_text(targets[below])!r} below it ({_text(below)!r}); nothing was restored."
            )
    staying = [k for k in leaves if k not in moves]
    for new, old in targets.items():
        if any(s[: len(new)] == new or new[: len(s)] == s for s in staying):
            raise _onto_existing(where, old, new)
    # The moves happen at once (a <-> b swaps): each key goes to a name of its own first.
    token = uuid.uuid4().hex
    parked = {old: (f"__tdckpt_rename_{i}_{token}",) for i, old in enumerate(moves)}
    for old, temp in parked.items():
        td.rename_key_(_arg(old), _arg(temp))
    for old in moves:
        _drop_emptied(td, old)
    for old, new in moves.items():
        td.rename_key_(_arg(parked[old]), _arg(new))
    return td


def _text(key: Key) -> str:
    return ".".join(key)


def _arg(key: Key) -> Any:
    return key[0] if len(key) == 1 else key


def _has(td: Any, key: Key) -> bool:
    return _arg(key) in td.keys(include_nested=True)


def _onto_existing(where: str, old: Key, new: Key) -> RestoreError:
    return RestoreError(
        f"{where}: rename= moves {_text(old)!r} onto {_text(new)!r}, where the checkpoint "
        "already has a key (or a key above or below it); nothing was restored."
    )


def _drop_emptied(td: Any, moved: Key) -> None:
    """Remove the levels above ``moved`` that its move left empty (innermost first)."""
    for depth in range(len(moved) - 1, 0, -1):
        parent = moved[:depth]
        if _has(td, parent):
            sub = td.get(_arg(parent))
            if len(list(sub.keys())) == 0:
                del td[_arg(parent)]
                continue
        break
