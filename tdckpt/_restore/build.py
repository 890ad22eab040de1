"""Building new objects from a validated node tree: the restore engine's builders.

:class:`Builder` makes fresh objects of a checkpoint - TensorDicts, tensorclasses, lazy
stacks and their views, non-tensor data, or nested plain dicts of tensors without
tensordict - mapping each leaf through a :class:`~tdckpt._restore.plan.Mapper`.
:class:`StructureBuilder` makes stand-ins with a restore's keys (``device="meta"``
leaves, nothing read, unpickled or run) for the strict key checks
(:mod:`tdckpt._restore.keys`, :mod:`tdckpt._shard.check`). Neither changes anything that
exists: the in-place part of a restore is :mod:`tdckpt._restore.apply`.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from tdckpt._read.nodes import (
    LazyStackNode,
    LazyViewNode,
    LeafNode,
    Node,
    NonTensorNode,
    NonTensorStackNode,
    SubTensorDictNode,
    TensorClassNode,
    TensorDictNode,
)
from tdckpt._read.pipeline import OpenedCheckpoint
from tdckpt._read.views import node_batch
from tdckpt._restore.plan import (
    Mapper,
    check_tensorclass_fields,
    has_tensordict,
    non_tensor_value,
    nt_stack_value,
    resolve_tensorclass,
    tensorclass_fields,
)
from tdckpt.errors import RestoreError, TdckptError

__all__ = ["Builder", "StructureBuilder"]


class Builder:
    """Builds fresh objects (tensordict classes, or plain dicts without tensordict)."""

    def __init__(self, opened: OpenedCheckpoint, mapper: Mapper, unpickle: bool) -> None:
        self.opened = opened
        self.mapper = mapper
        self.unpickle = unpickle
        self.td = has_tensordict()

    def _device(self, saved: str | None) -> torch.device | None:
        if self.mapper.device is not None:
            return self.mapper.device
        if saved is None:
            return None
        device = torch.device(saved)  # validation checked it parses
        if device.type != "cpu":
            # The leaves are CPU maps of the files: a tensordict that says it lives on
            # another device would be inconsistent (tensordict itself builds one).
            raise RestoreError(
                f"{self.opened.prefix}: the checkpoint records device {saved!r}, but its data "
                "is loaded as CPU memory maps. Pass device='cpu' (or the device to move the "
                "data to) to tdckpt.load_memmap, or restore into a tensordict on that device.",
                device=saved,
            )
        return device

    def build(
        self, node: Node, batch: tuple[int, ...] = (), parent_device: torch.device | None = None
    ) -> Any:
        """Build ``node``; a non-tensor without a saved device takes ``parent_device``.

        NonTensorData (and NonTensorStack from 0.15.3) record no device of their own:
        tensordict's loader moves them to the device of the tensordict that holds them.
        """
        if isinstance(node, LeafNode):
            return self.mapper.leaf(node)
        try:
            return self._build(node, batch, parent_device)
        except TdckptError:
            raise
        except (
            AttributeError,
            IndexError,
            KeyError,
            OverflowError,
            RuntimeError,
            TypeError,
            ValueError,
        ) as exc:
            # The last line of defence: validation should have refused whatever makes a
            # torch or tensordict constructor fail. Name the key, never a raw traceback.
            where = self.opened.storage.display(node.path)
            raise RestoreError(
                f"{where}: the saved {type(node).__name__.removesuffix('Node')} at key "
                f"{'.'.join(node.key) or '<root>'!r} passed validation but cannot be rebuilt "
                f"({type(exc).__name__}: {exc}); nothing was changed. The checkpoint is damaged "
                "or was edited; please report it as a tdckpt bug, with `tdckpt validate` output.",
                path=where,
                key=node.key,
            ) from exc

    def _build(self, node: Node, batch: tuple[int, ...], parent_device: torch.device | None) -> Any:
        if isinstance(node, LeafNode):
            return self.mapper.leaf(node)
        if isinstance(node, TensorDictNode):
            return self.tensordict(node)
        if isinstance(node, LazyStackNode):
            members = [self.build(m) for m in node.members]
            if not self.td:
                return members
            from tensordict import LazyStackedTensorDict

            if not members:
                where = self.opened.storage.display(node.path)
                raise RestoreError(f"{where}: a lazy stack with no members cannot be rebuilt.")
            result = LazyStackedTensorDict(*members, stack_dim=node.stack_dim)
            if node.stack_dim_name is not None:
                result._td_dim_name = node.stack_dim_name
            return result
        if isinstance(node, NonTensorNode):
            value, fields = non_tensor_value(node, self.opened.storage, self.unpickle)
            if not self.td:
                return value
            return self._non_tensor(node, value, fields, parent_device)
        if isinstance(node, NonTensorStackNode):
            data = nt_stack_value(node, self.opened.storage, self.unpickle)
            if not self.td:
                return data
            from tensordict import NonTensorStack

            device = self._device(node.device)
            return NonTensorStack._from_list(
                data, device=parent_device if device is None else device
            )
        if isinstance(node, TensorClassNode):
            inner = self.tensordict(node.inner)
            fields = tensorclass_fields(node, self.opened.storage, self.unpickle)
            if not self.td:
                return {**inner, **fields}
            where = self.opened.storage.display(node.path)
            cls = resolve_tensorclass(node.type_str, where)
            check_tensorclass_fields(cls, fields, inner.keys(), where)
            return cls._from_tensordict(inner, fields)  # type: ignore[attr-defined]
        if isinstance(node, (SubTensorDictNode, LazyViewNode)):
            return self._view(node)
        raise AssertionError(type(node))  # pragma: no cover

    def _view(self, node: SubTensorDictNode | LazyViewNode) -> Any:
        """A sub-tensordict or lazy view over its built source, as tensordict 0.15.3 loads it.

        Without tensordict, the view's values are materialized (the index or the operation
        applied to every tensor), as nested dicts; refused where that would not be what
        tensordict shows (non-tensor data, stacks or nested tensors in the source, a
        ``squeeze()`` without dim, negative dims).
        """
        where = self.opened.storage.display(node.path)
        if not self.td:
            _check_plain_view(node, where)
        source = self.build(node.source)
        if isinstance(node, SubTensorDictNode):
            if self.td:
                from tensordict._td import _SubTensorDict

                return _SubTensorDict(source, node.index)
            index = _expand_ellipsis(node.index, len(node_batch(node.source) or ()))
            return _plain_apply(source, lambda t: t[index])
        if self.td:
            import tensordict._lazy as lazy

            cls = getattr(lazy, node.class_id.rpartition(":")[2])
            return cls(
                source,
                custom_op=node.op,
                inv_op=node.inv_op,
                custom_op_kwargs=dict(node.kwargs),
                inv_op_kwargs=dict(node.inv_kwargs),
            )
        return _plain_apply(
            source, _leaf_op(node.op, node.kwargs, len(node_batch(node.source) or ()))
        )

    def _non_tensor(
        self,
        node: NonTensorNode,
        value: Any,
        fields: dict[str, Any],
        parent_device: torch.device | None,
    ) -> Any:
        from tensordict import TensorDict
        from tensordict.tensorclass import MetaData, NonTensorData

        cls = MetaData if node.class_name == "MetaData" else NonTensorData
        device = self._device(node.device)
        td = TensorDict(
            batch_size=node.batch_size, device=parent_device if device is None else device
        )
        non_td = {"data": value, **fields}
        non_td.setdefault("_is_non_tensor", True)
        return cls._from_tensordict(td, non_td)

    def tensordict(self, node: TensorDictNode) -> Any:
        if not self.td:
            return {k: self.build(v, node.batch_size) for k, v in node.entries.items()}
        from tensordict import TensorDict

        device = self._device(node.device)
        leaf_keys: list[str] = []
        leaves: list[LeafNode] = []  # mapped together, below
        levels: dict[str, Any] = {}
        for k, v in node.entries.items():
            if type(v) is LeafNode:
                leaf_keys.append(k)
                leaves.append(v)
            else:
                levels[k] = self.build(v, node.batch_size, device)
        tensors = dict(zip(leaf_keys, self.mapper.leaves(leaves), strict=True))
        entries = tensordict_order({}, tensors, levels)
        td = TensorDict(batch_size=node.batch_size, device=device)
        if node.names is not None:
            # Any: tensordict 0.14 and 0.15 annotate these private members differently
            cast(Any, td)._set_names(node.names)
        td._tensordict.update(entries)
        cast(Any, td)._memmap_prefix = self.mapper.dir_path(node.path)
        return td


class StructureBuilder(Builder):
    """Builds stand-ins with a restore's keys, for the strict key check of a view's keys.

    Leaves are ``device="meta"`` tensors (the mapper's structure-only mode), non-tensor data
    a meta tensor of its level's batch size (a leaf, indexed as a view indexes it), a
    tensorclass its tensordict (the keys it shows): nothing is read, unpickled or run.
    """

    def build(
        self, node: Node, batch: tuple[int, ...] = (), parent_device: torch.device | None = None
    ) -> Any:
        if isinstance(node, (NonTensorNode, NonTensorStackNode)):
            return torch.empty(batch, device="meta")
        if isinstance(node, TensorClassNode):
            return self.tensordict(node.inner)
        return super().build(node, batch, parent_device)


def _check_plain_view(node: SubTensorDictNode | LazyViewNode, where: str) -> None:
    if isinstance(node, LazyViewNode):
        values = [v for v in node.kwargs.values()]
        flat = [d for v in values for d in (v if isinstance(v, list) else [v])]
        if (node.op == "squeeze" and not node.kwargs) or any(
            d < 0 for d in flat if node.op != "view"
        ):
            raise RestoreError(
                f"{where}: without tensordict, a lazy {node.op}({node.kwargs}) cannot be "
                "materialized faithfully (tensordict applies it to each tensor as is). Install "
                "tensordict to load it."
            )
    stack: list[Node] = [node.source]
    while stack:
        cur = stack.pop()
        if isinstance(cur, TensorDictNode):
            stack.extend(cur.entries.values())
        elif isinstance(cur, (SubTensorDictNode, LazyViewNode)):
            stack.append(cur.source)
        elif not (isinstance(cur, LeafNode) and not cur.is_nested):
            raise RestoreError(
                f"{where}: without tensordict, a saved {type(node).__name__.removesuffix('Node')} "
                f"is materialized as nested dicts of tensors, but its source holds a "
                f"{type(cur).__name__.removesuffix('Node')} at {'.'.join(cur.key)!r} that cannot "
                "be viewed that way. Install tensordict to load it.",
                key=cur.key,
            )


def _expand_ellipsis(index: Any, batch_dims: int) -> tuple[Any, ...]:
    """The index as _SubTensorDict holds it: a tuple, Ellipsis spanning the batch only."""
    items = tuple(index) if isinstance(index, (tuple, list)) else (index,)
    if not any(i is Ellipsis for i in items):
        return items
    used = sum(
        (i.ndim if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1)
        for i in items
        if i is not None and i is not Ellipsis
    )
    out: list[Any] = []
    for i in items:
        out.extend([slice(None)] * (batch_dims - used) if i is Ellipsis else [i])
    return tuple(out)


def _leaf_op(op: str, kwargs: dict[str, Any], batch_dims: int) -> Any:
    """The operation tensordict's lazy view applies to one tensor of its source."""
    if op == "view":
        return lambda t: t.view(*kwargs["size"], *t.shape[batch_dims:])
    if op == "permute":
        dims = list(kwargs["dims"])
        return lambda t: t.permute(*dims, *range(len(dims), t.ndim))
    if op == "squeeze" and isinstance(kwargs["dim"], list):
        squeezed = tuple(kwargs["dim"])
        return lambda t: t.squeeze(squeezed)
    return lambda t: getattr(t, op)(**kwargs)


def _plain_apply(value: Any, fn: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain_apply(v, fn) for k, v in value.items()}
    return fn(value)


# -- public API ----------------------------------------------------------------------------


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
