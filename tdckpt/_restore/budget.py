"""The process's memory-mapping budget, checked before a restore maps its first leaf.

A directory checkpoint's leaves are mapped one mapping per file, and Linux caps the number
of mappings a process may hold (``/proc/sys/vm/max_map_count``, 65,530 by default). A legal
checkpoint of 100,000 tiny leaves would fail part-way with a bare ``MemoryError`` from
``mmap``; :func:`check_map_budget` refuses it first, with a
:class:`~tdckpt.errors.RestoreError` naming the limit and the fix, target untouched. Archives
(one mapping for the whole file) and structure-only loads (``device="meta"``) map no leaf
file and are never refused. Counting the process's mappings reads ``/proc/self/maps``
(about 6 ms for 10,000 mappings), so a restore far below the limit maps first and counts
only if a mapping fails: the same error, raised before anything is committed.
"""

from __future__ import annotations

import errno
import traceback

import torch

from tdckpt._read.nodes import (
    LazyStackNode,
    LazyViewNode,
    LeafNode,
    Node,
    SubTensorDictNode,
    TensorClassNode,
    TensorDictNode,
)
from tdckpt._read.pipeline import OpenedCheckpoint
from tdckpt.errors import RestoreError

__all__ = [
    "MAX_MAP_COUNT_PATH",
    "check_map_budget",
    "leaf_sources",
    "mapped_leaf_files",
    "refuse_if_out_of_mappings",
]

#: Where Linux publishes the per-process limit on memory mappings.
MAX_MAP_COUNT_PATH = "/proc/sys/vm/max_map_count"
#: The mappings of this process, one per line.
_MAPS_PATH = "/proc/self/maps"
#: Below this many leaf files a restore is not checked (reading /proc costs more than the
#: mappings could): a process that close to its limit fails at its next allocation anyway.
_CHECK_FROM = 1024
#: Mappings left free for what the restore and the process allocate meanwhile (malloc
#: arenas, thread stacks, the tensors' own allocations).
_SPARE = 1024
#: A restore that needs at most 1/_FAR_BELOW of the limit does not count the process's
#: mappings first (a failed mapping is checked then, see refuse_if_out_of_mappings).
_FAR_BELOW = 2


def mapped_leaf_files(node: Node) -> int:
    """How many leaf files restoring ``node`` maps (one mapping each, from a directory)."""
    count = 0
    stack: list[Node] = [node]
    while stack:
        cur = stack.pop()
        if type(cur) is LeafNode:
            src = cur.file
            if src is not None and src.data is None and cur.numel > 0:
                count += 1
        elif isinstance(cur, TensorDictNode):
            stack.extend(cur.entries.values())
        elif isinstance(cur, LazyStackNode):
            stack.extend(cur.members)
        elif isinstance(cur, TensorClassNode):
            stack.append(cur.inner)
        elif isinstance(cur, (SubTensorDictNode, LazyViewNode)):
            stack.append(cur.source)
    return count


def leaf_sources(node: Node) -> list[str]:
    """The leaf files restoring ``node`` reads (relative paths), in tree order."""
    out: list[str] = []
    stack: list[Node] = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, LeafNode):
            src = cur.file  # a nested tensor's size table was read by validation
            if src is not None and src.data is None and src.source is not None and cur.numel:
                out.append(src.source)
        elif isinstance(cur, TensorDictNode):
            stack.extend(reversed(list(cur.entries.values())))
        elif isinstance(cur, LazyStackNode):
            stack.extend(reversed(cur.members))
        elif isinstance(cur, TensorClassNode):
            stack.append(cur.inner)
        elif isinstance(cur, (SubTensorDictNode, LazyViewNode)):
            stack.append(cur.source)
    return out


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return int(f.read(64).strip())
    except (OSError, ValueError):
        return None


def _current_mappings() -> int | None:
    try:
        with open(_MAPS_PATH, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return None


def check_map_budget(
    opened: OpenedCheckpoint, device: torch.device | None, *, failed: bool = False
) -> None:
    """Refuse a restore whose leaf mappings would exceed the process's mapping limit.

    Before mapping, the process's mappings are counted (``/proc/self/maps``, about 0.6 us
    per mapping to read) only where the restore needs a good part of the limit; far below
    it, a process that is nearly full anyway is caught when a mapping fails
    (:func:`refuse_if_out_of_mappings`, ``failed=True``), with the same error.
    """
    if opened.storage.kind != "directory" or opened.root is None:
        return
    if device is not None and device.type == "meta":
        return
    needed = mapped_leaf_files(opened.root)
    if needed < _CHECK_FROM and not failed:
        return
    limit = _read_int(MAX_MAP_COUNT_PATH)
    if limit is None:  # not Linux, or /proc not mounted: nothing to ask
        return
    if not failed and needed + _SPARE <= limit // _FAR_BELOW:
        return
    current = _current_mappings()
    if current is None:
        return
    if current + needed + _SPARE <= limit:
        return
    suggested = max(limit * 2, current + needed + 4 * _SPARE)
    raise RestoreError(
        f"{opened.prefix}: restoring maps {needed} leaf files, one memory mapping each, and "
        f"this process already holds {current} mappings; the kernel allows {limit} per "
        f"process ({MAX_MAP_COUNT_PATH}), so the restore would fail part-way. Nothing was "
        "changed. Raise the limit (as root: `sysctl -w vm.max_map_count="
        f"{suggested}`), or keep the checkpoint as a .tdz archive (mapped once, whatever "
        "its number of leaves: CheckpointManager(..., archive=True)), or save fewer, larger "
        "tensors (stack the tiny ones).",
        path=opened.prefix,
        needed=needed,
        current=current,
        limit=limit,
    )


def _out_of_mappings(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is the kernel or allocator out of memory: what a
    process that reached its mapping limit meets (ENOMEM from mmap, or a MemoryError)."""
    while exc is not None:
        if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
            return True
        exc = exc.__cause__
    return False


def refuse_if_out_of_mappings(
    opened: OpenedCheckpoint, device: torch.device | None, exc: BaseException
) -> None:
    """After mapping the leaves failed with ``exc`` (nothing committed yet): raise
    :func:`check_map_budget`'s error instead where the process ran out of mappings.

    The frames of ``exc``'s traceback drop what they held first (the leaves mapped so far),
    so that the count is of what the process holds without this restore."""
    if not _out_of_mappings(exc):
        return
    if exc.__traceback__ is not None:
        traceback.clear_frames(exc.__traceback__)
    check_map_budget(opened, device, failed=True)
