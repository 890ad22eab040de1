"""The validated checkpoint: a typed tree of what each level holds.

Validation (``validate.py``) turns the current-form virtual tree into these nodes, and
the planner and the restore engine consume them. Nodes carry no tensor data: leaves
point at their files, non-tensor values are either inline JSON data or a pickle file
that has not been read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tdckpt._read.tree import VFile

__all__ = [
    "DTYPES",
    "LazyStackNode",
    "LazyViewNode",
    "LeafNode",
    "Node",
    "NonTensorNode",
    "NonTensorStackNode",
    "SubTensorDictNode",
    "TensorClassNode",
    "TensorDictNode",
]


def _dtype_table() -> dict[str, torch.dtype]:
    table = {}
    for name in dir(torch):
        value = getattr(torch, name)
        if not isinstance(value, torch.dtype) or value.is_complex is None:
            continue
        text = str(value)
        # Quantized dtypes cannot be mapped from a file; the sub-byte int1..int7 /
        # uint1..uint7 are placeholders without a storage layout of their own.
        short = text.removeprefix("torch.")
        if short.startswith(("qint", "quint")) or (
            short[:-1] in ("int", "uint") and short[-1] in "1234567"
        ):
            continue
        table[text] = value
    return table


#: dtype string as written in meta.json -> torch dtype (float8 and uint16-64 included:
#: tensordict writes them; 0.15.3's own reader cannot read float8 back, tdckpt can).
DTYPES: dict[str, torch.dtype] = _dtype_table()


@dataclass(slots=True)
class LeafNode:
    """A tensor leaf. ``shape`` is the tensor's shape (for a nested tensor: its size table's)."""

    key: tuple[str, ...]
    path: str  # the data file, relative to the prefix (for messages)
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str | None
    is_nested: bool
    file: VFile | None  # None: a zero-element leaf that has no file
    shape_file: VFile | None = None
    numel: int = 0  # elements of the data file to map
    sizes: torch.Tensor | None = None  # nested: the per-element size table (read at validation)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class TensorDictNode:
    key: tuple[str, ...]
    path: str
    class_id: str
    batch_size: tuple[int, ...]
    device: str | None
    names: list[str | None] | None
    entries: dict[str, Node] = field(default_factory=dict)
    #: A selective restore in place: ``keep(name)`` says what becomes of a target's entry
    #: this level does not hold - ``"keep"`` (outside the selection: it stays as it is),
    #: ``"drop"`` (selected, and the checkpoint lacks it) or ``"below"`` (it stays, less the
    #: selected keys below it: ``keep.child(name)`` judges those); None: a whole restore.
    keep: Any = field(default=None, compare=False, repr=False)


@dataclass
class LazyStackNode:
    key: tuple[str, ...]
    path: str
    class_id: str
    stack_dim: int
    stack_dim_name: str | None
    members: list[Node] = field(default_factory=list)


@dataclass
class NonTensorNode:
    """A NonTensorData / MetaData value: inline JSON ``data``, or pickled in ``pickle``."""

    key: tuple[str, ...]
    path: str
    class_name: str  # "NonTensorData" | "MetaData"
    batch_size: tuple[int, ...]
    device: str | None
    data: Any = None
    has_data: bool = False
    metadata: Any = None
    pickle: VFile | None = None
    json_types: dict[str, str] | None = None  # from json_types.json, when it matches


@dataclass
class NonTensorStackNode:
    key: tuple[str, ...]
    path: str
    stack_dim: int
    device: str | None
    data: list[Any] | None = None
    pickle: VFile | None = None


@dataclass
class TensorClassNode:
    key: tuple[str, ...]
    path: str
    type_str: str  # "<class 'module.Name'>"
    fields: dict[str, Any]
    inner: TensorDictNode
    pickle: VFile | None = None


@dataclass
class SubTensorDictNode:
    """A saved ``_SubTensorDict``: ``index`` (decoded as tensordict decodes it) over ``source``.

    ``index`` holds only ints, None, Ellipsis, slices, ranges, lists of ints/bools and CPU
    index tensors; ``batch_size`` is the batch size of the view.
    """

    key: tuple[str, ...]
    path: str
    class_id: str
    index_json: Any
    index: Any
    batch_size: tuple[int, ...]
    source: Node


@dataclass
class LazyViewNode:
    """A saved lazy view (``_UnsqueezedTensorDict``, ...): ``op(**kwargs)`` over ``source``."""

    key: tuple[str, ...]
    path: str
    class_id: str
    op: str
    kwargs: dict[str, Any]
    inv_op: str | None
    inv_kwargs: dict[str, Any]
    batch_size: tuple[int, ...]
    device: str | None
    source: Node


Node = (
    TensorDictNode
    | LazyStackNode
    | NonTensorNode
    | NonTensorStackNode
    | TensorClassNode
    | LeafNode
    | SubTensorDictNode
    | LazyViewNode
)


#: The nodes that may hold a pickled value.
PickledNode = NonTensorNode | NonTensorStackNode | TensorClassNode


def pickled_nodes(node: Node) -> list[PickledNode]:
    """Every node of the tree whose value needs unpickling, in tree order."""
    out: list[PickledNode] = []
    stack: list[Node] = [node]
    while stack:
        cur = stack.pop()
        if type(cur) is LeafNode:  # most nodes: nothing to unpickle, nothing below
            continue
        if isinstance(cur, (NonTensorNode, NonTensorStackNode, TensorClassNode)) and cur.pickle:
            out.append(cur)
        if isinstance(cur, TensorDictNode):
            values = cur.entries.values()
            if set(map(type, values)) != {LeafNode}:  # leaves only: nothing below
                stack.extend(reversed(list(values)))
        elif isinstance(cur, LazyStackNode):
            stack.extend(reversed(cur.members))
        elif isinstance(cur, TensorClassNode):
            stack.append(cur.inner)
        elif isinstance(cur, (SubTensorDictNode, LazyViewNode)):
            stack.append(cur.source)
    return out
