"""safetensors out and in: the format the rest of the field reads.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and ``[begin, end)`` byte range in the data that follows, and the
data. This module writes and reads it directly (no ``safetensors`` package needed; the
files load with ``safetensors.torch.load_file``, and Hugging Face's sharded layout, a
``model.safetensors.index.json`` beside ``model-0000i-of-0000n.safetensors``, is the one
``transformers`` reads).

* :func:`export_safetensors`: a checkpoint prefix (any tensordict release), a TensorDict or
  a nested mapping of tensors to one file or a folder of shards. Nested keys are joined with
  ``.``; a tensor that is the same tensor as an earlier one (tied weights) is written once
  and recorded in the header's ``__metadata__`` (``tdckpt.tied``), which :func:`load_safetensors`
  reads back as one tensor again. Files are written beside their final name, synced and
  renamed into place, from the tensors' own memory (:mod:`~tdckpt._interop.safetensors_write`).
* :func:`load_safetensors`: one file or a folder (with or without an index) into a
  TensorDict (a nested dict without tensordict). Every header is checked before a byte is
  mapped: its size, each dtype, shape and range, ranges inside the data, no overlap, no gap;
  each file is mapped once (copy-on-write) and every tensor is a view of that mapping.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tdckpt._interop.safetensors_write import write_bytes, write_file
from tdckpt._write.atomic import fsync_dir
from tdckpt.errors import (
    CheckpointExistsError,
    MetadataError,
    UnsafePathError,
    UnsupportedContentError,
)

__all__ = ["ExportReport", "export_safetensors", "load_safetensors"]

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
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

#: The largest header read (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
#: The largest index file read.
MAX_INDEX_BYTES = 100_000_000
#: Hugging Face's names for a single file, the shards and their index.
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-(\d{5,})-of-(\d{5,})\.safetensors")
#: The ``__metadata__`` entry recording tied tensors: JSON ``{alias: written name}``.
TIED_KEY = "tdckpt.tied"


@dataclass
class ExportReport:
    """What :func:`export_safetensors` wrote.

    Attributes:
        files: the safetensors files, in order (one, or the shards).
        index: the index file of a sharded export (None for one file).
        tensors: the names written, each once.
        tied: ``{alias: name}`` for every tensor that is another tensor (written once).
        skipped: the keys of non-tensor values, which safetensors cannot hold.
        total_bytes: tensor bytes written.
    """

    files: list[Path] = field(default_factory=list)
    index: Path | None = None
    tensors: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    total_bytes: int = 0


def export_safetensors(
    source: Any,
    out: str | os.PathLike[str],
    *,
    max_shard_bytes: int | None = None,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    fsync: bool = True,
) -> ExportReport:
    """Write tensors as safetensors: one file, or Hugging Face's shards and index.

    Args:
        source: a checkpoint prefix (directory or ``.tdz`` of any tensordict release, read
            and validated by tdckpt), a TensorDict, or a nested mapping of tensors (a
            ``state_dict``).
        out: a file name ending in ``.safetensors`` (one file), or a folder, which receives
            ``model.safetensors`` or, when the tensors exceed ``max_shard_bytes``,
            ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``.
        max_shard_bytes: the most tensor bytes per file (a larger tensor gets a file of its
            own); None: one file.
        metadata: extra ``__metadata__`` strings (``{"format": "pt"}`` is always there).
        overwrite: replace files of the same names (otherwise an existing one is refused).
        allow_pickle: for a ``source`` prefix: load its pickled values (they are skipped
            anyway; False refuses a prefix that holds pickles).
        fsync: make every file durable before it is renamed into place.

    Raises:
        tdckpt.errors.UnsupportedContentError: a key holds a ``.`` (it would not read back
            as the same key), a tensor is not on the CPU or not dense, or a dtype safetensors
            does not have.
        tdckpt.errors.CheckpointExistsError: a file exists and ``overwrite`` is False.

    Example:
        >>> import tdckpt, tempfile, torch
        >>> from safetensors.torch import load_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     w = torch.ones(2, 2)
        ...     report = tdckpt.export_safetensors({"enc": {"w": w}, "dec": {"w": w}}, d)
        ...     sorted(load_file(report.files[0])), report.tied
        (['enc.w'], {'dec.w': 'enc.w'})
    """
    if isinstance(source, (str, os.PathLike)):
        from tdckpt._restore.engine import load_memmap

        source = load_memmap(source, allow_pickle=allow_pickle, mode="r")
    entries, skipped = _flatten_source(source)
    names, tied = _dedupe(entries)
    target = Path(out)
    single = target.suffix == ".safetensors"
    if single and max_shard_bytes is not None:
        raise ValueError(
            f"{target}: max_shard_bytes splits into several files: pass a folder, not a "
            ".safetensors file name"
        )
    groups = _shards(names, entries, max_shard_bytes)
    if single:
        paths = [target]
    elif len(groups) == 1:
        paths = [target / SINGLE_NAME]
    else:
        paths = [
            target / f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            for i in range(1, len(groups) + 1)
        ]
    index = None if len(groups) == 1 else target / INDEX_NAME
    if single and not target.parent.is_dir():
        raise UnsafePathError(
            f"{target}: its folder {target.parent} does not exist (or is not a folder); "
            "nothing was written. Create it first, or export to an existing folder.",
            path=str(target),
        )
    if single and os.path.isdir(target) and not os.path.islink(target):
        raise CheckpointExistsError(
            f"{target}: is a folder; a .safetensors file cannot replace it, overwrite or "
            "not. Export to another name, or into that folder (a name without the "
            ".safetensors suffix).",
            path=str(target),
        )
    if not single and os.path.lexists(target) and not target.is_dir():
        raise CheckpointExistsError(
            f"{target}: is a file, not a folder; a name without the .safetensors suffix is "
            "the folder an export writes its file(s) into, overwrite or not. Pass a name "
            "ending in .safetensors for one file, or a folder.",
            path=str(target),
        )
    if not single:
        target.mkdir(parents=True, exist_ok=True)
    # Another export's files in the folder would mix with these (an index naming old
    # shards, a model.safetensors beside new shards): they are replaced, or refused.
    stale = [] if single else _hf_files(target, keep={*paths, index})
    if not overwrite:
        for path in [*paths, *([index] if index else []), *stale]:
            if os.path.lexists(path):
                raise CheckpointExistsError(
                    f"{path}: already exists. Pass overwrite=True (--overwrite) to replace "
                    "it (and every file of an earlier export there), or export to another name.",
                    path=str(path),
                )
    meta = {"format": "pt", **dict(metadata or {})}
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str; {key!r}: {value!r} does not")
    report = ExportReport(files=paths, index=index, tensors=list(names), tied=tied)
    report.skipped = skipped
    weight_map: dict[str, str] = {}
    for path, group in zip(paths, groups, strict=True):
        file_meta = dict(meta)
        local_tied = {alias: name for alias, name in tied.items() if name in group}
        if local_tied:
            file_meta[TIED_KEY] = json.dumps(local_tied, sort_keys=True)
        report.total_bytes += write_file(
            path, {name: entries[name] for name in group}, file_meta, _NAMES, fsync=fsync
        )
        for name in group:
            weight_map[name] = path.name
        for alias in local_tied:
            weight_map[alias] = path.name
    if index is not None:
        doc = {"metadata": {"total_size": report.total_bytes}, "weight_map": weight_map}
        write_bytes(index, json.dumps(doc, indent=2, sort_keys=True).encode(), fsync=fsync)
    for path in stale:
        path.unlink(missing_ok=True)
    if fsync:
        fsync_dir(paths[0].parent)
    return report


def _hf_files(folder: Path, *, keep: set[Path | None]) -> list[Path]:
    """The files of an earlier export in ``folder`` (Hugging Face's names), but ``keep``."""
    if not folder.is_dir():
        return []
    return sorted(
        entry
        for entry in folder.iterdir()
        if (entry.name in (SINGLE_NAME, INDEX_NAME) or _SHARD_RE.fullmatch(entry.name))
        and entry not in keep
    )


def _flatten_source(source: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``{dotted name: tensor}`` and the keys skipped (non-tensor values)."""
    entries: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    bad: list[str] = []
    named: set[str] = set()
    for key, value in _walk(source, ()):
        if any("." in part or not part for part in key):
            bad.append(
                f"{key!r}: a key part holds '.' or is empty, so the dotted name "
                f"{'.'.join(key)!r} would not read back as this key"
            )
            continue
        name = ".".join(key)
        if name in named:
            bad.append(
                f"{key!r}: its name {name!r} is also the name of another key (keys that "
                "differ only in type, such as 1 and '1', read back as one); rename one"
            )
            continue
        named.add(name)
        if not isinstance(value, torch.Tensor):
            skipped.append(name)
            continue
        if value.is_nested or value.layout != torch.strided:
            bad.append(f"{name}: a {value.layout} tensor; safetensors holds dense tensors only")
        elif value.device.type != "cpu":
            bad.append(f"{name}: on {value.device}; move it to the CPU first (.cpu())")
        elif value.dtype not in _NAMES:
            bad.append(f"{name}: {value.dtype} is not a safetensors dtype")
        else:
            entries[name] = value
    if bad:
        raise UnsupportedContentError(
            f"cannot export as safetensors: {len(bad)} key(s):\n  " + "\n  ".join(bad[:20]),
            problems=bad,
        )
    return entries, skipped


def _walk(obj: Any, key: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(obj, torch.Tensor) or _is_non_tensor(obj):
        yield key, obj
        return
    items = _items(obj)
    if items is None:
        yield key, obj
        return
    for name, value in items:
        yield from _walk(value, (*key, str(name)))


def _items(obj: Any) -> list[tuple[str, Any]] | None:
    """A container's ``(name, value)`` pairs, or None for a leaf value."""
    if isinstance(obj, Mapping):
        return [(str(k), v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(v, torch.Tensor) for v in obj):
        return [(str(i), v) for i, v in enumerate(obj)]
    try:
        from tensordict import TensorDictBase, is_tensorclass
    except ImportError:  # pragma: no cover - tensordict is the usual source
        return None
    if is_tensorclass(obj):
        obj = obj._tensordict  # the data of a tensorclass instance
    if isinstance(obj, TensorDictBase):
        # items() keeps a NonTensorData as one (it is not unwrapped to its value).
        return [(str(name), value) for name, value in obj.items()]
    return None


def _is_non_tensor(value: Any) -> bool:
    try:
        from tensordict import is_non_tensor
    except ImportError:  # pragma: no cover
        return False
    return bool(is_non_tensor(value))


def _dedupe(entries: dict[str, torch.Tensor]) -> tuple[list[str], dict[str, str]]:
    """The names to write, and ``{alias: name}`` of tensors that are an earlier tensor."""
    seen: dict[tuple[Any, ...], str] = {}
    names: list[str] = []
    tied: dict[str, str] = {}
    for name, tensor in entries.items():
        ident = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        if tensor.numel() and ident in seen:
            tied[name] = seen[ident]
        else:
            seen.setdefault(ident, name)
            names.append(name)
    return names, tied


def _shards(
    names: list[str], entries: dict[str, torch.Tensor], max_bytes: int | None
) -> list[list[str]]:
    if max_bytes is None:
        return [names]
    if max_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, not {max_bytes}")
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = entries[name].numel() * entries[name].element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


# -- reading -----------------------------------------------------------------------------------


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
