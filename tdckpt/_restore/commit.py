"""The commit of a restore in place: the prepared values swapped into the target, all or nothing.

:func:`restore_into_target` has the apply stage (``apply.py``) prepare everything first -
every new value built and mapped, every check passed - with the target untouched. Then it
commits: a list of plain assignments (a level's item dict, its memmap prefix, a
tensorclass's non-tensor fields), followed by the lock and memmap state. A snapshot of
everything it assigns is kept, and put back if anything fails while committing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tdckpt._read.pipeline import OpenedCheckpoint
from tdckpt._read.storage import MapMode
from tdckpt._restore.apply import Preparer
from tdckpt._restore.budget import check_map_budget, refuse_if_out_of_mappings
from tdckpt._restore.kinds import (
    is_lazy_stack,
    is_memmap,
    is_non_tensor_data,
    is_td,
    is_tensorclass,
    view_storage,
)
from tdckpt._restore.plan import Mapper
from tdckpt.errors import TdckptError

__all__ = ["restore_into_target"]


def _all_td_levels(target: Any) -> list[Any]:
    """Every TensorDict level under target (for the lock/memmap state)."""
    out = []
    stack = [target]
    while stack:
        cur = stack.pop()
        if is_tensorclass(cur) and not is_non_tensor_data(cur):
            cur = cur._tensordict
        if is_lazy_stack(cur):
            stack.extend(cur.tensordicts)
            continue
        if not is_td(cur):  # NonTensorData is a tensorclass, never a TensorDictBase
            continue
        out.append(cur)
        stack.extend(v for v in cur._tensordict.values() if is_td(v) or is_tensorclass(v))
    return out


def _non_tensor_levels(levels: list[Any]) -> list[Any]:
    """The TensorDicts inside the NonTensorData entries of ``levels`` (they carry memmap flags)."""
    tensor = torch.Tensor
    return [
        v._tensordict
        for lvl in levels
        # a level of tensors only (the large one) is skipped on the set of its value types
        if not all(issubclass(t, tensor) for t in set(map(type, lvl._tensordict.values())))
        for v in lvl._tensordict.values()
        if not isinstance(v, tensor) and is_non_tensor_data(v)
    ]


def restore_into_target(
    target: Any,
    opened: OpenedCheckpoint,
    *,
    mode: MapMode,
    unpickle: bool,
    builder_factory: Callable[..., Any],
) -> None:
    """Prepare everything, then commit the swap into ``target`` (or change nothing)."""
    root = opened.root
    assert root is not None
    device = None
    inner = target._tensordict if is_tensorclass(target) else target
    if is_td(inner) and inner.device is not None:
        device = inner.device
    check_map_budget(opened, device)
    mapper = Mapper(opened.storage, mode, device)
    builder = builder_factory(opened, mapper, unpickle)
    prep = Preparer(opened, mapper, builder, unpickle)
    holder = view_storage(inner)
    prep.root_locked = bool(is_td(holder) and holder.is_locked)
    try:
        prep.into(target, root)
    except (TdckptError, MemoryError) as exc:
        del prep, builder, mapper  # what was mapped so far is freed before it is counted
        refuse_if_out_of_mappings(opened, device, exc)
        raise
    plan = prep.plan

    # Snapshot of everything the commit touches, to put back on failure. A view target's
    # lock and memmap state are its parent's.
    holder = view_storage(inner)
    root_td = holder if is_td(holder) else None
    was_memmap = bool(root_td is not None and is_memmap(root_td))
    was_locked = bool(root_td is not None and root_td.is_locked)
    # The commit sets every planned level's prefix; a memory-mapped target also has the
    # memmap flags of all its levels changed.
    levels = _all_td_levels(holder) if was_memmap else [lvl for lvl, _ in plan.prefixes]
    levels += _non_tensor_levels(levels)
    snapshot_items = [(store, dict(store)) for store, _ in plan.items]
    snapshot_flags = [
        (lvl, lvl._memmap_prefix, getattr(lvl, "_is_memmap", False)) for lvl in levels
    ]
    snapshot_fields = [(obj, dict(obj._non_tensordict)) for obj, _ in plan.fields]
    try:
        if was_memmap:
            assert root_td is not None
            root_td.unlock_()
        for store, new in plan.items:
            store.clear()
            store.update(new)
        for obj, fields in plan.fields:
            obj._non_tensordict.clear()
            obj._non_tensordict.update(fields)
        for lvl, prefix in plan.prefixes:
            lvl._memmap_prefix = prefix
        if was_memmap:
            # A NonTensorData is memory-mapped with its level, as tensordict's memmap_()
            # leaves it: flagged, its (file-less) TensorDict under <its dir>/_tensordict.
            for ntd, rel in plan.non_tensors:
                path = mapper.dir_path(rel)
                ntd._tensordict._memmap_prefix = path / "_tensordict" if path is not None else None
            flagged = _all_td_levels(holder) + [ntd._tensordict for ntd, _ in plan.non_tensors]
            if mapper.records_prefix:
                for lvl in flagged:
                    lvl._is_memmap = True
                    lvl._is_shared = False
                assert root_td is not None
                root_td.lock_()
            else:
                for lvl in flagged:
                    lvl._is_memmap = False
                    lvl._memmap_prefix = None
    except BaseException:
        for store, items in snapshot_items:
            store.clear()
            store.update(items)
        for obj, fields in snapshot_fields:
            obj._non_tensordict.clear()
            obj._non_tensordict.update(fields)
        for lvl, prefix, memmapped in snapshot_flags:
            lvl._memmap_prefix = prefix
            lvl._is_memmap = memmapped
        if was_locked and root_td is not None and not root_td.is_locked:
            root_td.lock_()
        raise
