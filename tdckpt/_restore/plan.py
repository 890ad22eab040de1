"""The plan stage: validated nodes -> ready values (mapped tensors, non-tensor values).

Everything that reads bytes happens here, before the target is touched: leaves are mapped
(zero-copy; never read, never grown), pickles are loaded (only after the pickle policy
allowed them), and values are converted to the objects the target will hold.
The planner never writes.

Two back-ends build collections: tensordict's own classes when tensordict is installed,
plain nested ``dict`` objects otherwise (``_backend.py`` decides).
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from tdckpt._read.classes import declared_fields, resolve_class
from tdckpt._read.directory import DirectoryStorage
from tdckpt._read.nodes import LeafNode, NonTensorNode, NonTensorStackNode, TensorClassNode
from tdckpt._read.storage import MapMode, Storage
from tdckpt.errors import RestoreError, TdckptError

__all__ = [
    "Mapper",
    "check_tensorclass_fields",
    "has_tensordict",
    "load_pickled",
    "non_tensor_value",
    "nt_stack_value",
    "resolve_tensorclass",
    "tensorclass_fields",
]

_MAX_PICKLE_BYTES = 1024 * 1024 * 1024


@functools.cache
def has_tensordict() -> bool:
    """Whether tensordict is importable (then targets and results are real TensorDicts)."""
    try:
        import tensordict  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _memory_mapped_tensor() -> type[torch.Tensor] | None:
    """tensordict's MemoryMappedTensor class, or None without tensordict (cached)."""
    if not has_tensordict():
        return None
    from tensordict.memmap import MemoryMappedTensor

    # a cast: tensordict 0.14 does not annotate the class as a Tensor subclass for mypy
    return cast("type[torch.Tensor]", MemoryMappedTensor)


#: The depth of this thread's dispatch-mode stack (infra modes such as FakeTensorMode
#: included), from torch's C API: a restore asks it before listing the stack in Python.
_dispatch_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)


def _fake_mode_active() -> bool:
    """Whether torch's FakeTensorMode is active on this thread (its dispatch-mode stack)."""
    if _dispatch_depth is not None and not _dispatch_depth():
        return False  # no mode at all: the usual restore
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    except ImportError:  # a torch without the private API: no fake mode to honour
        return False
    stack = _get_current_dispatch_mode_stack()
    if not stack:
        return False
    from torch._subclasses.fake_tensor import FakeTensorMode

    return any(isinstance(mode, FakeTensorMode) for mode in stack)


def load_pickled(storage: Storage, rel: str) -> Any:
    """Unpickle one sidecar. Only called once the pickle policy allowed it."""
    raw = storage.read_bytes(rel, max_bytes=_MAX_PICKLE_BYTES)
    try:
        return pickle.loads(raw)
    except Exception as exc:
        raise RestoreError(
            f"{storage.display(rel)}: the pickled value cannot be loaded ({type(exc).__name__}: "
            f"{exc}). Import the module that defines its class before restoring, or restore "
            "with the code that saved it.",
            path=storage.display(rel),
        ) from exc


class Mapper:
    """Maps leaves of one opened checkpoint."""

    def __init__(self, storage: Storage, mode: MapMode, device: torch.device | None = None) -> None:
        self.storage = storage
        self.mode = mode
        self.device = device
        #: Whether loaded levels remember their directory (tensordict: not for archives / "r").
        self.records_prefix = storage.kind == "directory" and mode != "r"
        # Directory leaves become tensordict MemoryMappedTensors, as tensordict returns them.
        self._mmt = _memory_mapped_tensor() if storage.kind == "directory" else None
        #: Under torch's FakeTensorMode (tracing, meta-initialisation), leaves are fake
        #: tensors of the saved shape and dtype and no file is read, as with tensordict.
        self._fake = _fake_mode_active()
        self._structure_only = (device is not None and device.type == "meta") or self._fake
        self._move = device is not None and device.type not in ("cpu", "meta")
        #: The storage's call that maps many usual leaves at once, where leaves become
        #: MemoryMappedTensors as they are (a directory; no move, no structure-only load).
        self._map_listed = (
            storage.map_listed
            if isinstance(storage, DirectoryStorage)
            and self._mmt is not None
            and not self._structure_only
            and not self._move
            else None
        )
        #: The storage's call that gives many leaves as views of one mapping (a consolidated
        #: file), where leaves are used as they are mapped.
        self._map_views = (
            getattr(storage, "map_leaves", None)
            if not self._structure_only and not self._move
            else None
        )
        #: The attributes tensordict's from_filename sets that are the same for every leaf,
        #: and the one that holds the leaf's shape (their names changed in tensordict 0.15).
        self._mmt_state, self._shape_attr = _mmt_attributes(mode)
        #: torch.Size and contiguous strides by shape: leaves of one checkpoint share a few
        #: shapes (Size is immutable).
        self._sizes: dict[tuple[int, ...], tuple[torch.Size, tuple[int, ...]]] = {}

    def dir_path(self, rel: str) -> Path | None:
        if not self.records_prefix:
            return None
        return self.storage.physical_path(rel)

    def leaf(self, node: LeafNode) -> torch.Tensor:
        return self.leaves((node,))[0]

    def leaves(self, nodes: Sequence[LeafNode]) -> list[torch.Tensor]:
        """The tensors of ``nodes``, in order.

        The usual leaves (kept lean: 10,000 of them make a large checkpoint) - dense
        tensors in files of a directory - are mapped in one storage call per level
        (``map_listed``) and become MemoryMappedTensors as tensordict's ``from_filename``
        builds them; any other, or one that storage call did not map, takes
        :meth:`_other_leaf` (which maps it with every check, or says why it cannot).
        """
        listed = self._map_listed
        if listed is None:
            if self._map_views is not None:
                return self._views(nodes)
            return [self._other_leaf(node) for node in nodes]
        specs: list[tuple[str, torch.dtype, int]] = []
        for node in nodes:
            src = node.file
            if (
                src is not None
                and src.data is None
                and src.source is not None
                and not node.is_nested
            ):
                specs.append((src.source, node.dtype, node.numel))
            else:
                specs.append(("", node.dtype, 0))  # not a listed file: None
        mmt = self._mmt
        common = self._mmt_state
        shape_attr = self._shape_attr
        sizes = self._sizes
        absolute = self.storage.absolute_str  # type: ignore[attr-defined]
        out: list[torch.Tensor] = []
        append = out.append
        for node, flat, spec in zip(nodes, listed(specs, self.mode), specs, strict=True):
            if flat is None:
                if not spec[0]:
                    append(self._other_leaf(node))
                    continue
                # A usual leaf that needs more than the lean path (a safe link, say): mapped
                # with every check, or refused with the reason.
                flat = self._map(spec[0], node)
            shape = node.shape
            known = sizes.get(shape)
            if known is None:
                known = sizes[shape] = (torch.Size(shape), _contiguous_strides(shape))
            if len(shape) != 1 or shape[0] != node.numel:
                # In place (as_strided_ on the fresh tensor that owns the mapping), not a
                # view: the leaf stays one tensor whose _base is None, as tensordict's is.
                flat.as_strided_(known[0], known[1])
            # The fresh tensor becomes the MemoryMappedTensor (a Python subclass of
            # torch.Tensor with the same layout): what _make_subclass would build, without
            # a second tensor per leaf. Its attributes go straight into __dict__ (the
            # ``filename`` setter normalises through pathlib; the storage's path is
            # absolute and normal already).
            flat.__class__ = mmt  # type: ignore[assignment]
            state = flat.__dict__
            state.update(common)
            state["_filename"] = absolute(spec[0])
            state[shape_attr] = known[0]
            append(flat)
        return out

    def _views(self, nodes: Sequence[LeafNode]) -> list[torch.Tensor]:
        """The tensors of ``nodes`` as views of the storage's one mapping (``map_leaves``);
        any leaf that call leaves out through :meth:`_other_leaf`."""
        assert self._map_views is not None
        views: list[torch.Tensor | None] = self._map_views(nodes, self.mode)
        if all(map(operator.is_not, views, itertools.repeat(None))):
            return views  # type: ignore[return-value]
        return [
            view if view is not None else self._other_leaf(node)
            for view, node in zip(views, nodes, strict=True)
        ]

    def _other_leaf(self, node: LeafNode) -> torch.Tensor:
        """A leaf that is not a dense tensor in a directory's file (or that is moved, or
        loaded for its structure only)."""
        src = node.file
        if self._structure_only:
            # A structure-only load: no file is read, as with tensordict's device="meta".
            shape = node.shape[:1] if node.is_nested else node.shape
            if self._fake:  # a FakeTensor, on the device the mode gives it
                return torch.empty(shape, dtype=node.dtype)
            return torch.empty(shape, dtype=node.dtype, device="meta")
        if src is None and node.is_nested:
            # a nested tensor without values: only its size table is on disk
            assert node.sizes is not None
            tensor = _nested_from_buffer(torch.empty(0, dtype=node.dtype), node.sizes)
        elif src is None:
            tensor = torch.empty(node.shape, dtype=node.dtype)
        else:
            if src.data is not None:  # content produced by a migration
                flat = (
                    torch.frombuffer(bytearray(src.data[: node.nbytes]), dtype=node.dtype)
                    if node.nbytes
                    else torch.empty(0, dtype=node.dtype)
                )
            else:
                assert src.source is not None
                flat = self._map(src.source, node)
            if node.is_nested:
                assert node.sizes is not None
                tensor = _nested_from_buffer(flat, node.sizes)
            elif len(node.shape) == 1 and node.shape[0] == node.numel:
                tensor = flat  # already that shape: skip a view per leaf
            else:
                tensor = flat.view(node.shape)
            if self._mmt is not None and src.source is not None:
                tensor = self._wrap(tensor, node, src.source)
        if self._move and tensor.device != self.device:
            tensor = tensor.to(self.device)
        return tensor

    def _map(self, rel: str, node: LeafNode) -> torch.Tensor:
        try:
            return self.storage.map(rel, node.dtype, node.numel, mode=self.mode)
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, TdckptError):
                raise
            raise self._map_error(exc, rel, node) from exc

    def _map_error(self, exc: OSError | RuntimeError, rel: str, node: LeafNode) -> RestoreError:
        """The RestoreError for a leaf the OS or torch refused to map."""
        return RestoreError(
            f"{self.storage.display(rel)}: cannot map {node.dtype} x {node.numel} ({exc}).",
            path=self.storage.display(rel),
            key=node.key,
        )

    def _wrap(self, tensor: torch.Tensor, node: LeafNode, source: str) -> torch.Tensor:
        """A MemoryMappedTensor on ``source``, in the state tensordict's from_filename leaves."""
        mmt = self._mmt
        assert mmt is not None
        # _make_subclass is the cheap alias; a nested tensor goes through the class itself
        # (aliasing one with _make_subclass warns about the nested-tensor prototype).
        out: torch.Tensor = (
            mmt(tensor) if node.is_nested else torch.Tensor._make_subclass(mmt, tensor)
        )
        # The attributes tensordict's from_filename sets, written straight into __dict__:
        # the ``filename`` setter normalises through pathlib (slow for 10,000 leaves), and
        # the storage already gives an absolute, normalised path.
        state = out.__dict__
        state["_filename"] = self.storage.absolute_str(source)  # type: ignore[attr-defined]
        state.update(self._mmt_state)
        state[self._shape_attr] = node.sizes if node.is_nested else torch.Size(node.shape)
        return out


def _mmt_attributes(mode: MapMode) -> tuple[dict[str, Any], str]:
    """What tensordict's ``MemoryMappedTensor.from_filename`` sets on a leaf: the attributes
    common to every leaf, and the name of the one that holds its shape.

    tensordict 0.15 keeps them private (``_index``, ``_parent_shape``, ``_mode``,
    ``_index_chain``, with properties ``index``/``parent_shape`` over them); 0.14 sets plain
    ``index`` and ``parent_shape`` attributes, which its pickling reads.
    """
    mmt = _memory_mapped_tensor()
    if mmt is not None and isinstance(vars(mmt).get("parent_shape"), property):
        return {"_handler": None, "_mode": mode, "_index": None, "_index_chain": ()}, (
            "_parent_shape"
        )
    return {"_handler": None, "index": None}, "parent_shape"


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape`` (a size 0 counts as 1)."""
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _nested_from_buffer(flat: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    strides, offsets = torch._nested_compute_contiguous_strides_offsets(sizes)
    if flat.storage_offset():
        # _nested_view_from_buffer reads ``offsets`` from the start of the buffer's storage,
        # not from the view's first element: a leaf that is a slice of a larger mapping (an
        # entry of a stored .tdz) would show the bytes before it (the archive's headers).
        offsets = offsets + int(flat.storage_offset())
    return torch._nested_view_from_buffer(flat, sizes, strides, offsets)


def non_tensor_value(
    node: NonTensorNode, storage: Storage, unpickle: bool
) -> tuple[Any, dict[str, Any]]:
    """The value of a NonTensorData node and its extra fields (``_metadata`` ...)."""
    fields: dict[str, Any] = {"_metadata": node.metadata}
    value = node.data
    if node.pickle is not None and unpickle:
        assert node.pickle.source is not None
        loaded = load_pickled(storage, node.pickle.source)
        if isinstance(loaded, dict):
            fields.update(loaded)
            value = fields.pop("data", value)
    elif node.json_types:
        # json_types.json (tensordict 0.15.0+) names the classes that other.pickle holds:
        # each field's value *is* that class (``{"data": tuple}``: the value is ``tuple``).
        fields.update({name: _JSON_TYPES[cls] for name, cls in node.json_types.items()})
        value = fields.pop("data", value)
    return value, fields


#: tensorclass._JSON_TYPES: the classes json_types.json may name, by name.
_JSON_TYPES: dict[str, type] = {
    "dict": dict,
    "OrderedDict": collections.OrderedDict,
    "list": list,
    "tuple": tuple,
}


def nt_stack_value(node: NonTensorStackNode, storage: Storage, unpickle: bool) -> list[Any]:
    if node.pickle is not None and unpickle:
        assert node.pickle.source is not None
        data = load_pickled(storage, node.pickle.source)
        if not isinstance(data, list):
            raise RestoreError(
                f"{storage.display(node.pickle.source)}: expected a pickled list for a "
                f"NonTensorStack, found {type(data).__name__}.",
                path=storage.display(node.pickle.source),
            )
        return data
    return list(node.data or [])


def tensorclass_fields(node: TensorClassNode, storage: Storage, unpickle: bool) -> dict[str, Any]:
    fields = dict(node.fields)
    if node.pickle is not None and unpickle:
        assert node.pickle.source is not None
        loaded = load_pickled(storage, node.pickle.source)
        if isinstance(loaded, dict):
            fields.update(loaded)
    return fields


def check_tensorclass_fields(
    cls: type, fields: dict[str, Any], inner_keys: Any, where: str
) -> None:
    """Refuse saved fields the class does not declare (a renamed or edited class), and a
    field saved twice (pickled in other.pickle and in ``_tensordict/``)."""
    try:
        declared = declared_fields(cls)
    except TypeError:  # pragma: no cover - every tensorclass is a dataclass
        return
    both = sorted(k for k, v in fields.items() if v is not None and k in inner_keys)
    if both:
        raise RestoreError(
            f"{where}: the saved {cls.__qualname__} stores field(s) {both} both as non-tensor "
            "data and in its _tensordict/; a tensorclass holds each field once. The checkpoint "
            "is damaged or was edited.",
            path=where,
            fields=both,
        )
    unknown = sorted((set(fields) | set(inner_keys)) - declared)
    if unknown:
        raise RestoreError(
            f"{where}: the saved {cls.__qualname__} has field(s) {unknown} that the class "
            f"{cls.__module__}.{cls.__qualname__} does not declare ({sorted(declared)}). The class "
            "changed since the checkpoint was written, or the metadata was edited: restore with "
            "the class definition that saved it.",
            path=where,
            fields=unknown,
        )


def resolve_tensorclass(type_str: str, where: str) -> type:
    """Find an already-imported tensorclass by its saved ``<class 'mod.Name'>`` string.

    Like tensordict, tdckpt never imports a module named by a checkpoint (that would run
    code chosen by whoever wrote the file): the class must be imported already.
    Validation refused every name that resolves to something else than a tensorclass.
    """
    found = resolve_class(type_str)
    if found.cls is not None:
        return found.cls
    if found.problem is not None:
        raise RestoreError(
            f"{where}: the saved tensorclass cannot be rebuilt: {found.problem}.",
            path=where,
            class_name=found.name,
        )
    raise RestoreError(
        f"{where}: the saved tensorclass {found.name} is not imported. Import the module that "
        f"defines it (`import {found.module}`) before restoring; tdckpt never imports modules "
        "named by a checkpoint.",
        path=where,
        class_name=found.name,
    )
