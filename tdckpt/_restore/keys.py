"""The key structure of a restore, for ``CheckpointManager.restore_into(strict=True)``.

:func:`saved_structure` reads every nested key a restore of the validated node tree would
give, without mapping a leaf or unpickling a value; :func:`target_structure` reads the same
from the object a restore would load into. The strict check compares the two before the
restore starts, so a mismatch is refused with the target untouched and nothing mapped.

The rules, the same on both sides: every level's keys, nested levels walked (a lazy stack
member by member, its members keyed ``"0"``, ``"1"``...; a tensorclass through the
tensordict that holds its fields); tensors and non-tensor data are leaves. A sub-tensordict
or lazy view shows the keys that tensordict's view of its source shows: it is built over
structure-only stand-ins (``device="meta"`` tensors for its leaves and non-tensor data, a
tensorclass's own tensordict for the tensorclass) and walked as the target is.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

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
from tdckpt._restore.kinds import is_lazy_stack
from tdckpt._restore.plan import Mapper, has_tensordict

__all__ = [
    "Key",
    "SavedStructure",
    "key_difference",
    "report_difference",
    "saved_structure",
    "selected_difference",
    "show_keys",
    "structures_match",
    "target_structure",
]

Key = tuple[str, ...]


class SavedStructure:
    """What a restore of the checkpoint gives: its keys, and where values are opaque.

    ``opaque``: the keys of non-tensor data (a plain dict there in the target is a value).
    ``open``: levels whose other keys are only known by unpickling (without tensordict, a
    tensorclass with pickled fields): the target's extra keys there are not compared.
    """

    __slots__ = ("keys", "opaque", "open")

    def __init__(self, keys: set[Key], opaque: set[Key], open: set[Key]) -> None:
        self.keys = keys
        self.opaque = opaque
        self.open = open


def key_difference(saved: SavedStructure, target: set[Key]) -> tuple[list[Key], list[Key]]:
    """``(missing, unexpected)``: sorted keys in the target only, in the checkpoint only."""
    missing = target - saved.keys
    if saved.open:
        missing = {
            k
            for k in missing
            if not any(k[:j] in saved.open and k[: j + 1] not in saved.keys for j in range(len(k)))
        }
    return sorted(missing), sorted(saved.keys - target)


def report_difference(opened: OpenedCheckpoint, target: Any, report: Any, selection: Any) -> None:
    """Record an in-place restore's ``missing`` and ``unexpected`` keys into ``report``.

    ``opened.root`` is the selected part of the checkpoint (already pruned); the target's
    keys that ``selection`` does not concern stay as they are, so they are not missing.
    Each difference is listed by its leaves (a level the target lacks whole, by the keys
    below it), after the patterns of ``keys`` that selected nothing (``report.missing``).
    """
    missing, unexpected = selected_difference(opened, target, selection)
    assert opened.root is not None
    named = _Unstacked(target, opened.root)
    report.missing = list(dict.fromkeys([*report.missing, *map(named, _deepest(missing))]))
    report.unexpected = list(dict.fromkeys(map(named, _deepest(unexpected))))


def selected_difference(
    opened: OpenedCheckpoint, target: Any, selection: Any
) -> tuple[list[Key], list[Key]]:
    """``(missing, unexpected)`` of an in-place restore of ``selection`` (every level's key,
    lazy stacks member by member), the target's keys outside the selection left out.

    ``opened.root`` is the selected part of the checkpoint (already pruned). A pattern names
    the keys of a lazy stack's members without their index (as :mod:`.select` applies it):
    a key is compared with the selection without the member indices it passes through.
    """
    saved = saved_structure(opened)
    missing, unexpected = key_difference(saved, target_structure(target, opaque=saved.opaque))
    if selection is not None:
        assert opened.root is not None
        named = _Unstacked(target, opened.root)
        # a target key is missing when the selection selects it and the checkpoint lacks it
        # (one a pattern only reaches below stays as it is: its selected keys are listed)
        missing = [k for k in missing if selection.selects(named(k))]
    return missing, unexpected


class _Unstacked:
    """A structure key without the member indices of the lazy stacks it passes through.

    The key is walked down the target and the (pruned) node tree together: a key only the
    target has is placed by the target, one only the checkpoint has by its nodes.
    """

    def __init__(self, target: Any, root: Node) -> None:
        self.target = target
        self.root = root

    def __call__(self, key: Key) -> Key:
        out: list[str] = []
        obj: Any = self.target
        node: Node | None = self.root
        for name in key:
            if is_lazy_stack(obj) or isinstance(node, LazyStackNode):
                index = int(name) if name.isdigit() else -1  # a member: no name of its own
                obj, node = _member(obj, index), _node_member(node, index)
                continue
            out.append(name)
            obj, node = _child(obj, name), _node_child(node, name)
        return tuple(out)


def _member(obj: Any, index: int) -> Any:
    members = getattr(obj, "tensordicts", None)
    return members[index] if members is not None and 0 <= index < len(members) else None


def _child(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    inner = getattr(obj, "_tensordict", None)  # a tensorclass: the tensordict of its fields
    holder = inner if inner is not None and not isinstance(inner, dict) else obj
    try:
        return holder.get(name) if name in holder.keys() else None  # noqa: SIM118
    except Exception:  # not a level (a tensor, a value): nothing below it
        return None


def _node_member(node: Node | None, index: int) -> Node | None:
    if isinstance(node, LazyStackNode) and 0 <= index < len(node.members):
        return node.members[index]
    return None


def _node_child(node: Node | None, name: str) -> Node | None:
    if isinstance(node, TensorClassNode):
        node = node.inner
    if isinstance(node, TensorDictNode):
        return node.entries.get(name)
    return None


def _deepest(keys: list[Key]) -> list[Key]:
    """The keys of ``keys`` that no other key of it lies below (sorted order kept)."""
    above = {k[:i] for k in keys for i in range(1, len(k))}
    return [k for k in keys if k not in above]


def structures_match(root: Node, obj: Any) -> bool:
    """Whether ``obj`` certainly has the keys of ``root`` (:func:`saved_structure` and
    :func:`target_structure` would find no difference), compared level by level.

    The strict check's fast answer for the usual restore: TensorDict levels of tensors into
    TensorDicts of tensors, each level's keys compared as sets in one call, a level of
    leaves only checked in one pass. False at anything else (another kind of level or
    value, a key that differs): the full comparison then decides, and names the keys.
    """
    try:
        from tensordict import TensorDict
    except ImportError:
        return False
    tensor = torch.Tensor
    stack: list[tuple[Node, Any]] = [(root, obj)]
    while stack:
        node, value = stack.pop()
        if type(node) is not TensorDictNode or type(value) is not TensorDict:
            return False
        entries = node.entries
        items = value._tensordict
        if entries.keys() != items.keys():
            return False
        if set(map(type, entries.values())) == {LeafNode}:
            if not all(map(isinstance, items.values(), repeat(tensor))):
                return False
            continue
        for key, sub in entries.items():
            if type(sub) is LeafNode:
                if not isinstance(items[key], tensor):
                    return False
            else:
                stack.append((sub, items[key]))
    return True


def saved_structure(opened: OpenedCheckpoint) -> SavedStructure:
    """Every nested key of the validated checkpoint, as a restore of it holds them.

    Reads no leaf and unpickles nothing (a view is built over structure-only leaves, see
    ``build.StructureBuilder``).
    """
    root = opened.root
    assert root is not None
    with_td = has_tensordict()
    keys: set[Key] = set()
    opaque: set[Key] = set()
    open_: set[Key] = set()
    builder: list[Any] = []  # made on the first view

    def view_keys(node: Node, prefix: Key) -> None:
        if not builder:
            from tdckpt._restore.build import StructureBuilder

            meta = Mapper(opened.storage, "r", torch.device("meta"))
            builder.append(StructureBuilder(opened, meta, False))
        built = builder[0].build(node)
        keys.update(target_structure(built, prefix=prefix) - {prefix})

    # An explicit stack rather than recursion: a deep checkpoint is not a RecursionError.
    stack: list[tuple[Node, Key]] = [(root, ())]
    while stack:
        node, prefix = stack.pop()
        kind = type(node)
        if kind is LeafNode:
            continue
        if kind is TensorDictNode:
            children = node.entries.items()  # type: ignore[union-attr]
        elif kind is LazyStackNode:
            if not with_td:  # a plain list of members: a leaf for the walk
                continue
            children = ((str(i), m) for i, m in enumerate(node.members))  # type: ignore[union-attr]
        elif kind is TensorClassNode:
            assert isinstance(node, TensorClassNode)
            children = node.inner.entries.items()
            if not with_td:  # a plain dict: its tensordict's entries and its fields
                fields = {k: v for k, v in node.fields.items() if k not in node.inner.entries}
                for k in fields:
                    keys.add((*prefix, k))
                    opaque.add((*prefix, k))
                if node.pickle is not None:
                    # Fields in other.pickle: their names are only known once unpickled,
                    # which the check never does; the target's keys there are not compared.
                    open_.add(prefix)
        elif kind in (NonTensorNode, NonTensorStackNode):
            opaque.add(prefix)
            continue
        elif kind in (SubTensorDictNode, LazyViewNode):
            if with_td:
                view_keys(node, prefix)
            else:  # materialized as nested dicts: the keys of its source
                stack.append((node.source, prefix))  # type: ignore[union-attr]
            continue
        else:  # pragma: no cover - every node kind is handled above
            raise AssertionError(kind)
        for k, sub in children:
            key = (*prefix, k)
            keys.add(key)
            stack.append((sub, key))
    return SavedStructure(keys, opaque, open_)


def target_structure(
    obj: Any, *, opaque: set[Key] | frozenset[Key] = frozenset(), prefix: Key = ()
) -> set[Key]:
    """Every nested key of ``obj`` (inner levels and leaves), under ``prefix``.

    Tensors and non-tensor data are leaves; a tensorclass shows the keys of the tensordict
    that holds its fields. A plain dict at a key in ``opaque`` (where the checkpoint holds
    non-tensor data) is a value, not a level.
    """
    out: set[Key] = set()
    try:
        from tensordict import (
            LazyStackedTensorDict,
            TensorDict,
            is_leaf_nontensor,
            is_tensor_collection,
            is_tensorclass,
        )
    except ImportError:
        tensordict = False
    else:
        tensordict = True
    stack: list[tuple[Any, Key]] = [(obj, prefix)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, dict):
            if at in opaque:
                continue
            for k, v in node.items():
                key = (*at, str(k))
                out.add(key)
                stack.append((v, key))
            continue
        if not tensordict or not is_tensor_collection(node) or is_leaf_nontensor(type(node)):
            continue
        if is_tensorclass(node):
            node = node._tensordict  # its non-tensor fields are leaves, never unwrapped values
        if isinstance(node, LazyStackedTensorDict):
            # Member by member: members may hold different keys, and tensordict's own
            # nested key walk raises on such a stack.
            for i, member in enumerate(node.tensordicts):
                key = (*at, str(i))
                out.add(key)
                stack.append((member, key))
            continue
        items = (
            node._tensordict.items()
            if type(node) is TensorDict
            else ((k, node.get(k)) for k in node.keys())  # noqa: SIM118 - a tensordict, not a dict
        )
        for k, v in items:
            key = (*at, k)
            out.add(key)
            stack.append((v, key))
    return out


def show_keys(keys: list[tuple[str, ...]], limit: int = 10) -> str:
    """``keys`` as a message shows them: at most ``limit``, then how many more."""
    if not keys:
        return "none"
    shown = ", ".join(repr(k if len(k) > 1 else k[0]) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
