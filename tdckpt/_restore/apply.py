"""The apply stage: what an existing target takes from a validated checkpoint, prepared in full
before anything changes.

:class:`Preparer` walks the target beside the validated checkpoint, decides for every level
which object is reused and which value is new, builds and maps every new value, and checks
that the target can hold them (kinds, batch sizes, tensorclass identity, lazy-stack member
counts, views loaded through to their parent). What it decides is a plan of plain
assignments; the target is untouched. The commit (``commit.py``) then swaps the plan in, all
or nothing.
"""

from __future__ import annotations

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
from tdckpt._restore.build import tensordict_order
from tdckpt._restore.kinds import (
    is_lazy_stack,
    is_memmap,
    is_non_tensor_data,
    is_td,
    is_tensorclass,
    kind_name,
    tensordict_types,
    value_batch,
    view_kind,
)
from tdckpt._restore.plan import (
    Mapper,
    check_tensorclass_fields,
    non_tensor_value,
    tensorclass_fields,
)
from tdckpt._restore.select import BELOW, KEEP
from tdckpt.errors import RestoreError

__all__ = ["Preparer"]

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


class Preparer:
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
        #: whether the target's root is locked (then a memory-mapped one, which the commit
        #: unlocks and locks again with every level below it)
        self.root_locked = False

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
                f"{self.where(node)}: the target holds the same {kind_name(target)} object under "
                f"{first!r} and {second!r}, so both saved levels would be loaded into one object "
                "and the last would silently win; nothing was changed. Make them distinct "
                f"objects before restoring (e.g. clone one of them: td[{second!r}] = "
                f"td[{second!r}].clone()), or use tdckpt.load_memmap to get a new object.",
                key=node.key,
                keys=[first, second],
            )

    def into(self, target: Any, node: Node) -> None:
        if isinstance(node, LazyViewNode) and tensordict_types() is not None:
            # tensordict 0.15.3 loads a saved lazy view in place by loading the view's saved
            # source into the target itself (_CustomOpTensorDict._load_memmap passes ``out`` on).
            self.into(target, node.source)
            return
        view = view_kind(target)
        if view is not None:
            self._into_view(target, node, view)
            return
        self.claim(target, node)
        types = tensordict_types()
        if type(node) is TensorDictNode and types is not None and type(target) is types[4]:
            self._into_td(target, node)  # the usual case: a TensorDict level into a TensorDict
            return
        if isinstance(node, TensorClassNode):
            if not is_tensorclass(target) or is_non_tensor_data(target):
                raise RestoreError(
                    f"{self.where(node)}: the checkpoint holds a tensorclass {node.type_str}, the "
                    f"target is a {kind_name(target)}. Restore into an instance of that class, or "
                    "use tdckpt.load_memmap to get a new object.",
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
            if not is_lazy_stack(target):
                raise RestoreError(
                    f"{self.where(node)}: the checkpoint holds a lazy stack of "
                    f"{len(node.members)} tensordicts, the target is a {kind_name(target)}. "
                    "tensordict would silently load nothing into it; use tdckpt.load_memmap "
                    "to get a new LazyStackedTensorDict.",
                    key=node.key,
                )
            members = target.tensordicts
            if len(members) != len(node.members):
                raise RestoreError(
                    f"{self.where(node)}: cannot load {len(node.members)} stacked tensordicts "
                    f"into a stack of {len(members)} (tensordict refuses it too); nothing was "
                    f"changed. Restore into a stack of {len(node.members)}, or use "
                    "tdckpt.load_memmap to get a new one.",
                    key=node.key,
                )
            if target.stack_dim != node.stack_dim:
                raise RestoreError(
                    f"{self.where(node)}: the checkpoint stacks its {len(node.members)} "
                    f"tensordicts along dim {node.stack_dim}, the target's lazy stack along dim "
                    f"{target.stack_dim}; nothing was changed. Restore into a stack along dim "
                    f"{node.stack_dim}, or use tdckpt.load_memmap to get a new one.",
                    key=node.key,
                )
            for member, sub in zip(members, node.members, strict=True):
                self.into(member, sub)
            return
        if isinstance(node, TensorDictNode):
            if isinstance(target, dict):
                self._into_dict(target, node, claimed=True)
                return
            if not is_td(target) or is_lazy_stack(target):
                raise RestoreError(
                    f"{self.where(node)}: the checkpoint holds a TensorDict, the target is a "
                    f"{kind_name(target)}.",
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
            f"loaded in place into a {kind_name(target)}{fix} nothing was changed. Use "
            "tdckpt.load_memmap to get a new object.",
            key=node.key,
        )

    # -- view targets: a _SubTensorDict or a lazy view of a parent tensordict ---------------

    def _view_refusal(self, target: Any, node: Node, why: str, fix: str) -> RestoreError:
        return RestoreError(
            f"{self.where(node)}: cannot load {_node_what(node)} in place into the "
            f"{kind_name(target)} target (a view of a {kind_name(target._source)}): {why}; "
            f"nothing was changed. {fix}",
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
            if not is_memmap(parent):
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
            if view_kind(parent) is None:
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
        types = tensordict_types()
        assert types is not None
        chain = [target]  # a sub-tensordict of a sub-tensordict writes through both
        while kind == "sub" and view_kind(parent) == "sub":
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
            shape = tuple(value.batch_size if is_td(value) else value.shape)
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

    def _kept_below(self, value: Any, keep: Any) -> Any:
        """A target's entry the checkpoint's selected part does not hold, though a pattern
        reaches below it: it stays, less the selected keys below it (the checkpoint lacks
        them). Anything but a plain TensorDict stays whole: nothing below it is dropped."""
        if not is_td(value) or is_lazy_stack(value) or view_kind(value) is not None:
            return value
        items: dict[str, Any] = {}
        for name, child in value._tensordict.items():
            verdict = keep(name)
            if verdict == KEEP:
                items[name] = child
            elif verdict == BELOW:
                items[name] = self._kept_below(child, keep.child(name))
        if len(items) != len(value._tensordict):
            self.plan.items.append((value._tensordict, items))
        return value

    def _batch_error(self, sub: Node, shape: tuple[int, ...], batch: tuple[int, ...]) -> None:
        raise RestoreError(
            _batch_error_message(self.where(sub), sub, shape, batch),
            key=sub.key,
            expected=list(batch),
            found=list(shape),
        )

    def _wrapper_refusal(self, target: Any, node: TensorDictNode) -> str:
        """Why a tensordict that wraps another (TensorDictParams) cannot be restored into."""
        fix = (
            "its leaves are parameters, which a restore would replace by plain tensors. Load "
            "the values and copy them in: `params.data.update_(tdckpt.load_memmap(prefix))`"
            if type(target).__name__ == "TensorDictParams"
            else "load it with tdckpt.load_memmap and copy the values in (`td.update_(...)`)"
        )
        return (
            f"{self.where(node)}: the target is a {kind_name(target)}, a wrapper that holds no "
            f"entries of its own, so nothing can be restored into it in place: {fix}. Nothing "
            "was changed."
        )

    def _level_device(self, node: TensorDictNode) -> torch.device | None:
        """The device a non-tensor new to a level takes: the target's (its leaves are moved
        there), else the saved level's when it is the CPU's (tensordict's loader gives a
        NonTensorData its tensordict's device)."""
        if self.mapper.device is not None:
            return self.mapper.device
        saved = node.device
        return torch.device("cpu") if saved is not None and saved.startswith("cpu") else None

    def _name_new(self, value: Any, sub: Node, names: list[str | None]) -> None:
        """Give a level new to a named target the target's names for the dims they share, as
        tensordict's ``set`` does; refuse saved names that disagree (tensordict refuses
        them too: a parent and a child naming one dim differently)."""
        inner = value._tensordict if is_tensorclass(value) else value
        if not is_td(inner) or is_lazy_stack(inner) or not hasattr(inner, "_tensordict"):
            return
        nb = len(names)
        own = list(inner.names)
        clash = [
            i
            for i in range(min(nb, len(own)))
            if own[i] is not None and names[i] is not None and own[i] != names[i]
        ]
        if clash:
            i = clash[0]
            raise RestoreError(
                f"{self.where(sub)}: the saved level {'.'.join(sub.key)!r} names dim {i} "
                f"{own[i]!r}, the target names it {names[i]!r}; nothing was changed (tensordict "
                "refuses it too). Rename the target's dims to the saved ones "
                f"(`td.rename_(*{own[:nb]!r})`), or use tdckpt.load_memmap.",
                key=sub.key,
            )
        merged = [n if n is not None else own[i] for i, n in enumerate(names)] + own[nb:]
        if merged != own:
            inner.names = merged

    def _into_td(self, target: Any, node: TensorDictNode) -> None:
        if not hasattr(target, "_tensordict"):
            raise RestoreError(self._wrapper_refusal(target, node), key=node.key)
        if target.is_locked and not target.is_memmap():
            raise RestoreError(
                f"{self.where(node)}: the target tensordict is locked (and not memory-mapped), "
                "so it cannot take new values. Call `td.unlock_()` first.",
                key=node.key,
            )
        if target.is_locked and not self.root_locked:
            # Locked on its own (td["n"].memmap_() locks "n" only): tensordict refuses to
            # load into it, and the commit, which unlocks and relocks a locked root, would
            # write through its lock.
            at = ".".join(node.key) or "<root>"
            raise RestoreError(
                f"{self.where(node)}: the target's tensordict at {at!r} is locked (memory-mapped "
                "on its own) while the target's root is not, so it cannot take new values "
                "(tensordict refuses it too); nothing was changed. Unlock it first "
                f"(`td[{at!r}].unlock_()`), or memory-map the whole target (`td.memmap_()`).",
                key=node.key,
            )
        batch = tuple(target.batch_size)
        nb = len(batch)
        names = list(target.names) if target._has_names() else None
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
                    and is_td(existing)
                    and not is_lazy_stack(existing)
                )
                or (
                    isinstance(sub, TensorClassNode)
                    and is_tensorclass(existing)
                    and str(type(existing)) == sub.type_str
                )
                # (a nested lazy stack of another count or stack dim cannot take the saved
                # one: it is replaced, as a leaf of another shape is)
                or (
                    isinstance(sub, LazyStackNode)
                    and is_lazy_stack(existing)
                    and len(existing.tensordicts) == len(sub.members)
                    and existing.stack_dim == sub.stack_dim
                )
            )
            if reuse:
                self.into(existing, sub)
                value = existing
            elif isinstance(sub, SubTensorDictNode) and view_kind(existing) == "sub":
                # tensordict loads a saved sub-tensordict into the one the target holds:
                # through it, into its source
                self.into(existing, sub)
                value = existing
            elif (
                isinstance(sub, LazyViewNode)
                and existing is not None
                and is_td(existing)
                and not is_lazy_stack(existing)
                and view_kind(existing) is None
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
                and is_non_tensor_data(existing)
                and type(existing).__name__ == sub.class_name
            ):
                self.claim(existing, sub)
                value_, fields = non_tensor_value(sub, self.opened.storage, self.unpickle)
                new_fields = {"data": value_, **fields, "_is_non_tensor": True}
                self.plan.fields.append((existing, new_fields))
                value = existing
            else:
                value = self.builder.build(sub, node.batch_size, self._level_device(node))
                if not isinstance(sub, NonTensorNode):
                    self.plan.non_tensors.extend(_built_non_tensors(value, sub))
                    if names is not None:
                        self._name_new(value, sub, names)
            vb = value_batch(value) if not isinstance(sub, NonTensorNode) else tuple(sub.batch_size)
            if vb is not None and vb[:nb] != batch:
                self._batch_error(sub, vb, batch)
            if isinstance(sub, NonTensorNode):
                self.plan.non_tensors.append((value, sub.path))
            new[key] = value
        mapped = dict(zip(leaf_keys, self.mapper.leaves(leaves), strict=True))
        if node.keep is not None:  # a selective restore: what it does not select stays
            for name, value in target._tensordict.items():
                if name in mapped or name in new:
                    continue
                verdict = node.keep(name)
                if verdict == KEEP:
                    new[name] = value
                elif verdict == BELOW:
                    new[name] = self._kept_below(value, node.keep.child(name))
        self.plan.items.append(
            (target._tensordict, tensordict_order(target._tensordict, mapped, new))
        )
        self.plan.prefixes.append((target, self.mapper.dir_path(node.path)))
        self.plan.levels.append(target)


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


def _built_non_tensors(value: Any, node: Node) -> list[tuple[Any, str]]:
    """The NonTensorData objects inside a newly built ``value``, with their directories."""
    if isinstance(node, NonTensorNode):
        return [(value, node.path)] if is_non_tensor_data(value) else []
    if isinstance(node, TensorClassNode) and is_tensorclass(value):
        return _built_non_tensors(value._tensordict, node.inner)
    if isinstance(node, LazyStackNode) and is_lazy_stack(value):
        pairs = zip(value.tensordicts, node.members, strict=False)
        return [nt for member, sub in pairs for nt in _built_non_tensors(member, sub)]
    if isinstance(node, TensorDictNode) and is_td(value) and not is_lazy_stack(value):
        return [
            nt
            for key, sub in node.entries.items()
            if key in value._tensordict
            for nt in _built_non_tensors(value._tensordict[key], sub)
        ]
    return []
