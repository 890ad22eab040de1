"""safetensors in: the format's names and limits, and :func:`load_safetensors`.

One file or a folder (with or without Hugging Face's ``model.safetensors.index.json``) into
a TensorDict (a nested dict without tensordict). Every header is checked before a byte is
mapped - its size, each dtype, shape and byte range (sizes and strides within int64), ranges
inside the data with no overlap and no gap, tied names of tensors of the same file, each
name in one file only - and each file is mapped once (copy-on-write): every tensor is a view
of that mapping. :mod:`tdckpt._interop.safetensors` writes the format.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tdckpt.errors import MetadataError

__all__ = [
    "DTYPES",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "NAMES",
    "SHARD_RE",
    "SINGLE_NAME",
    "TIED_KEY",
    "load_safetensors",
]

#: safetensors' dtype names (the format's spec) and torch's dtypes.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}

#: The largest header read (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
#: The largest index file read.
MAX_INDEX_BYTES = 100_000_000
#: Hugging Face's names for a single file, the shards and their index.
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_RE = re.compile(r"model-(\d{5,})-of-(\d{5,})\.safetensors")
#: The ``__metadata__`` entry recording tied tensors: JSON ``{alias: written name}``.
TIED_KEY = "tdckpt.tied"


def load_safetensors(path: str | os.PathLike[str], *, nested: bool = True) -> Any:
    """Load safetensors: a file, or a folder of one file or of shards with their index.

    Every header is checked before any tensor is made (its size, each dtype, shape and
    byte range; ranges inside the data, neither overlapping nor leaving gaps); each file is
    mapped once, copy-on-write, and every tensor is a view of that mapping (writes to it
    never reach the file). Tied tensors recorded by :func:`export_safetensors` come back as
    one tensor.

    Args:
        path: a ``.safetensors`` file, or a folder holding ``model.safetensors.index.json``
            and its shards, or exactly one ``.safetensors`` file.
        nested: split dotted names into nested keys (``"enc.w"`` -> ``("enc", "w")``);
            False keeps the names flat.

    Returns:
        A TensorDict (batch size ``[]``), or a nested dict when tensordict is not installed.

    Raises:
        tdckpt.errors.MetadataError: a header or index that is not valid safetensors, named
            with its file and the problem.
    """
    root = Path(path)
    files, weight_map = _files(root)
    flat: dict[str, torch.Tensor] = {}
    held: dict[str, Path] = {}
    for file in files:
        tensors, tied = _read_file(file)
        for name, tensor in tensors.items():
            if name in flat:
                raise MetadataError(
                    f"{file}: {name!r} is also in another file of {root}; each tensor is in "
                    "one file only.",
                    path=str(file),
                )
            flat[name] = tensor
            held[name] = file
        for alias, name in tied.items():
            if alias in flat:
                raise MetadataError(
                    f"{file}: the tied name {alias!r} is also a tensor of another file of "
                    f"{root}; each name is in one file only.",
                    path=str(file),
                )
            flat[alias] = tensors[name]
            held[alias] = file
    for name, file_name in weight_map.items():
        if held.get(name, Path()).name != file_name:
            raise MetadataError(
                f"{root / INDEX_NAME}: names {name!r} in {file_name}, which does not hold it. "
                "The index and the files are from different exports.",
                path=str(root / INDEX_NAME),
            )
    return _build(flat, nested=nested, where=root)


def _files(root: Path) -> tuple[list[Path], dict[str, str]]:
    """The files to read, and the index's ``{tensor name: file name}`` (empty without one)."""
    if root.is_file():
        return [root], {}
    if not root.is_dir():
        raise MetadataError(f"{root}: no such file or folder.", path=str(root))
    index = root / INDEX_NAME
    if index.is_file():
        doc = _read_json(index, MAX_INDEX_BYTES)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise MetadataError(
                f'{index}: not a safetensors index: it needs a "weight_map" of tensor '
                "names to file names.",
                path=str(index),
            )
        names = sorted(set(weight_map.values()))
        for name in names:
            if "/" in name or "\\" in name or name in ("", ".", "..") or "\0" in name:
                raise MetadataError(
                    f"{index}: the file name {name!r} leaves the folder; an index names "
                    "files beside it.",
                    path=str(index),
                )
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise MetadataError(
                f"{index}: names {len(missing)} file(s) that are not there: "
                f"{', '.join(missing[:5])}. Copy the whole folder.",
                path=str(index),
            )
        return [root / n for n in names], weight_map
    found = sorted(p for p in root.iterdir() if p.suffix == ".safetensors" and p.is_file())
    if len(found) != 1:
        raise MetadataError(
            f"{root}: {len(found)} .safetensors files and no {INDEX_NAME}; pass one file, or "
            "a folder with its index.",
            path=str(root),
        )
    return found, {}


def _read_json(path: Path, limit: int) -> Any:
    with open(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise MetadataError(f"{path}: larger than {limit} bytes.", path=str(path))
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise MetadataError(f"{path}: not JSON ({why}).", path=str(path)) from None


def _read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Check one file's header, map it once, and view every tensor in the mapping."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise _bad(path, f"{size} bytes: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _bad(
                path,
                f"the header claims {n} bytes; the file has {size} (and tdckpt reads at most "
                f"{MAX_HEADER_BYTES})",
            )
        raw = os.pread(fd, n, 8)
        specs, meta = _parse_header(path, raw, data_bytes=size - 8 - n)
        tied = _tied(path, meta, specs)
        if size == 0 or not specs:
            return {}, tied
        buf = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    start = 8 + n
    tensors = {}
    for name, (dtype, shape, begin, end) in specs.items():
        chunk = whole[start + begin : start + end]
        if (start + begin) % dtype.itemsize:  # unaligned (another writer): copy it
            chunk = chunk.clone()
        tensors[name] = (
            chunk.view(dtype).view(shape) if end > begin else torch.empty(shape, dtype=dtype)
        )
    return tensors, tied


def _bad(path: Path, why: str) -> MetadataError:
    return MetadataError(
        f"{path}: not a valid safetensors file: {why}. The file is damaged or was not written "
        "as safetensors.",
        path=str(path),
    )


def _parse_header(
    path: Path, raw: bytes, *, data_bytes: int
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], dict[str, str]]:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise _bad(path, f"its header is not JSON ({why})") from None
    if not isinstance(header, dict):
        raise _bad(path, "its header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise _bad(path, "__metadata__ must map strings to strings")
    specs = {}
    for name, spec in header.items():
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise _bad(path, f"{name!r}: an entry has exactly dtype, shape and data_offsets")
        dtype = DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
        if dtype is None:
            raise _bad(path, f"{name!r}: unknown dtype {str(spec['dtype'])[:40]!r}")
        shape, offsets = spec["shape"], spec["data_offsets"]
        if (
            not isinstance(shape, list)
            or len(shape) > 64
            or not all(type(d) is int and 0 <= d < 2**63 for d in shape)
        ):
            raise _bad(path, f"{name!r}: the shape must be a list of at most 64 sizes >= 0")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise _bad(
                path,
                f"{name!r}: data_offsets {str(offsets)[:60]} are not a range inside the "
                f"{data_bytes} data bytes",
            )
        numel = math.prod(shape)
        if numel * dtype.itemsize != offsets[1] - offsets[0]:
            raise _bad(
                path,
                f"{name!r}: {spec['dtype']} {shape} is {numel * dtype.itemsize} bytes, its range "
                f"{offsets[1] - offsets[0]}",
            )
        # (a zero-element shape passes the size check whatever its other sizes)
        if _overflows(shape, dtype.itemsize):
            raise _bad(
                path,
                f"{name!r}: the shape {str(shape)[:80]} has sizes or strides past 2**63 bytes, "
                "which no tensor can have",
            )
        specs[name] = (dtype, tuple(shape), offsets[0], offsets[1])
    # The ranges tile the data exactly: no overlap (two tensors on the same bytes) and no
    # gap (bytes no tensor owns), as safetensors itself requires.
    end = 0
    for name, (_, _, begin, stop) in sorted(specs.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else "leaves a gap before it"
            raise _bad(path, f"{name!r}: its range [{begin}, {stop}) {what}")
        end = stop
    if end != data_bytes:
        raise _bad(path, f"{data_bytes - end} bytes after the last tensor belong to none")
    return specs, meta


def _overflows(shape: list[int], itemsize: int) -> bool:
    """Whether a tensor of ``shape`` would need a size or a stride past int64, as torch
    computes them (its storage size ignores a zero dimension's product, its strides are
    the products of the dimensions after each, each at least 1)."""
    stride = itemsize
    for d in reversed(shape):
        stride *= max(d, 1)
        if stride >= 2**63:
            return True
    return False


def _tied(path: Path, meta: dict[str, str], specs: Mapping[str, Any]) -> dict[str, str]:
    text = meta.get(TIED_KEY)
    if text is None:
        return {}
    try:
        tied = json.loads(text)
    except (ValueError, RecursionError):
        tied = None
    if not isinstance(tied, dict) or not all(
        isinstance(a, str) and isinstance(n, str) and n in specs and a not in specs
        for a, n in tied.items()
    ):
        raise _bad(path, f"__metadata__[{TIED_KEY!r}] must map new names to tensors of the file")
    return tied


def _build(flat: dict[str, torch.Tensor], *, nested: bool, where: Path) -> Any:
    tree: dict[str, Any] = {}
    if not nested:
        tree = dict(flat)
    else:
        for name, tensor in flat.items():
            parts = name.split(".")
            node = tree
            for i, part in enumerate(parts[:-1]):
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    raise MetadataError(
                        f"{where}: {name!r} nests under {'.'.join(parts[: i + 1])!r}, which is "
                        "a tensor. Load with nested=False to keep the dotted names flat.",
                        path=str(where),
                    )
                node = child
            if parts[-1] in node:
                raise MetadataError(
                    f"{where}: {name!r} is a tensor and a prefix of other names. Load with "
                    "nested=False to keep the dotted names flat.",
                    path=str(where),
                )
            node[parts[-1]] = tensor
    try:
        from tensordict import TensorDict
    except ImportError:
        return tree
    return TensorDict(tree, batch_size=[])
