"""Validation of a level of usual leaves, column by column.

A large checkpoint is a level of thousands of dense tensors, each under its robust name,
each with its file: :func:`usual_leaves` checks such a level with C-level passes over its
columns (dtypes, shapes, files, sizes) instead of one :func:`validate_leaf.build_leaf` call per
leaf, and builds the same :class:`~tdckpt._read.nodes.LeafNode` for each. It answers only
where every leaf passes every check the per-leaf path applies to it - nothing to report -
and returns None at anything else (a sub-level, a nested or zero-element tensor, a name that
needs encoding, a missing, shared or short file, an unknown dtype, a shape past the limits
or not under the batch size): the per-leaf path then validates the level and reports what
is wrong. Either way the level's nodes, and the files claimed, are the same.
"""

from __future__ import annotations

import math
import operator
from itertools import repeat
from typing import Any

from tdckpt._keys import LEAF_SUFFIX
from tdckpt._read.levels import ChildSpec, LeafSpec
from tdckpt._read.nodes import DTYPES, LeafNode
from tdckpt._read.storage import UNKNOWN_SIZE
from tdckpt._read.tree import VDir

__all__ = ["usual_leaves"]

_SOURCE = operator.attrgetter("source")
_SIZE = operator.attrgetter("size")
_DATA = operator.attrgetter("data")
_ITEMSIZE = operator.attrgetter("itemsize")


def usual_leaves(
    vdir: VDir,
    key: tuple[str, ...],
    entries: dict[str, LeafSpec | ChildSpec],
    batch: tuple[int, ...],
    claimed: dict[int, tuple[str, ...]],
    max_bytes: int,
) -> dict[str, LeafNode] | None:
    """The level's leaf nodes (name -> node, in order) if ``entries`` are all usual leaves
    that pass validation, their files then recorded in ``claimed`` (id of the file -> key);
    None where the per-leaf path must decide (``claimed`` untouched)."""
    specs: list[Any] = list(entries.values())
    if not specs or set(map(type, specs)) != {tuple}:
        return None
    dtype_names, shapes, devices, nested = zip(*specs, strict=True)
    if any(nested):
        return None
    dtypes = list(map(DTYPES.get, dtype_names))
    if None in dtypes:
        return None
    names = list(entries)
    if not all(map(str.isidentifier, names)):  # its own file name (encode_key's rule)
        return None
    files = vdir.files
    vfiles = list(map(files.get, map(operator.add, names, repeat(LEAF_SUFFIX))))
    if not all(map(operator.is_not, vfiles, repeat(None))):
        return None
    sources = list(map(_SOURCE, vfiles))
    if (
        None in sources
        or len(set(sources)) != len(sources)
        or not all(map(operator.is_, map(_DATA, vfiles), repeat(None)))
    ):
        return None
    numels = list(map(math.prod, shapes))
    needs = list(map(operator.mul, numels, map(_ITEMSIZE, dtypes)))
    # No zero-element leaf (no file claimed, no zero in a shape): the strides' span is the
    # element count, within the byte limit.
    if not all(needs) or max(needs) > max_bytes:
        return None
    nb = len(batch)
    if nb and set(map(operator.itemgetter(slice(0, nb)), shapes)) != {batch}:
        return None
    sizes = list(map(_SIZE, vfiles))
    if set(sizes) != {UNKNOWN_SIZE} and (
        min(sizes) < 0 or not all(map(operator.ge, sizes, needs))
    ):  # short, or sizes known for some only: each is checked on its own
        return None
    ids = list(map(id, vfiles))
    if not claimed.keys().isdisjoint(ids):
        return None
    keys = list(zip(*map(repeat, key), names, strict=False))  # (*key, name) each
    claimed.update(zip(ids, keys, strict=True))
    return dict(
        zip(
            names,
            map(
                LeafNode,
                keys,
                sources,
                dtypes,
                shapes,
                devices,
                repeat(False),
                vfiles,
                repeat(None),
                numels,
            ),
            strict=False,
        )
    )
