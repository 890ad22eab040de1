"""The process's memory-mapping budget, checked before a restore maps its first leaf.

A directory checkpoint's leaves are mapped one mapping per file, and Linux caps the number
of mappings a process may hold (``/proc/sys/vm/max_map_count``, 65,530 by default). A legal
checkpoint of 100,000 tiny leaves would fail part-way with a bare ``MemoryError`` from
``mmap``; :func:`check_map_budget` refuses it first, with a
:class:`~tdckpt.errors.RestoreError` naming the limit and the fix, target untouched. Archives
(one mapping for the whole file) and structure-only loads (``device="meta"``) map no leaf
file and are never refused.
"""

from __future__ import annotations

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

__all__ = ["MAX_MAP_COUNT_PATH", "check_map_budget", "leaf_sources", "mapped_leaf_files"]

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


def check_map_budget(opened: OpenedCheckpoint, device: torch.device | None) -> None:
    """Refuse a restore whose leaf mappings would exceed the process's mapping limit."""
    if opened.storage.kind != "directory" or opened.root is None:
        return
    if device is not None and device.type == "meta":
        return
    needed = mapped_leaf_files(opened.root)
    if needed < _CHECK_FROM:
        return
    limit = _read_int(MAX_MAP_COUNT_PATH)
    current = _current_mappings()
    if limit is None or current is None:  # not Linux, or /proc not mounted: nothing to ask
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
