"""The metadata of a consolidated file, checked and laid out as the current directory tree.

:func:`parse_consolidated` takes the parsed JSON of a file written by tensordict's
``consolidate(filename=...)`` (see :mod:`tdckpt._read.consolidated` for the layout) and the
number of leaf bytes before it, checks every level and every leaf (dtype, shape, byte range
inside the leaves, exact size, alignment, no overlap), and returns the virtual directory
tree the rest of the read path reads (one ``meta.json`` per level, built on demand) - plus,
for files of TensorDict levels and dense leaves, the validated node tree itself, built in
the same pass. Leaf entries are checked column by column where they are all as tensordict
writes them: a 10,000-leaf file is the large one.
"""

from __future__ import annotations

import copy
import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tdckpt._keys import LEAF_SUFFIX, encode_key
from tdckpt._read.consolidated_leaves import MAX_NDIM, LeafEntries
from tdckpt._read.nodes import LeafNode, TensorDictNode
from tdckpt._read.tree import VFile
from tdckpt.errors import MetadataError, UnsupportedFormatError

__all__ = [
    "MAX_DEPTH",
    "MAX_LEVELS",
    "RESERVED",
    "LeafExtent",
    "Level",
    "Parsed",
    "Run",
    "parse_consolidated",
]

#: Levels nest at most this deep (as ``tree.MAX_DEPTH`` for directories).
MAX_DEPTH = 200
#: Levels, leaves and non-tensor entries together, at most (as ``tree.MAX_ENTRIES``).
MAX_LEVELS = 1_000_000
_ITEMSIZE = operator.attrgetter("itemsize")

#: The fields of a level; every other key of a level's object is a sub-level.
RESERVED = frozenset({"cls", "non_tensors", "leaves", "cls_metadata", "size"})

_TD_TYPE = "<class 'tensordict._td.TensorDict'>"
_LAZY_TYPE = "<class 'tensordict._lazy.LazyStackedTensorDict'>"
_NTD_TYPE = "<class 'tensordict.tensorclass.NonTensorData'>"
_NTS_TYPE = "<class 'tensordict.tensorclass.NonTensorStack'>"


@dataclass
class _TDSpec:
    """A TensorDict level as the file records it; its meta.json is built when read."""

    batch: list[int]
    device: str | None
    names: list[str | None] | None
    #: the file's (checked) leaf entries: key -> [dtype, shape, start, stop, pad(, ...)]
    leaves: dict[str, list[Any]]
    #: (key, entry type) of non-tensors and sub-levels, in file order
    others: list[tuple[str, str]] = field(default_factory=list)

    def meta(self) -> dict[str, Any]:
        leaf_device = self.device if self.device is not None else "cpu"
        meta: dict[str, Any] = {
            name: {
                "device": leaf_device,
                "shape": list(spec[1]),
                "dtype": spec[0],
                "is_nested": False,
            }
            for name, spec in self.leaves.items()
        }
        for name, type_ in self.others:
            meta[name] = {"type": type_}
        meta["shape"] = list(self.batch)
        meta["device"] = self.device
        meta["_type"] = _TD_TYPE
        meta["_format_version"] = 1
        meta["_class"] = "tensordict:TensorDict"
        if self.names is not None and any(n is not None for n in self.names):
            meta["_names"] = list(self.names)
        return meta


@dataclass
class Level:
    """One directory of the virtual tree: its meta.json (ready, or built from ``td``)."""

    meta: dict[str, Any] | None = None
    td: _TDSpec | None = None
    #: (file names, sizes) of the level's leaves, in order; :meth:`files` builds the table
    #: when the virtual tree is listed (a restore from the parse's node tree never does)
    leaf_files: tuple[Sequence[str], Sequence[int]] = ((), ())
    dirs: list[str] = field(default_factory=list)

    def files(self) -> dict[str, int]:
        """File name -> size of each leaf of the level."""
        return dict(zip(*self.leaf_files, strict=True))

    def meta_json(self) -> dict[str, Any]:
        if self.td is not None:
            return self.td.meta()
        assert self.meta is not None
        return copy.deepcopy(self.meta)  # non-tensor data may be edited by its reader


@dataclass(frozen=True, slots=True)
class Run:
    """A level whose dense leaves are one run: one dtype and shape, each ``step`` bytes after
    the one before from ``start`` (tensordict writes a level of like leaves so, each padded
    to 8 bytes). ``nodes`` are the level's leaf nodes built by the parse, in file order."""

    nodes: list[LeafNode]
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    step: int


@dataclass
class Parsed:
    """A consolidated file's metadata, checked and laid out as the current directory tree.

    ``levels`` maps a relative directory path (``""`` is the top) to its level; ``leaves``
    maps a leaf's relative file path to ``(start, nbytes)`` in the leaf region. ``root``
    is the validated node tree when every level is a TensorDict of dense leaves (what
    ``validate.build_nodes`` builds from the virtual tree, built in the same pass), else
    None.
    """

    levels: dict[str, Level]
    #: (relative paths, starts, sizes) of each level's leaves, what ``leaves`` is built from
    leaf_columns: list[tuple[list[str], list[int], list[int]]]
    data_size: int
    root: TensorDictNode | None
    #: the metadata as parsed (checked)
    raw: dict[str, Any]
    #: id of a run's first node -> the run (levels of the node tree that are one run)
    runs: dict[int, Run] = field(default_factory=dict)

    @functools.cached_property
    def leaves(self) -> dict[str, tuple[int, int]]:
        """Relative leaf path -> ``(start, nbytes)``, built on first use (a restore from the
        validated node tree reads each leaf's range from its :class:`LeafExtent`)."""
        table: dict[str, tuple[int, int]] = {}
        for paths, starts, sizes in self.leaf_columns:
            table.update(zip(paths, zip(starts, sizes, strict=True), strict=True))
        return table


@dataclass(eq=False, slots=True)
class LeafExtent(VFile):
    """The file of a leaf of the node tree built while parsing: its bytes start at ``start``
    in the leaf region (``size`` of them, ``source`` its relative path)."""

    start: int = 0

    def __eq__(self, other: object) -> bool:
        # The same file as a VFile of the same fields (what validation builds): ``start``
        # says where its bytes lie, not which file it is.
        if not isinstance(other, VFile):
            return NotImplemented
        return (self.source, self.size, self.data) == (other.source, other.size, other.data)

    __hash__ = None  # type: ignore[assignment]  # as VFile's: mutable, compared by value


def _error(
    where: str, key: str, what: str, cls: type[MetadataError] = MetadataError
) -> MetadataError:
    """The error for ``what`` at ``key`` of the file ``where``: damage (MetadataError), or
    content tdckpt does not restore (UnsupportedFormatError, whose ``what`` says what to do)."""
    shown = f"{where} (key {key!r})" if key else where
    tail = (
        "A file written by tensordict's consolidate(filename=...) never holds this: it "
        "is damaged, truncated or hostile. Re-create it from the original tensordict."
        if cls is MetadataError
        else "Nothing was restored."
    )
    return cls(f"{shown}: {what}. {tail}", path=where, key=key)


def parse_consolidated(raw: Any, data_size: int, where: str) -> Parsed:
    """Check the parsed metadata ``raw`` of a file with ``data_size`` bytes of leaves.

    Raises:
        MetadataError: anything a file written by tensordict never holds.
        UnsupportedFormatError: content tensordict writes that tdckpt cannot restore yet
            (nested jagged tensors), or a class no release can load back.
    """
    return _Parser(data_size, where).parse(raw)


class _Parser:
    def __init__(self, data_size: int, where: str) -> None:
        self.data_size = data_size
        self.where = where
        self.levels: dict[str, Level] = {}
        self.leaf_columns: list[tuple[list[str], list[int], list[int]]] = []
        #: every level's leaf entries, checked as they come (byte ranges kept for the
        #: overlap check once every level is in)
        # (a function of ``where``, not the bound ``self.fail``: a cycle between the two
        # would keep the whole parse - every node - alive until the collector runs)
        self.entries = LeafEntries(data_size, functools.partial(_error, where))
        self.count = 0
        #: whether the nodes built along the way are the whole validated tree
        self.simple = True
        self.runs: dict[int, Run] = {}

    def fail(self, key: str, what: str, cls: type[MetadataError] = MetadataError) -> MetadataError:
        """The error for ``what`` at ``key`` (:func:`_error`)."""
        return _error(self.where, key, what, cls)

    def parse(self, raw: Any) -> Parsed:
        _type, root = self.level(raw, "", (), 0)
        self.entries.check_overlaps()
        return Parsed(
            self.levels,
            self.leaf_columns,
            self.data_size,
            root if self.simple and isinstance(root, TensorDictNode) else None,
            raw,
            self.runs if self.simple else {},
        )

    # -- levels ----------------------------------------------------------------------
    def level(
        self, raw: Any, rel: str, key: tuple[str, ...], depth: int
    ) -> tuple[str, TensorDictNode | None]:
        """Lay out the level ``raw`` at directory ``rel``: its entry type name, and its node
        when it is a TensorDict level (while the tree stays simple)."""
        shown = "/".join(key)
        if depth > MAX_DEPTH:
            raise self.fail(shown, f"levels nest more than {MAX_DEPTH} deep")
        if type(raw) is not dict:
            raise self.fail(shown, f"a level is a JSON object, found {type(raw).__name__}")
        for name in ("cls", "non_tensors", "leaves", "cls_metadata"):
            if name not in raw:
                raise self.fail(shown, f"the level has no {name!r} field")
        cls, non_tensors, leaves, cls_meta = (
            raw["cls"],
            raw["non_tensors"],
            raw["leaves"],
            raw["cls_metadata"],
        )
        if type(cls) is not str:
            raise self.fail(shown, f"'cls' is {type(cls).__name__}, expected a class name")
        for name, value in (
            ("non_tensors", non_tensors),
            ("leaves", leaves),
            ("cls_metadata", cls_meta),
        ):
            if type(value) is not dict:
                raise self.fail(shown, f"{name!r} is {type(value).__name__}, expected an object")
        children = {k: v for k, v in raw.items() if k not in RESERVED}
        self.count += 1 + len(non_tensors) + len(leaves)
        if self.count > MAX_LEVELS:
            raise self.fail(shown, f"more than {MAX_LEVELS} levels and entries")
        if non_tensors or children:
            for name in leaves:
                if name in non_tensors or name in children:
                    raise self.fail(
                        "/".join((*key, name)), "the key is both a tensor and another entry"
                    )
            for name in non_tensors:
                if name in children:
                    raise self.fail(
                        "/".join((*key, name)), "the key is both a non-tensor and a sub-level"
                    )
        if cls == "TensorDict":
            node = self.td_level(rel, key, cls_meta, non_tensors, leaves, children, depth)
            return "TensorDict", node
        self.simple = False
        if cls == "LazyStackedTensorDict":
            return self.lazy_stack(rel, key, cls_meta, non_tensors, leaves, children, depth), None
        if cls == "NonTensorStack":
            return self.nt_stack(rel, key, cls_meta, non_tensors, leaves, children), None
        if cls.startswith("<class '") and cls.endswith("'>") and "." in cls:
            # A tensorclass: its own level names the class, its tensordict is "_tensordict".
            self.levels[rel] = Level({"_type": cls}, dirs=["_tensordict"])
            inner = f"{rel}/_tensordict" if rel else "_tensordict"
            self.td_level(inner, key, cls_meta, non_tensors, leaves, children, depth + 1)
            return cls[len("<class '") : -2].rpartition(".")[2], None
        raise self.fail(
            shown,
            f"the class {cls!r} is not one tdckpt can restore (TensorDict, "
            "LazyStackedTensorDict, NonTensorStack, or a tensorclass recorded as "
            "\"<class 'module.Name'>\" by tensordict >= 0.15; tensordict 0.5 - 0.7 recorded "
            "a tensorclass by its bare name, which no release can load back). Re-save the "
            "data with a current tensordict, or with tdckpt.save",
            UnsupportedFormatError,
        )

    def batch(
        self, shown: str, cls_meta: dict[str, Any]
    ) -> tuple[list[int], str | None, list[str | None] | None]:
        batch = cls_meta.get("batch_size")
        if type(batch) is not list or len(batch) > MAX_NDIM:
            raise self.fail(shown, "'cls_metadata.batch_size' is not a list of sizes")
        for d in batch:
            if type(d) is not int or d < 0:
                raise self.fail(shown, f"the batch size {batch!r} holds {d!r}")
        device = cls_meta.get("device")
        if device is not None and type(device) is not str:
            raise self.fail(shown, f"the device {device!r} is not a string")
        names = cls_meta.get("names")
        if names is not None and (
            type(names) is not list or any(n is not None and type(n) is not str for n in names)
        ):
            raise self.fail(shown, f"the names {names!r} are not a list of strings")
        return batch, device, names

    def td_level(
        self,
        rel: str,
        key: tuple[str, ...],
        cls_meta: dict[str, Any],
        non_tensors: dict[str, Any],
        leaves: dict[str, Any],
        children: dict[str, Any],
        depth: int,
    ) -> TensorDictNode | None:
        shown = "/".join(key)
        batch, device, names = self.batch(shown, cls_meta)
        spec = _TDSpec(batch, device, names, leaves)
        level = Level(td=spec)
        self.levels[rel] = level
        prefix = f"{rel}/" if rel else ""
        named = names is not None and any(n is not None for n in names)
        batch_t = tuple(batch)
        nb = len(batch_t)
        # The node validation would build, while the tree stays simple (TensorDict levels of
        # dense leaves on the CPU, nothing validation would report).
        simple = self.simple and not non_tensors and device in (None, "cpu")
        if named and names is not None and len(names) != nb:
            simple = False
        node = (
            TensorDictNode(
                key=key,
                path=rel,
                class_id="tensordict:TensorDict",
                batch_size=batch_t,
                device=device,
                names=list(names) if named and names is not None else None,
            )
            if simple
            else None
        )
        leaf_device = device if device is not None else "cpu"
        entries = node.entries if node is not None else None
        dtypes, sizes, starts, shapes = self.entries.check(key, leaves)
        leaf_keys = list(leaves)
        # Per-leaf names, keys and files built by C-level maps (the large level is 10,000
        # leaves): a name that is an identifier is its own file name.
        repeat = itertools.repeat
        if all(map(str.isidentifier, leaf_keys)):
            files = list(map(operator.add, leaf_keys, repeat(LEAF_SUFFIX)))
        else:
            files = [
                n + LEAF_SUFFIX if n.isidentifier() else encode_key(n) + LEAF_SUFFIX
                for n in leaf_keys
            ]
        paths = list(map(operator.add, repeat(prefix), files)) if prefix else files
        level.leaf_files = (files, sizes)
        self.leaf_columns.append((paths, starts, sizes))
        if entries is not None and node is not None:
            shapes_t = shapes  # tuples
            if nb and any(s[:nb] != batch_t for s in _distinct(shapes_t)):
                node = None  # a leaf that does not start with the batch size: validation says
            else:
                vfiles = (
                    list(map(LeafExtent, paths, sizes, repeat(None), starts))
                    if all(sizes)
                    else [
                        LeafExtent(p, n, None, start) if n else None
                        for p, n, start in zip(paths, sizes, starts, strict=True)
                    ]
                )
                leaf_nodes = list(
                    map(
                        LeafNode,
                        list(zip(*map(repeat, key), leaf_keys, strict=False)),  # (*key, name)
                        paths,
                        dtypes,
                        shapes_t,
                        repeat(leaf_device),
                        repeat(False),
                        vfiles,
                        repeat(None),
                        _numels(dtypes, sizes),
                    )
                )
                entries.update(zip(leaf_keys, leaf_nodes, strict=True))
                run = _one_run(leaf_nodes, dtypes, shapes_t, starts, sizes)
                if run is not None:
                    self.runs[id(leaf_nodes[0])] = run
        for name, entry in non_tensors.items():
            data = self.non_tensor(entry, (*key, name))
            dname = encode_key(name)
            level.dirs.append(dname)
            self.levels[prefix + dname] = Level(
                {"_type": _NTD_TYPE, "data": data, "_metadata": None, "_is_non_tensor": True}
            )
            spec.others.append((name, "NonTensorData"))
        for name, child in children.items():
            dname = encode_key(name)
            level.dirs.append(dname)
            type_, child_node = self.level(child, prefix + dname, (*key, name), depth + 1)
            spec.others.append((name, type_))
            if entries is not None and node is not None:
                if child_node is None or child_node.batch_size[:nb] != batch_t:
                    entries = None
                    node = None
                else:
                    entries[name] = child_node
        if node is None:
            self.simple = False
        return node

    def lazy_stack(
        self,
        rel: str,
        key: tuple[str, ...],
        cls_meta: dict[str, Any],
        non_tensors: dict[str, Any],
        leaves: dict[str, Any],
        children: dict[str, Any],
        depth: int,
    ) -> str:
        shown = "/".join(key)
        if leaves or non_tensors:
            raise self.fail(shown, "a lazy stack holds entries of its own, not only its members")
        if list(children) != [str(i) for i in range(len(children))]:
            raise self.fail(shown, "the members of a lazy stack are not keyed '0', '1', ...")
        stack_dim = cls_meta.get("stack_dim")
        dim_name = cls_meta.get("stack_dim_name")
        if type(stack_dim) is not int or (dim_name is not None and type(dim_name) is not str):
            raise self.fail(shown, "the lazy stack's 'stack_dim' is not an int")
        self.levels[rel] = Level(
            {
                "_type": _LAZY_TYPE,
                "_format_version": 1,
                "_class": "tensordict:LazyStackedTensorDict",
                "stack_dim": stack_dim,
                "stack_dim_name": dim_name,
            },
            dirs=list(children),
        )
        prefix = f"{rel}/" if rel else ""
        for name, child in children.items():
            self.level(child, prefix + name, (*key, name), depth + 1)
        return "LazyStackedTensorDict"

    def nt_stack(
        self,
        rel: str,
        key: tuple[str, ...],
        cls_meta: dict[str, Any],
        non_tensors: dict[str, Any],
        leaves: dict[str, Any],
        children: dict[str, Any],
    ) -> str:
        shown = "/".join(key)
        if leaves or children:
            raise self.fail(shown, "a non-tensor stack holds tensors or sub-levels")
        if list(non_tensors) != [str(i) for i in range(len(non_tensors))]:
            raise self.fail(shown, "the members of a non-tensor stack are not keyed '0', '1', ...")
        stack_dim = cls_meta.get("stack_dim")
        if type(stack_dim) is not int:
            raise self.fail(shown, "the non-tensor stack's 'stack_dim' is not an int")
        data = [self.non_tensor(v, (*key, k)) for k, v in non_tensors.items()]
        self.levels[rel] = Level(
            {
                "_type": _NTS_TYPE,
                "_format_version": 1,
                "_class": "tensordict:NonTensorStack",
                "stack_dim": stack_dim,
                "device": None,
                "data": data,
            }
        )
        return "NonTensorStack"

    # -- entries ---------------------------------------------------------------------
    def non_tensor(self, entry: Any, full: tuple[str, ...]) -> Any:
        # [data, batch_size, device] (0.8+) or [data, batch_size] (0.5 - 0.7)
        if type(entry) is not list or len(entry) not in (2, 3) or type(entry[1]) is not list:
            raise self.fail(
                "/".join(full), "a non-tensor entry is not [data, batch_size(, device)]"
            )
        return entry[0]


def _one_run(
    nodes: list[LeafNode],
    dtypes: list[torch.dtype],
    shapes: list[tuple[int, ...]],
    starts: list[int],
    sizes: list[int],
) -> Run | None:
    """The run the level's leaves ``nodes`` make, if they make one: at least two, one dtype,
    one shape, bytes of their own, evenly spaced in file order (each at least its size after
    the one before, aligned for the dtype). Checked column by column in C."""
    count = len(nodes)
    if count < 2:
        return None
    dtype, shape, size = dtypes[0], shapes[0], sizes[0]
    # (count() compares by identity first: a level of one dtype and shape shares the objects)
    if dtypes.count(dtype) != count or shapes.count(shape) != count or not size:
        return None
    start = starts[0]
    step = starts[1] - start
    if step < size or step % dtype.itemsize or sizes.count(size) != count:
        return None
    if starts != list(range(start, start + step * count, step)):
        return None
    return Run(nodes, dtype, shape, start, step)


def _distinct(values: list[Any]) -> list[Any] | set[Any]:
    """The distinct values of ``values``: the first alone when every one is it (a level of
    one shape shares one tuple, which ``count`` finds by identity without hashing)."""
    if values and values.count(values[0]) == len(values):
        return [values[0]]
    return set(values)


def _numels(dtypes: list[torch.dtype], sizes: list[int]) -> list[int]:
    """Elements of each leaf: its bytes over its dtype's size (one division for a level of
    one dtype and size)."""
    if dtypes and dtypes.count(dtypes[0]) == len(dtypes) and sizes.count(sizes[0]) == len(sizes):
        return [sizes[0] // dtypes[0].itemsize] * len(sizes)
    return list(map(operator.floordiv, sizes, map(_ITEMSIZE, dtypes)))
