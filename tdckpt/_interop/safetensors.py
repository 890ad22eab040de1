"""safetensors out and in: the format the rest of the field reads.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and ``[begin, end)`` byte range in the data that follows, and the
data. This module writes and reads it directly (no ``safetensors`` package needed; the
files load with ``safetensors.torch.load_file``, and Hugging Face's sharded layout, a
``model.safetensors.index.json`` beside ``model-0000i-of-0000n.safetensors``, is the one
``transformers`` reads).

* :func:`export_safetensors`: a checkpoint prefix (any tensordict release), a TensorDict or
  a nested mapping of tensors to one file or a folder of shards. Nested keys are joined with
  ``.`` and a key holding dots (a module's ``state_dict``: ``"0.weight"``) is written as it
  is, as Hugging Face names weights (``load_safetensors(nested=False)`` gives those names
  back; ``nested=True`` splits them at the dots); a tensor that is the same tensor as an
  earlier one (tied weights) is written once and recorded in the header's ``__metadata__``
  (``tdckpt.tied``), which :func:`load_safetensors` reads back as one tensor again. Files are
  written beside their final name, synced and
  renamed into place, from the tensors' own memory (:mod:`~tdckpt._interop.safetensors_write`).
* :func:`load_safetensors` (:mod:`~tdckpt._interop.safetensors_read`, re-exported here):
  one file or a folder (with or without an index) into a TensorDict (a nested dict without
  tensordict). Every header is checked before a byte is mapped; each file is mapped once
  (copy-on-write) and every tensor is a view of that mapping.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tdckpt._interop.safetensors_read import (
    DTYPES,
    INDEX_NAME,
    MAX_HEADER_BYTES,
    MAX_INDEX_BYTES,
    NAMES,
    SHARD_RE,
    SINGLE_NAME,
    TIED_KEY,
    load_safetensors,
)
from tdckpt._interop.safetensors_write import write_bytes, write_file
from tdckpt._write.atomic import fsync_dir
from tdckpt.errors import (
    CheckpointExistsError,
    UnsafePathError,
    UnsupportedContentError,
)

__all__ = [
    "DTYPES",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "ExportReport",
    "export_safetensors",
    "load_safetensors",
]


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
        tdckpt.errors.UnsupportedContentError: two keys make one name (``{"a.b": x}``
            beside ``{"a": {"b": y}}``, or ``1`` beside ``"1"``), a key part is empty, a
            tensor is not on the CPU or not dense, or a dtype safetensors does not have.
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
            path, {name: entries[name] for name in group}, file_meta, NAMES, fsync=fsync
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
        if (entry.name in (SINGLE_NAME, INDEX_NAME) or SHARD_RE.fullmatch(entry.name))
        and entry not in keep
    )


def _flatten_source(source: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``{dotted name: tensor}`` and the keys skipped (non-tensor values)."""
    entries: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    bad: list[str] = []
    named: set[str] = set()
    for key, value in _walk(source, ()):
        if not all(key):
            bad.append(f"{key!r}: a key part is empty, so the name {'.'.join(key)!r} has no key")
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
        elif value.dtype not in NAMES:
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
