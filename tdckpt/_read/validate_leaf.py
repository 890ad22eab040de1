"""Validation of one tensor leaf of a current-form level: its dtype, its shape (no overflow of
bytes or strides, the level's batch size first), its data file (present, large enough,
read by no other key) and, for a nested tensor, its size table.

Problems are reported, never raised (see ``validate.py``); a leaf with one is left out of
the validated tree. A level of usual leaves is checked column by column instead
(``validate_columns.py``), with the same bounds.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from tdckpt._keys import LEAF_SUFFIX, NESTED_SHAPE_SUFFIX, encode_key
from tdckpt._read.levels import LeafSpec
from tdckpt._read.nodes import DTYPES, LeafNode
from tdckpt._read.storage import Storage, join
from tdckpt._read.tree import VDir, VFile
from tdckpt.errors import TdckptError

__all__ = ["MAX_BYTES", "LeafCtx", "build_leaf"]

#: No single leaf may claim more than this (it bounds shape arithmetic on hostile input).
MAX_BYTES = 2**62


class LeafCtx(Protocol):
    """What leaf validation needs of a validation run (``validate.Ctx`` is one): the storage,
    the files claimed so far (by id, with the key that claimed each), ``add`` a problem."""

    storage: Storage
    claimed: dict[int, tuple[str, ...]]

    def add(
        self, code: str, path: str, key: tuple[str, ...], message: str, sev: str = "error"
    ) -> None: ...


#: The largest product of a tensor's dims (zeros counted as 1) torch's int64 strides hold.
_MAX_STRIDE_SPAN = 2**63 - 1


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


def build_leaf(
    vdir: VDir,
    key: tuple[str, ...],
    name: str,
    entry: LeafSpec,
    batch: tuple[int, ...],
    ctx: LeafCtx,
) -> LeafNode | None:
    dtype_str, shape, device, is_nested = entry
    fname = encode_key(name) + LEAF_SUFFIX
    dtype = DTYPES.get(dtype_str)
    if dtype is None:
        ctx.add(
            "unknown-dtype",
            join(vdir.source, "meta.json"),
            key,
            f"dtype {dtype_str!r} is not a torch dtype this tdckpt can map. Expected one of "
            "torch.float32, torch.int64, ... The metadata is damaged, or was written by a newer "
            "torch: upgrade torch.",
        )
        return None
    numel = math.prod(shape)
    if numel * max(dtype.itemsize, 1) > MAX_BYTES:
        ctx.add(
            "bad-shape",
            join(vdir.source, "meta.json"),
            key,
            f"shape {list(shape)} overflows: {numel} elements of {dtype} cannot exist on disk.",
        )
        return None
    # torch computes a tensor's strides from its dims, zeros counted as 1: a zero-element
    # leaf with huge other dims fails with "Stride calculation overflowed" when built.
    span = math.prod(max(d, 1) for d in shape)
    if span > _MAX_STRIDE_SPAN:
        ctx.add(
            "bad-shape",
            join(vdir.source, "meta.json"),
            key,
            f"shape {list(shape)}: its dims multiply to {span} (a zero counted as 1, as torch "
            "counts it for strides), past the 2**63 - 1 a tensor's strides can hold, so no "
            "tensor of this shape can exist, even with zero elements. The metadata is damaged "
            "or hostile.",
        )
        return None
    vfile = vdir.files.get(fname)
    # The physical file when there is one (a legacy name differs from fname).
    path = (
        vfile.source if vfile is not None and vfile.source is not None else join(vdir.source, fname)
    )
    leaf = LeafNode(key, path, dtype, shape, device, is_nested, vfile)
    if is_nested:
        if len(shape) != 2:
            ctx.add(
                "bad-shape",
                join(vdir.source, "meta.json"),
                key,
                "a nested tensor's entry records its size table's shape [elements, ndim]; "
                f"found {list(shape)}.",
            )
            return None
        leaf.shape_file = vdir.files.get(encode_key(name) + NESTED_SHAPE_SUFFIX)
        if leaf.shape_file is None:
            ctx.add(
                "missing-file",
                join(vdir.source, encode_key(name) + NESTED_SHAPE_SUFFIX),
                key,
                "the size table of a nested tensor is missing; the leaf cannot be rebuilt.",
            )
            return None
        if leaf.shape_file.size < numel * 8:
            ctx.add(
                "short-file",
                leaf.shape_file.source or path,
                key,
                f"{leaf.shape_file.size} bytes, but the size table {list(shape)} of int64 "
                f"needs {numel * 8}.",
            )
            return None
        sizes = _read_sizes(ctx.storage, leaf.shape_file, shape)
        if sizes is None or (sizes < 0).any():
            ctx.add(
                "bad-shape",
                leaf.shape_file.source or path,
                key,
                "the nested tensor's size table holds negative sizes.",
            )
            return None
        leaf.sizes = sizes
        # Python ints: an int64 product wraps (2**32 * 2**32 == 0) and would let a hostile
        # size table pass the size check, then fail raw when the tensor is built.
        rows = sizes.tolist()
        leaf.numel = sum(math.prod(row) for row in rows)
        if any(d > MAX_BYTES for row in rows for d in row) or (
            leaf.numel * max(dtype.itemsize, 1) > MAX_BYTES
        ):
            ctx.add(
                "bad-shape",
                leaf.shape_file.source or path,
                key,
                f"the nested tensor's size table claims {leaf.numel} elements of {dtype}, or "
                "a dimension no tensor can have. The size table is damaged.",
            )
            return None
        if batch and shape[0] != batch[0]:
            ctx.add(
                "batch-mismatch",
                path,
                key,
                f"a nested tensor of {shape[0]} elements in a level of batch size {list(batch)}.",
            )
    else:
        leaf.numel = numel
        if shape[: len(batch)] != batch:
            ctx.add(
                "batch-mismatch",
                join(vdir.source, "meta.json"),
                key,
                f"shape {list(shape)} does not start with the batch size {list(batch)} of its "
                "level. The metadata is damaged or was edited.",
            )
    need = leaf.numel * dtype.itemsize
    if vfile is None:
        if need:
            ctx.add(
                "missing-file",
                path,
                key,
                f"the data file is missing ({need} bytes of {dtype_str} {list(shape)} expected). "
                "tensordict would silently drop this key; restore the file from a backup.",
            )
            return None
    elif 0 <= vfile.size < need:  # UNKNOWN_SIZE: a restore's map checks it on the descriptor
        ctx.add(
            "short-file",
            path,
            key,
            f"{vfile.size} bytes, but {dtype_str} {list(shape)} needs {need}. The file is "
            "truncated (tensordict would grow it with zeros and load garbage); restore it from "
            "a backup.",
        )
        return None
    if need == 0 and not is_nested:
        # Nothing to read: the leaf is rebuilt from its metadata (tensordict >= 0.14 does
        # the same). A file that a name fallback found is not this key's, so it is not
        # claimed either (a zero-element "%2E" must not collide with the key ".").
        leaf.file = None
        return leaf
    if vfile is not None:
        other = ctx.claimed.setdefault(id(vfile), key)
        if other != key:
            ctx.add(
                "name-collision",
                path,
                key,
                f"keys {'.'.join(other)!r} and {'.'.join(key)!r} resolve to the same file, so one "
                "of them would read the other's data. Load with an explicit robust_key.",
            )
            return None
    return leaf


def _read_sizes(storage: Storage, vfile: VFile, shape: tuple[int, ...]) -> torch.Tensor | None:
    if vfile.data is not None:
        raw = vfile.data
    else:
        assert vfile.source is not None
        try:
            raw = storage.read_bytes(vfile.source, max_bytes=max(_numel(shape) * 8, 1) + vfile.size)
        except TdckptError:
            return None
    n = _numel(shape)
    return (
        torch.frombuffer(bytearray(raw[: n * 8]), dtype=torch.int64).reshape(shape).clone()
        if n
        else torch.zeros(shape, dtype=torch.int64)
    )
