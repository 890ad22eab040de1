"""Consolidated files: a read-only :class:`Storage` over tensordict's single-file layout.

``td.consolidate(filename=...)`` (tensordict >= 0.5; TorchRL's
``StateDictCheckpointAdapter(payload_format="consolidated")``) writes one file::

    [leaf bytes ........][metadata: UTF-8 JSON][metadata length: int64, little-endian]

and ``TensorDict.from_consolidated(filename)`` reads it back. The metadata is JSON in every
release that writes the file (``json.dumps``, later tensordict's ``json_dumps``), never a
pickle: reading it needs no pickle policy. Each level of the tree is an object::

    {"cls": "TensorDict" | "LazyStackedTensorDict" | "NonTensorStack" | "<class 'm.TC'>",
     "non_tensors": {key: [data, batch_size, device]},     # [data, batch_size] before 0.8
     "leaves": {key: [dtype, shape, start, stop, pad]},    # + ragged index for NJTs (0.13+)
     "cls_metadata": {"batch_size", "device", "names", "is_locked"} | {"stack_dim", ...},
     <child key>: {...the child level...}}

A leaf is ``data[start:stop]``, its last ``pad`` bytes padding (tensordict pads every leaf
to 8 bytes). A tensorclass is recorded by ``str(cls)`` from 0.15 on (0.5 - 0.14 cannot write
one: 0.5 - 0.7 record a bare class name no release can load back, 0.8 - 0.14 fail to
serialise the class).

:class:`ConsolidatedStorage` opens the file once and checks everything on that descriptor
before any caller sees it: a regular file; a footer whose length is bounded
(``MAX_JSON_BYTES``) and fits the file; JSON that parses within the same budgets as a
``meta.json``; every level well formed; every leaf's dtype known, its shape plain ints, its
byte range inside the leaf region, sized exactly for its shape and dtype plus at most 7
bytes of padding, aligned for its dtype, and overlapping no other leaf. Anything else is a
:class:`~tdckpt.errors.MetadataError` naming the file and the key, raised before a restore
touches its target. The metadata checks live in :mod:`tdckpt._read.consolidated_parse`.

It then presents the file as the current (tensordict 0.15.3, format v1) directory tree:
one virtual ``meta.json`` per level, one virtual ``<encoded key>.memmap`` per leaf. Every
stage above (detection, validation, the plan, in-place apply) reads it as it reads a
directory; :meth:`ConsolidatedStorage.map` returns views of the one mapping of the file
(copy-on-write for ``mode=None``/``"r"``, as ``from_consolidated`` maps it; shared for
``mode="r+"``). Nothing is ever written unless ``mode="r+"`` and the caller writes.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import operator
import os
import stat
import struct
import threading
import weakref
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import torch

from tdckpt._read.consolidated_parse import RESERVED, LeafExtent, Level, parse_consolidated
from tdckpt._read.mapping import map_reopened_writable
from tdckpt._read.nodes import LeafNode, TensorDictNode
from tdckpt._read.storage import (
    MAX_JSON_BYTES,
    Listing,
    MapMode,
    Storage,
    check_component,
    parse_json,
)
from tdckpt.errors import CheckpointNotFoundError, MetadataError, UnsafePathError
from tdckpt.schema import MANIFEST_NAME

__all__ = [
    "DATA_NAME",
    "FOOTER_BYTES",
    "ConsolidatedStorage",
    "open_consolidated",
    "parse_consolidated",
]

#: The length of the footer: the metadata's size in bytes, an int64 (little-endian).
FOOTER_BYTES = 8
#: The data file of a step saved with ``layout="consolidated"`` (beside its manifest).
DATA_NAME = "tensordict.consolidated"
_OPEN_FLAGS = os.O_RDONLY | sum(
    getattr(os, flag, 0) for flag in ("O_CLOEXEC", "O_NONBLOCK", "O_NOCTTY")
)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_FILE = operator.attrgetter("file")
_DATA = operator.attrgetter("data")
_SOURCE = operator.attrgetter("source")
_IS_NESTED = operator.attrgetter("is_nested")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_START = operator.attrgetter("start")
_SIZE = operator.attrgetter("size")
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)


def open_consolidated(
    path: str | os.PathLike[str],
    *,
    follow: bool = True,
    manifest_dir: str | None = None,
    location: str | None = None,
) -> ConsolidatedStorage | None:
    """The consolidated file at ``path``, checked; None if it is a zip (a ``.tdz``), not a
    regular file, or does not end as a consolidated file does (then the archive reader
    says what it is). ``follow=False``: a symlink at ``path`` is not followed (a step's
    data file inside its directory); ``manifest_dir``: that directory, whose manifest the
    storage then lists at its top; ``location``: the name messages use, when it is not
    ``path`` (a file read from object storage into an anonymous in-memory file)."""
    opened = os.fspath(path)
    location = opened if location is None else location
    try:
        fd = os.open(opened, _OPEN_FLAGS | (0 if follow else _O_NOFOLLOW))
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{location}: no such file. Check the path.", path=location
        ) from exc
    except OSError as exc:
        if exc.errno != errno.ELOOP or follow:
            raise
        raise UnsafePathError(
            f"{location}: a symlink where the step's data file belongs; tdckpt never follows "
            "it. Replace it with the real file.",
            path=location,
        ) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= FOOTER_BYTES:
            os.close(fd)
            return None
        head = os.pread(fd, 4, 0)
        footer = os.pread(fd, FOOTER_BYTES, st.st_size - FOOTER_BYTES)
        (length,) = struct.unpack("<q", footer) if len(footer) == FOOTER_BYTES else (-1,)
        if head in _ZIP_MAGIC or not 2 <= length <= st.st_size - FOOTER_BYTES:
            os.close(fd)
            return None
        first = os.pread(fd, 1, st.st_size - FOOTER_BYTES - length)
        if first != b"{":
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    return ConsolidatedStorage(location, fd, st, length, manifest_dir=manifest_dir)


class ConsolidatedStorage(Storage):
    """A checkpoint in tensordict's consolidated single-file layout (see the module doc).

    Built by :func:`open_consolidated` from the descriptor it opened: the metadata is read
    and checked from that descriptor, and the file is mapped from it, once per mode.
    """

    kind = "consolidated"
    #: keys are recorded as they are (JSON), never as file names: no encoding to decide
    verbatim_keys = True

    def __init__(
        self,
        location: str,
        fd: int,
        st: os.stat_result,
        length: int,
        *,
        manifest_dir: str | None = None,
    ) -> None:
        self.location = location
        #: the step folder whose manifest sits beside the data file (layout="consolidated")
        self._manifest_dir = manifest_dir
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        self._lock = threading.Lock()
        self._private: torch.Tensor | None = None
        self._shared: torch.Tensor | None = None
        self._stat = (st.st_dev, st.st_ino, st.st_size)
        try:
            if length > MAX_JSON_BYTES:
                raise MetadataError(
                    f"{location}: the consolidated file declares {length} bytes of metadata, "
                    f"more than the {MAX_JSON_BYTES} tdckpt reads (a 10,000-leaf tensordict "
                    "writes about 1 MB). The file is damaged or hostile.",
                    path=location,
                )
            data_size = st.st_size - FOOTER_BYTES - length
            raw = os.pread(fd, length, data_size)
            if len(raw) != length:
                raise MetadataError(
                    f"{location}: only {len(raw)} of the {length} bytes of metadata could be "
                    "read: the file is truncated. Re-create it.",
                    path=location,
                )
            parsed = parse_json(raw, where=location)
            self._parsed = parse_consolidated(parsed, data_size, location)
        except BaseException:
            self.close()
            raise
        self.data_size = data_size

    # -- Storage interface -----------------------------------------------------------
    def _level(self, rel: str) -> Level:
        for part in rel.split("/") if rel else []:
            check_component(part, where=self.display(rel))
        level = self._parsed.levels.get(rel)
        if level is None:
            raise CheckpointNotFoundError(
                f"{self.display(rel)}: no such level in the consolidated file.",
                path=self.display(rel),
            )
        return level

    def display(self, rel: str) -> str:
        return f"{self.location}:{rel}" if rel else self.location

    def listdir(self, rel: str) -> Listing:
        level = self._level(rel)
        files = level.files()
        files["meta.json"] = 0
        if not rel and self._manifest_dir is not None:
            try:
                st = os.lstat(os.path.join(self._manifest_dir, MANIFEST_NAME))
            except FileNotFoundError:
                pass
            else:
                if stat.S_ISREG(st.st_mode):
                    files[MANIFEST_NAME] = st.st_size
        return Listing(files=files, dirs=set(level.dirs))

    def _read_manifest(self, max_bytes: int) -> bytes:
        """The step's manifest, opened without following a link, checked on its descriptor."""
        assert self._manifest_dir is not None
        where = os.path.join(self._manifest_dir, MANIFEST_NAME)
        try:
            fd = os.open(where, _OPEN_FLAGS | _O_NOFOLLOW)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{where}: missing.", path=where) from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
                raise MetadataError(
                    f"{where}: not a regular file of at most {max_bytes} bytes; the step's "
                    "manifest is damaged or hostile.",
                    path=where,
                )
            return os.pread(fd, st.st_size, 0)
        finally:
            os.close(fd)

    def read_json(self, rel: str) -> Any:
        if rel == MANIFEST_NAME and self._manifest_dir is not None:
            return parse_json(
                self._read_manifest(MAX_JSON_BYTES),
                where=os.path.join(self._manifest_dir, MANIFEST_NAME),
            )
        parent, _, name = rel.rpartition("/")
        if name != "meta.json":
            raise CheckpointNotFoundError(
                f"{self.display(rel)}: no such metadata file in the consolidated file.",
                path=self.display(rel),
            )
        return self._level(parent).meta_json()  # a fresh document: readers may edit it

    def validated_root(self) -> TensorDictNode | None:
        """The validated node tree, when the file is TensorDict levels of dense leaves (built
        while the metadata was checked); None: read the virtual tree and validate it."""
        return self._parsed.root

    def root_class(self) -> str:
        """The class the file records at its top ("TensorDict", a tensorclass, ...)."""
        return str(self._parsed.raw["cls"])

    def leaf_ranges(self) -> list[tuple[tuple[str, ...], int, int]]:
        """``(key, start, bytes without padding)`` of every leaf, in file order (the keys of
        a lazy stack's members go through their index: ``("stack", "0", "a")``)."""
        out: list[tuple[tuple[str, ...], int, int]] = []
        stack: list[tuple[tuple[str, ...], dict[str, Any]]] = [((), self._parsed.raw)]
        while stack:
            key, level = stack.pop()
            for name, spec in level["leaves"].items():
                out.append(((*key, name), spec[2], spec[3] - spec[2] - spec[4]))
            children = [(k, v) for k, v in level.items() if k not in RESERVED]
            stack.extend(((*key, k), v) for k, v in reversed(children))
        out.sort(key=lambda item: item[1])
        return out

    def read_bytes(self, rel: str, *, max_bytes: int = MAX_JSON_BYTES) -> bytes:
        if rel == MANIFEST_NAME and self._manifest_dir is not None:
            return self._read_manifest(max_bytes)
        data = json.dumps(self.read_json(rel)).encode()
        if len(data) > max_bytes:
            raise MetadataError(
                f"{self.display(rel)}: {len(data)} bytes, more than {max_bytes}.",
                path=self.display(rel),
            )
        return data

    def _leaf(self, rel: str) -> tuple[int, int]:
        found = self._parsed.leaves.get(rel)
        if found is None:
            raise CheckpointNotFoundError(
                f"{self.display(rel)}: no such leaf in the consolidated file.",
                path=self.display(rel),
            )
        return found

    def map(self, rel: str, dtype: torch.dtype, numel: int, *, mode: MapMode) -> torch.Tensor:
        if mode not in (None, "r", "r+"):
            raise ValueError(f"mode must be None, 'r' or 'r+', got {mode!r}")
        start, size = self._leaf(rel)
        nbytes = numel * dtype.itemsize
        if numel < 0 or nbytes > size:
            raise MetadataError(
                f"{self.display(rel)}: holds {size} bytes, but {numel} elements of {dtype} "
                f"need {nbytes}. The metadata and the leaf disagree; the file is damaged.",
                path=self.location,
                name=rel,
            )
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return self._mapping(shared=mode == "r+")[start : start + nbytes].view(dtype)

    def map_leaves(self, nodes: Sequence[LeafNode], mode: MapMode) -> list[torch.Tensor | None]:
        """The tensors of many leaves as views of the one mapping, in order (each shaped as
        its node says, contiguous: what :meth:`map` and a view give); None for a node that
        is not a dense leaf with bytes in the file (the caller maps it on its own).

        Built on a per-dtype view of the map: one ``as_strided`` per leaf, or, for a run of
        consecutive leaves of one dtype and shape evenly spaced in the file (tensordict
        writes many: the same shape, each padded to 8 bytes), one ``as_strided`` for the
        whole run, ``unbind`` into its leaves in one call. A level the parse found to be one
        run (``Parsed.runs``), asked for whole with the parse's own nodes, is that one view
        with no check per leaf.
        """
        base = self._mapping(shared=mode == "r+")
        data_size = self.data_size
        one = self._parsed.runs.get(id(nodes[0])) if nodes else None
        if (
            one is not None
            and len(nodes) == len(one.nodes)
            and all(map(operator.is_, nodes, one.nodes))
        ):  # a whole level of the parse's nodes that is one run: one view, unbound
            item = one.dtype.itemsize
            flat = base[: data_size - data_size % item].view(one.dtype)
            view = flat.as_strided(
                (len(nodes), *one.shape),
                (one.step // item, *_strides(one.shape)),
                one.start // item,
            )
            return list(view.unbind(0))
        typed: dict[torch.dtype, torch.Tensor] = {}
        #: shape -> (contiguous strides, numel): a checkpoint repeats a few shapes
        layouts: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}
        files = list(map(_FILE, nodes))
        places: list[tuple[int, int] | None]
        if (
            all(map(operator.is_not, files, repeat(None)))
            and not any(map(_IS_NESTED, nodes))
            and all(map(operator.is_, map(_DATA, files), repeat(None)))
        ):  # the usual level, checked by C-level maps: dense leaves, each in the file
            if set(map(type, files)) == {LeafExtent}:  # the parse's own: ranges at hand
                places = list(zip(map(_START, files), map(_SIZE, files), strict=True))
            else:
                places = list(map(self._parsed.leaves.get, map(_SOURCE, files)))
        else:
            table = self._parsed.leaves
            places = [
                table.get(src.source)
                if (src := node.file) is not None
                and src.source is not None
                and src.data is None
                and not node.is_nested
                else None
                for node in nodes
            ]
        count = len(places)
        uniform = _uniform_run(nodes, places) if count > 2 else 0
        out: list[torch.Tensor | None] = []
        i = 0
        while i < count:
            place = places[i]
            if place is None:
                out.append(None)
                i += 1
                continue
            node = nodes[i]
            dtype, shape = node.dtype, node.shape
            start, size = place
            item = dtype.itemsize
            known = layouts.get(shape)
            if known is None:
                known = layouts[shape] = (_strides(shape), math.prod(shape))
            if not size or size != known[1] * item:
                out.append(None)  # no bytes (or not these): mapped on its own, or refused
                i += 1
                continue
            whole = typed.get(dtype)
            if whole is None:
                whole = typed[dtype] = base[: data_size - data_size % item].view(dtype)
            # The run of leaves from i on like this one, each ``step`` bytes after the last.
            if uniform and not i:  # the level is one run
                end, step = count, uniform
            else:
                end, step = _run_from(i, nodes, places)
            if end - i == 1:
                out.append(whole.as_strided(shape, known[0], start // item))
            else:
                run = whole.as_strided((end - i, *shape), (step // item, *known[0]), start // item)
                out.extend(run.unbind(0))
            i = end
        return out

    def close(self) -> None:
        """Drop this storage's mappings and close the file (returned tensors stay valid)."""
        with self._lock:
            self._private = self._shared = None
        self._finalizer()

    # -- mapping ---------------------------------------------------------------------
    def _mapping(self, *, shared: bool) -> torch.Tensor:
        """The leaf region as one uint8 tensor, mapped from the checked descriptor on first
        use (copy-on-write unless ``shared``); the file must be as it was when checked."""
        with self._lock:
            if not self._finalizer.alive:
                raise ValueError(f"{self.location}: the consolidated storage is closed.")
            cached = self._shared if shared else self._private
            if cached is not None:
                return cached
            st = os.fstat(self._fd)
            if st.st_size != self._stat[2]:
                raise MetadataError(
                    f"{self.location}: the file changed size since it was checked "
                    f"({self._stat[2]} -> {st.st_size} bytes); nothing was restored. "
                    "Restore it again once nothing writes it.",
                    path=self.location,
                )
            size = self._stat[2]
            try:
                if shared:
                    buffer = self._map_writable(size)
                else:
                    buffer = mmap.mmap(self._fd, size, access=mmap.ACCESS_COPY)
            except ValueError as exc:
                raise MetadataError(
                    f"{self.location}: the file was truncated since it was checked ({exc}); "
                    "nothing was restored.",
                    path=self.location,
                ) from exc
            base = torch.frombuffer(buffer, dtype=torch.uint8)[: self.data_size]
            if shared:
                self._shared = base
            else:
                self._private = base
            return base

    def _map_writable(self, size: int) -> mmap.mmap:
        """A shared mapping of the very file checked (reopened through /proc/self/fd)."""
        return map_reopened_writable(self._fd, self.location, self._stat, size)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _run_from(
    i: int, nodes: Sequence[LeafNode], places: list[tuple[int, int] | None]
) -> tuple[int, int]:
    """``(end, step)``: leaves ``i`` to ``end - 1`` are a run - one dtype, shape and size,
    each ``step`` bytes after the one before (``end == i + 1``: leaf ``i`` alone)."""
    first = places[i]
    assert first is not None
    start, size = first
    dtype, shape = nodes[i].dtype, nodes[i].shape
    count = len(places)
    end = i + 1
    following = places[end] if end < count else None
    if following is None:
        return end, 0
    step = following[0] - start
    if step < size or step % dtype.itemsize:
        return end, 0
    last = start
    while end < count:
        following = places[end]
        if following is None:
            break
        other = nodes[end]
        if (
            following[1] != size
            or following[0] - last != step
            or other.dtype is not dtype
            or other.shape != shape
        ):
            break
        last = following[0]
        end += 1
    return end, step


def _uniform_run(nodes: Sequence[LeafNode], places: list[tuple[int, int] | None]) -> int:
    """The step in bytes if every leaf of a level is one run (:func:`_run_from` of the first
    would reach the last), checked column by column in C; else 0."""
    if None in places or len(set(map(_DTYPE, nodes))) != 1:
        return 0
    shapes = list(map(_SHAPE, nodes))  # (count() compares by identity first: the parse
    if shapes.count(shapes[0]) != len(shapes):  # gives a level of one shape one tuple)
        return 0
    if len(set(map(_SECOND, places))) != 1:  # type: ignore[arg-type]
        return 0
    starts = list(map(_FIRST, places))  # type: ignore[arg-type]
    steps = set(map(operator.sub, starts[1:], starts[:-1]))
    step = steps.pop() if len(steps) == 1 else 0
    size = places[0][1]  # type: ignore[index]
    item = nodes[0].dtype.itemsize
    return step if size and step >= size and not step % item else 0
