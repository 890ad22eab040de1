"""The apply stage: swap planned values into an existing target, all or nothing.

``restore_into_target`` first *prepares*: it walks the target beside the validated
checkpoint, decides for every level which object is reused and which value is new, builds
and maps every new value, and checks that the target can hold them (kinds, batch sizes,
tensorclass identity, lazy-stack member counts). The target is untouched so far.

Then it *commits*: a list of plain assignments (a level's item dict, its memmap prefix,
a tensorclass's non-tensor fields), followed by the lock and memmap state. A snapshot of
everything it assigns is kept, and restored if anything fails while committing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any, cast

import torch

from tdckpt._read.nodes import (
    LazyStackNode,
    LazyViewNode,
    LeafNode,
    Node,
    NonTensorNode,
    SubTensorDictNode,
    TensorClassNode,
    TensorDictNode,
)
from tdckpt._read.pipeline import OpenedCheckpoint
from tdckpt._read.storage import MapMode
from tdckpt._restore.budget import check_map_budget, refuse_if_out_of_mappings
from tdckpt._restore.plan import (
    Mapper,
    check_tensorclass_fields,
    has_tensordict,
    non_tensor_value,
    tensorclass_fields,
)
from tdckpt.errors import RestoreError, TdckptError

__all__ = ["restore_into_target", "tensordict_order"]

_IS_NESTED = attrgetter("is_nested")


class _Plan:
    """What the commit assigns."""

    __slots__ = ("fields", "items", "levels", "non_tensors", "prefixes")

    def __init__(self) -> None:
        self.items: list[
            tuple[dict[str, Any], dict[str, Any]]
        ] = []  # (a level's item dict, new items)
        self.prefixes: list[tuple[Any, Path | None]] = []
        self.fields: list[tuple[Any, dict[str, Any]]] = []  # (tensorclass/NTD, fields)
        self.levels: list[Any] = []  # every TensorDict level touched
        self.non_tensors: list[tuple[Any, str]] = []  # (NTD, its directory)


@functools.cache
def _tensordict_types() -> tuple[type, type, type, Callable[[Any], bool], type] | None:
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
def _view_types() -> tuple[type, type] | None:
    """tensordict's view classes: ``_SubTensorDict`` and the lazy views' ``_CustomOpTensorDict``."""
    if not has_tensordict():
        return None
    from tensordict._lazy import _CustomOpTensorDict
    from tensordict._td import _SubTensorDict

    return _SubTensorDict, _CustomOpTensorDict


def _view_kind(obj: Any) -> str | None:
    """``"sub"`` (a ``_SubTensorDict``), ``"lazy"`` (a lazy view) or None (not a view)."""
    types = _view_types()
    if types is None or type(obj) is _tensordict_types()[4]:  # type: ignore[index]
        return None
    if isinstance(obj, types[0]):
        return "sub"
    if isinstance(obj, types[1]):
        return "lazy"
    return None


def view_storage(obj: Any) -> Any:
    """The tensordict that holds a view's data (through views of views); ``obj`` if no view."""
    while _view_kind(obj) is not None:
        obj = obj._source
    return obj


def _is_td(obj: Any) -> bool:
    types = _tensordict_types()
    return types is not None and (type(obj) is types[4] or isinstance(obj, types[0]))


def _is_lazy_stack(obj: Any) -> bool:
    types = _tensordict_types()
    return types is not None and type(obj) is not types[4] and isinstance(obj, types[1])


def _is_tensorclass(obj: Any) -> bool:
    types = _tensordict_types()
    return types is not None and type(obj) is not types[4] and types[3](obj)


def _is_non_tensor_data(obj: Any) -> bool:
    types = _tensordict_types()
    return (
        types is not None
        and type(obj) is not types[4]
        and isinstance(obj, types[2])
        and not isinstance(obj, types[1])
    )


def _value_batch(value: Any) -> tuple[int, ...] | None:
    """The batch size of a non-leaf entry's value (leaves are checked from their metadata)."""
    if _is_td(value) or _is_tensorclass(value):
        return tuple(value.batch_size)
    return None


def _kind(obj: Any) -> str:
    return type(obj).__name__


class _Preparer:
    def __init__(
        self, opened: OpenedCheckpoint, mapper: Mapper, builder: Any, unpickle: bool
    ) -> None:
        self.opened = opened
        self.mapper = mapper
        self.builder = builder
        self.unpickle = unpickle
        self.plan = _Plan()
        #: id() of every target object a saved level is loaded into -> that level's key: an
        #: object reached twice (two keys holding the same sub-tensordict, a lazy stack
        #: holding one member twice, a level that contains itself) is refused.
        self.claimed: dict[int, tuple[str, ...]] = {}

    def where(self, node: Node) -> str:
        return self.opened.storage.display(node.path)

    def claim(self, target: Any, node: Node) -> None:
        """Refuse a target object that two saved levels would be loaded into (aliases).

        Both would load into the one object and the last would silently win; the
        checkpoint's levels are distinct objects, so no in-place restore can be faithful.
        """
        claimed = self.claimed
        count = len(claimed)
        other = claimed.setdefault(id(target), node.key)
        if len(claimed) == count:
            first, second = (".".join(k) or "<root>" for k in (other, node.key))
            raise RestoreError(
                f"{self.where(node)}: the target holds the same {_kind(target)} object under "
                f"{first!r} and {second!r}, so both saved levels would be loaded into one object "
                "and the last would silently win; nothing was changed. Make them distinct "
                f"objects before restoring (e.g. clone one of them: td[{second!r}] = "
                f"td[{second!r}].clone()), or use tdckpt.load_memmap to get a new object.",
                key=node.key,
                keys=[first, second],
            )

    def into(self, target: Any, node: Node) -> None:
        if isinstance(node, LazyViewNode) and _tensordict_types() is not None:
            # tensordict 0.15.3 loads a saved lazy view in place by loading the view's saved
            # source into the target itself (_CustomOpTensorDict._load_memmap passes ``out`` on).
            self.into(target, node.source)
            return
        view = _view_kind(target)
        if view is not None:
            self._into_view(target, node, view)
            return
        self.claim(target, node)
        types = _tensordict_types()
        if type(node) is TensorDictNode and types is not None and type(target) is types[4]:
            self._into_td(target, node)  # the usual case: a TensorDict level into a TensorDict
            return
        if isinstance(node, TensorClassNode):
            if not _is_tensorclass(target) or _is_non_tensor_data(target):
                raise RestoreError(
                    f"{self.where(node)}: the checkpoint holds a tensorclass {node.type_str}, the "
                    f"target is a {_kind(target)}. Restore into an instance of that class, or use "
                    "tdckpt.load_memmap to get a new object.",
                    key=node.key,
                )
            if str(type(target)) != node.type_str:
                raise RestoreError(
                    f"{self.where(node)}: the checkpoint holds {node.type_str}, the target is "
                    f"{type(target)}. Restore into an instance of the saved class.",
                    key=node.key,
                )
            fields = tensorclass_fields(node, self.opened.storage, self.unpickle)
            check_tensorclass_fields(type(target), fields, node.inner.entries, self.where(node))
            self.plan.fields.append((target, fields))
            self.into(target._tensordict, node.inner)
            return
        if isinstance(node, LazyStackNode):
            if not _is_lazy_stack(target):
                raise RestoreError(
                    f"{self.where(node)}: the checkpoint holds a lazy stack of "
                    f"{len(node.members)} tensordicts, the target is a {_kind(target)}. "
                    "tensordict would silently load nothing into it; use tdckpt.load_memmap "
                    "to get a new LazyStackedTensorDict.",
                    key=node.key,
                )
            members = target.tensordicts
            if len(members) != len(node.members):
                raise RestoreError(
                    f"{self.where(node)}: cannot load {len(node.members)} stacked tensordicts "
                    f"into a stack of {len(members)}.",
                    key=node.key,
                )
            if target.stack_dim != node.stack_dim:
                raise RestoreError(
                    f"{self.where(node)}: saved stack_dim {node.stack_dim}, target stack_dim "
                    f"{target.stack_dim}.",
                    key=node.key,
                )
            for member, sub in zip(members, node.members, strict=True):
                self.into(member, sub)
            return
        if isinstance(node, TensorDictNode):
            if isinstance(target, dict):
                self._into_dict(target, node, claimed=True)
                return
            if not _is_td(target) or _is_lazy_stack(target):
                raise RestoreError(
                    f"{self.where(node)}: the checkpoint holds a TensorDict, the target is a "
                    f"{_kind(target)}.",
                    key=node.key,
                )
            self._into_td(target, node)
            return
        fix = (
            " (tensordict 0.15.3 refuses it too). A saved sub-tensordict loads in place into "
            "a sub-tensordict target (`td._get_sub_tensordict(idx)`), which loads its saved "
            "source into the target's parent;"
            if isinstance(node, SubTensorDictNode)
            else ";"
        )
        raise RestoreError(
            f"{self.where(node)}: the checkpoint holds {_node_what(node)}, which cannot be "
            f"loaded in place into a {_kind(target)}{fix} nothing was changed. Use "
            "tdckpt.load_memmap to get a new object.",
            key=node.key,
        )

    # -- view targets: a _SubTensorDict or a lazy view of a parent tensordict ---------------

    def _view_refusal(self, target: Any, node: Node, why: str, fix: str) -> RestoreError:
        return RestoreError(
            f"{self.where(node)}: cannot load {_node_what(node)} in place into the "
            f"{_kind(target)} target (a view of a {_kind(target._source)}): {why}; nothing was "
            f"changed. {fix}",
            key=node.key,
        )

    def _into_view(self, target: Any, node: Node, kind: str) -> None:
        """Load ``node`` through the view ``target`` into its parent, as tensordict 0.15.3 does.

        * a saved sub-tensordict into a sub-tensordict: its saved source is loaded in place
          into the view's source (the parent); the saved index is not used;
        * a saved TensorDict into a sub-tensordict: refused where tensordict raises (a saved
          key the view already has); otherwise every new entry is written into the rows of
          the view, zeros elsewhere, and the parent's other keys are removed;
        * a saved TensorDict into a lazy view: each entry is set in the parent through the
          view's inverse operation (``squeeze`` for an ``unsqueeze`` view ...), and the
          parent's other keys are removed.

        Everything is prepared here; the commit swaps the parent's items in one step.
        """
        parent = target._source
        self.claim(target, node)
        if target.is_locked:
            if not _is_memmap(parent):
                raise self._view_refusal(
                    target,
                    node,
                    "its parent is locked (and not memory-mapped), so it cannot take new values",
                    "Call `parent.unlock_()` first.",
                )
            if kind == "sub":
                raise self._view_refusal(
                    target,
                    node,
                    "its parent is memory-mapped and locked, and tensordict 0.15.3 refuses too "
                    "('Cannot unlock a _SubTensorDict')",
                    "Restore into the parent tensordict, or unlock it first (`parent.unlock_()`).",
                )
            if self.mapper.records_prefix:
                raise self._view_refusal(
                    target,
                    node,
                    "its parent is memory-mapped, and tensordict 0.15.3 memory-maps it again by "
                    "copying the data into the checkpoint (<prefix>/_source, and a new "
                    "meta.json); tdckpt never writes to a checkpoint",
                    "Restore with mode='r', or into the unlocked parent.",
                )
        if kind == "sub" and isinstance(node, SubTensorDictNode):
            if _view_kind(parent) is None:
                self.into(parent, node.source)
                return
            self._into_view(parent, node.source, "sub")  # a view of a view: one level down
            return
        if not isinstance(node, TensorDictNode) or type(node) is not TensorDictNode:
            raise self._view_refusal(
                target,
                node,
                "tensordict 0.15.3 refuses it too"
                if isinstance(node, SubTensorDictNode)
                else "only a saved TensorDict (or a saved view of one) loads through a view",
                "Use tdckpt.load_memmap to get a new object.",
            )
        types = _tensordict_types()
        assert types is not None
        chain = [target]  # a sub-tensordict of a sub-tensordict writes through both
        while kind == "sub" and _view_kind(parent) == "sub":
            chain.append(parent)
            parent = parent._source
        if type(parent) is not types[4]:
            raise self._view_refusal(
                target,
                node,
                "tdckpt writes through a view only into a plain TensorDict parent",
                "Restore into the parent itself, or use tdckpt.load_memmap.",
            )
        self.claim(parent, node)
        if kind == "sub":
            self._through_sub(chain, parent, node)
        else:
            self._through_lazy(target, parent, node)

    def _view_value(self, target: Any, node: TensorDictNode, key: str, sub: Node) -> Any:
        """A saved entry built for a view target, checked against the view's batch size."""
        if not isinstance(sub, (LeafNode, TensorDictNode)) or type(sub) not in (
            LeafNode,
            TensorDictNode,
        ):
            raise self._view_refusal(
                target,
                sub,
                f"the saved entry {key!r} is {_node_what(sub)}; only tensors and TensorDicts "
                "are written through a view",
                "Use tdckpt.load_memmap to get a new object.",
            )
        batch = tuple(target.batch_size)
        if isinstance(sub, LeafNode):
            shape = sub.shape[:1] if sub.is_nested else sub.shape
            if sub.is_nested:
                raise self._view_refusal(
                    target,
                    sub,
                    f"the saved entry {key!r} is a nested tensor",
                    "Use tdckpt.load_memmap to get a new object.",
                )
        else:
            shape = tuple(sub.batch_size)
        if shape[: len(batch)] != batch:
            self._batch_error(sub, shape, batch)
        return self.builder.build(sub, node.batch_size)

    def _through_sub(self, chain: list[Any], parent: Any, node: TensorDictNode) -> None:
        target = chain[0]
        existing = sorted(k for k in node.entries if k in parent._tensordict)
        if existing:
            raise self._view_refusal(
                target,
                node,
                f"the view already holds the saved key(s) {existing[:10]}, and tensordict "
                "0.15.3 refuses that ('_SubTensorDict.set(key, value, inplace=False) is "
                "prohibited for existing tensors')",
                "To write the saved values into the rows of the view, use "
                "`view.update_(tdckpt.load_memmap(prefix))`; to replace the parent's data, "
                "restore into the parent.",
            )
        new: dict[str, Any] = {}
        for key, sub in node.entries.items():
            value = self._view_value(target, node, key, sub)
            try:
                for view in chain:
                    value = _expand_at(view._source, view, value)
                new[key] = value
            except (IndexError, RuntimeError, TypeError, ValueError) as exc:
                raise self._view_refusal(
                    target,
                    sub,
                    f"the saved entry {key!r} cannot be written at the view's index "
                    f"({type(exc).__name__}: {exc})",
                    "Use tdckpt.load_memmap to get a new object.",
                ) from exc
        self.plan.items.append((parent._tensordict, new))

    def _through_lazy(self, target: Any, parent: Any, node: TensorDictNode) -> None:
        pbatch = tuple(parent.batch_size)
        new: dict[str, Any] = {}
        for key, sub in node.entries.items():
            value = self._view_value(target, node, key, sub)
            try:
                value = getattr(value, target.inv_op)(**target._update_inv_op_kwargs(value))
            except (IndexError, RuntimeError, TypeError, ValueError) as exc:
                raise self._view_refusal(
                    target,
                    sub,
                    f"the view's inverse operation {target.inv_op}({target.inv_op_kwargs}) "
                    f"cannot be applied to the saved entry {key!r} ({type(exc).__name__}: {exc})",
                    "Use tdckpt.load_memmap to get a new object.",
                ) from exc
            shape = tuple(value.batch_size if _is_td(value) else value.shape)
            if shape[: len(pbatch)] != pbatch:
                self._batch_error(sub, shape, pbatch)
            new[key] = value
        self.plan.items.append((parent._tensordict, new))

    def _into_dict(
        self, target: dict[str, Any], node: TensorDictNode, claimed: bool = False
    ) -> None:
        if not claimed:
            self.claim(target, node)
        new: dict[str, Any] = {}
        for key, sub in node.entries.items():
            existing = target.get(key)
            if isinstance(sub, TensorDictNode) and isinstance(existing, dict):
                self._into_dict(existing, sub)
                new[key] = existing
            else:
                new[key] = self.builder.build(sub, node.batch_size)
        self.plan.items.append((target, new))

    def _batch_error(self, sub: Node, shape: tuple[int, ...], batch: tuple[int, ...]) -> None:
        raise RestoreError(
            _batch_error_message(self.where(sub), sub, shape, batch),
            key=sub.key,
            expected=list(batch),
            found=list(shape),
        )

    def _into_td(self, target: Any, node: TensorDictNode) -> None:
        if target.is_locked and not target.is_memmap():
            raise RestoreError(
                f"{self.where(node)}: the target tensordict is locked (and not memory-mapped), "
                "so it cannot take new values. Call `td.unlock_()` first.",
                key=node.key,
            )
        batch = tuple(target.batch_size)
        nb = len(batch)
        new: dict[str, Any] = {}
        # The common case, kept lean: a leaf's shape is checked from the metadata, and the
        # level's leaves are mapped in one call once the loop is done.
        leaves: list[LeafNode] = []
        leaf_keys: list[str] = []
        #: the entries still to go through one by one
        others = node.entries
        if (
            batch == tuple(node.batch_size)
            and set(map(type, others.values())) == {LeafNode}
            and not any(map(_IS_NESTED, others.values()))
        ):
            # A level of dense leaves at the saved batch size (the large case): validation
            # checked that every shape starts with it, so nothing is left to check per leaf.
            leaves = cast("list[LeafNode]", list(others.values()))
            leaf_keys = list(others)
            others = {}
        for key, sub in others.items():
            if type(sub) is LeafNode:
                shape = sub.shape[:1] if sub.is_nested else sub.shape
                if shape[:nb] != batch:
                    self._batch_error(sub, shape, batch)
                leaves.append(sub)
                leaf_keys.append(key)
                continue
            existing = target._tensordict.get(key)
            reuse = existing is not None and (
                (
                    isinstance(sub, TensorDictNode)
                    and _is_td(existing)
                    and not _is_lazy_stack(existing)
                )
                or (
                    isinstance(sub, TensorClassNode)
                    and _is_tensorclass(existing)
                    and str(type(existing)) == sub.type_str
                )
                or (
                    isinstance(sub, LazyStackNode)
                    and _is_lazy_stack(existing)
                    and len(existing.tensordicts) == len(sub.members)
                )
            )
            if reuse:
                self.into(existing, sub)
                value = existing
            elif isinstance(sub, SubTensorDictNode) and _view_kind(existing) == "sub":
                # tensordict loads a saved sub-tensordict into the one the target holds:
                # through it, into its source
                self.into(existing, sub)
                value = existing
            elif (
                isinstance(sub, LazyViewNode)
                and existing is not None
                and _is_td(existing)
                and not _is_lazy_stack(existing)
                and _view_kind(existing) is None
            ):
                # tensordict loads the saved view's source into the target's collection at
                # that key, then sets a new lazy view over it (_CustomOpTensorDict._load_memmap).
                # Where the target holds a view there, tensordict loads through that view (with
                # a lazy view, through its inverse op: leaves its source's batch size cannot
                # hold); tdckpt rebuilds the saved view and sets it, below.
                self.into(existing, sub.source)
                value = _lazy_view_over(existing, sub)
            elif (
                isinstance(sub, NonTensorNode)
                and _is_non_tensor_data(existing)
                and type(existing).__name__ == sub.class_name
            ):
                self.claim(existing, sub)
                value_, fields = non_tensor_value(sub, self.opened.storage, self.unpickle)
                new_fields = {"data": value_, **fields, "_is_non_tensor": True}
                self.plan.fields.append((existing, new_fields))
                value = existing
            else:
                value = self.builder.build(sub, node.batch_size)
                if not isinstance(sub, NonTensorNode):
                    self.plan.non_tensors.extend(_built_non_tensors(value, sub))
            vb = (
                _value_batch(value) if not isinstance(sub, NonTensorNode) else tuple(sub.batch_size)
            )
            if vb is not None and vb[:nb] != batch:
                self._batch_error(sub, vb, batch)
            if isinstance(sub, NonTensorNode):
                self.plan.non_tensors.append((value, sub.path))
            new[key] = value
        mapped = dict(zip(leaf_keys, self.mapper.leaves(leaves), strict=True))
        if node.keep is not None:  # a selective restore: what it does not select stays
            for name, value in target._tensordict.items():
                if name not in mapped and name not in new and node.keep(name):
                    new[name] = value
        self.plan.items.append(
            (target._tensordict, tensordict_order(target._tensordict, mapped, new))
        )
        self.plan.prefixes.append((target, self.mapper.dir_path(node.path)))
        self.plan.levels.append(target)


def tensordict_order(
    current: dict[str, Any], tensors: dict[str, Any], levels: dict[str, Any]
) -> dict[str, Any]:
    """A level's items in the order tensordict leaves them: the target's keys where they were
    (``current``; empty for a new object), then the saved tensors, then the saved sub-levels
    and non-tensor data (each in saved order; ``tensors`` and ``levels`` are)."""
    if not levels and current.keys() == tensors.keys():  # a level of leaves, the same keys
        if list(current) == list(tensors):  # and in the same order: as they are
            return tensors
        return dict(zip(current, map(tensors.__getitem__, current), strict=True))
    ordered = {}
    for key in current:
        if key in tensors:
            ordered[key] = tensors[key]
        elif key in levels:
            ordered[key] = levels[key]
    if len(ordered) == len(tensors) + len(levels):  # the usual restore: the same keys
        return ordered
    for key, value in tensors.items():
        ordered.setdefault(key, value)
    for key, value in levels.items():
        ordered.setdefault(key, value)
    return ordered


def _node_what(node: Node) -> str:
    return {
        "SubTensorDictNode": "a sub-tensordict (a view of another tensordict)",
        "LazyViewNode": "a lazy view (unsqueeze/permute/... of another tensordict)",
        "TensorDictNode": "a TensorDict",
        "LeafNode": "a tensor",
    }.get(type(node).__name__, f"a {type(node).__name__.removesuffix('Node')}")


def _lazy_view_over(source: Any, node: LazyViewNode) -> Any:
    import tensordict._lazy as lazy

    cls = getattr(lazy, node.class_id.rpartition(":")[2])
    return cls(
        source,
        custom_op=node.op,
        inv_op=node.inv_op,
        custom_op_kwargs=dict(node.kwargs),
        inv_op_kwargs=dict(node.inv_kwargs),
    )


def _expand_at(parent: Any, view: Any, value: Any) -> Any:
    """``value`` (of the view's batch size) as the parent's entry: zeros, ``value`` at the
    view's index - what tensordict's ``_SubTensorDict._set_str`` builds for a new key."""
    dims = len(view.batch_size)
    pbatch = tuple(parent.batch_size)
    if isinstance(value, torch.Tensor):
        out = torch.zeros((*pbatch, *value.shape[dims:]), dtype=value.dtype, device=parent.device)
        out[view.idx] = value
        return out
    from tensordict import TensorDict

    entries = {k: _expand_at(parent, view, v) for k, v in value._tensordict.items()}
    result = TensorDict(batch_size=(*pbatch, *value.batch_size[dims:]), device=parent.device)
    result._tensordict.update(entries)
    return result


def _batch_error_message(
    where: str, sub: Node, shape: tuple[int, ...], batch: tuple[int, ...]
) -> str:
    what = "leaf" if isinstance(sub, LeafNode) else "entry"
    return (
        f"{where}: the saved {what} {'.'.join(sub.key)!r} has shape {list(shape)}, which the "
        f"target's batch size {list(batch)} cannot hold. Restore into a tensordict with a "
        "matching batch size, or use tdckpt.load_memmap."
    )


def _all_td_levels(target: Any) -> list[Any]:
    """Every TensorDict level under target (for the lock/memmap state)."""
    out = []
    stack = [target]
    while stack:
        cur = stack.pop()
        if _is_tensorclass(cur) and not _is_non_tensor_data(cur):
            cur = cur._tensordict
        if _is_lazy_stack(cur):
            stack.extend(cur.tensordicts)
            continue
        if not _is_td(cur):  # NonTensorData is a tensorclass, never a TensorDictBase
            continue
        out.append(cur)
        stack.extend(v for v in cur._tensordict.values() if _is_td(v) or _is_tensorclass(v))
    return out


def _built_non_tensors(value: Any, node: Node) -> list[tuple[Any, str]]:
    """The NonTensorData objects inside a newly built ``value``, with their directories."""
    if isinstance(node, NonTensorNode):
        return [(value, node.path)] if _is_non_tensor_data(value) else []
    if isinstance(node, TensorClassNode) and _is_tensorclass(value):
        return _built_non_tensors(value._tensordict, node.inner)
    if isinstance(node, LazyStackNode) and _is_lazy_stack(value):
        pairs = zip(value.tensordicts, node.members, strict=False)
        return [nt for member, sub in pairs for nt in _built_non_tensors(member, sub)]
    if isinstance(node, TensorDictNode) and _is_td(value) and not _is_lazy_stack(value):
        return [
            nt
            for key, sub in node.entries.items()
            if key in value._tensordict
            for nt in _built_non_tensors(value._tensordict[key], sub)
        ]
    return []


def _non_tensor_levels(levels: list[Any]) -> list[Any]:
    """The TensorDicts inside the NonTensorData entries of ``levels`` (they carry memmap flags)."""
    tensor = torch.Tensor
    return [
        v._tensordict
        for lvl in levels
        # a level of tensors only (the large one) is skipped on the set of its value types
        if not all(issubclass(t, tensor) for t in set(map(type, lvl._tensordict.values())))
        for v in lvl._tensordict.values()
        if not isinstance(v, tensor) and _is_non_tensor_data(v)
    ]


def _is_memmap(td: Any) -> bool:
    try:
        return bool(td.is_memmap())
    except RuntimeError:  # a lazy stack whose members disagree
        return False


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
    inner = target._tensordict if _is_tensorclass(target) else target
    if _is_td(inner) and inner.device is not None:
        device = inner.device
    check_map_budget(opened, device)
    mapper = Mapper(opened.storage, mode, device)
    builder = builder_factory(opened, mapper, unpickle)
    prep = _Preparer(opened, mapper, builder, unpickle)
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
    root_td = holder if _is_td(holder) else None
    was_memmap = bool(root_td is not None and _is_memmap(root_td))
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
        for lvl, prefix, is_memmap in snapshot_flags:
            lvl._memmap_prefix = prefix
            lvl._is_memmap = is_memmap
        if was_locked and root_td is not None and not root_td.is_locked:
            root_td.lock_()
        raise
