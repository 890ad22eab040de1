"""Writing a step in tensordict's consolidated layout (``layout="consolidated"``).

A consolidated step is a directory of two files::

    <step>/tensordict.consolidated   what td.consolidate(filename=...) writes: every leaf,
                                     then the JSON metadata, then its length
    <step>/tdckpt.manifest.json      the manifest (written last): the data file's size and
                                     checksum, and every leaf's key, offset, size, checksum

``TensorDict.from_consolidated(<step>/tensordict.consolidated)`` loads the data file as it
is; ``tdckpt.load_memmap(<step>)`` (and a manager's restore) reads it through
:class:`~tdckpt._read.consolidated.ConsolidatedStorage`. The file is written by tensordict
itself, so it is exactly tensordict's format; tdckpt then reads it back through its own
checks (refusing what it could not restore), fsyncs it and checksums it.
"""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from tdckpt._read.consolidated import DATA_NAME, ConsolidatedStorage, open_consolidated
from tdckpt._write.checksum import CHUNK_BYTES, DEFAULT_CHECKSUM, new_hasher
from tdckpt._write.save import (
    check_save_options,
    claim_dest,
    discard_written,
    new_manifest,
    write_manifest_last,
)
from tdckpt.errors import TdckptError, UnsupportedContentError
from tdckpt.schema import (
    ConsolidatedRecord,
    FileRecord,
    LeafChecksumRecord,
    Manifest,
    StateRecord,
)

__all__ = ["LAYOUTS", "check_consolidatable", "write_consolidated"]

#: The layouts a step can be saved in.
LAYOUTS = ("memmap", "consolidated")

_ROOT_TYPES = {
    "TensorDict": "tensordict:TensorDict",
    "LazyStackedTensorDict": "tensordict:LazyStackedTensorDict",
}


def check_layout(layout: object) -> str:
    """``layout`` if it is one tdckpt writes, else ValueError."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return str(layout)


def check_consolidatable(obj: Any, dest_dir: str | os.PathLike[str]) -> None:
    """Refuse an object tensordict cannot write as one consolidated file (``dest_dir``:
    where it was to go, for the message)."""
    if not callable(getattr(obj, "consolidate", None)):
        raise UnsupportedContentError(
            f"{dest_dir}: layout='consolidated' saves a TensorDict, tensorclass or lazy stack "
            f"(tensordict's consolidate()), not a {type(obj).__name__}. Use layout='memmap'.",
            path=str(dest_dir),
        )
    names = _dtype_names()
    if names is None:
        return
    try:
        from tensordict import is_tensorclass

        inner = obj._tensordict if is_tensorclass(obj) else obj  # a tensorclass's data
        leaves = list(inner.items(include_nested=True, leaves_only=True))
    except Exception:
        return
    bad = [
        (key if isinstance(key, tuple) else (key,), value.dtype)
        for key, value in leaves
        if isinstance(value, torch.Tensor) and value.dtype not in names
    ]
    if bad:
        shown = ", ".join(f"{'.'.join(k)!r} ({dtype})" for k, dtype in bad[:5])
        raise UnsupportedContentError(
            f"{dest_dir}: layout='consolidated' cannot store {shown}: tensordict's "
            "consolidate() has no name for that dtype, so nothing was written. Use "
            "layout='memmap', which stores every dtype.",
            path=str(dest_dir),
            keys=[k for k, _ in bad],
        )


def _dtype_names() -> dict[torch.dtype, str] | None:
    """tensordict's table of the dtypes ``consolidate()`` writes (None: not found, then
    tensordict's writer decides)."""
    for module in ("tensordict._base.serialization", "tensordict.utils"):
        try:
            table = getattr(importlib.import_module(module), "_DTYPE_TO_STR_DTYPE", None)
        except ImportError:
            continue
        if isinstance(table, dict):
            return table
    return None


def write_consolidated(
    obj: Any,
    dest_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    user_metadata: dict[str, Any] | None = None,
    fsync: bool = True,
    checksum: str = DEFAULT_CHECKSUM,
    state: StateRecord | None = None,
) -> Manifest:
    """Write ``obj`` into the empty or missing ``dest_dir`` as one consolidated data file,
    then the manifest. ``obj`` is not modified. Arguments as ``write_checkpoint``.

    Raises:
        UnsupportedContentError: ``obj`` is not a tensor collection, or holds what the
            consolidated layout cannot store (non-tensor data that is not JSON, nested
            tensors tdckpt cannot read back); nothing is left in ``dest_dir``.
        MetadataError: ``user_metadata`` is not plain JSON data.
        CheckpointExistsError: ``dest_dir`` exists and is not empty.
    """
    metadata = check_save_options(user_metadata, checksum)
    check_consolidatable(obj, dest_dir)
    dest = Path(dest_dir)
    created = claim_dest(dest)
    data = dest / DATA_NAME
    try:
        _consolidate(obj, data)
        manifest = _manifest(data, checksum, step, metadata, state, fsync=fsync)
        write_manifest_last(dest, manifest, fsync=fsync)
    except BaseException:
        discard_written(dest, created=created)
        raise
    return manifest


def _consolidate(obj: Any, data: Path) -> None:
    """tensordict's own writer, into ``data``; its refusals become UnsupportedContentError."""
    source = obj
    is_consolidated = getattr(obj, "is_consolidated", None)
    if callable(is_consolidated) and is_consolidated():
        # A consolidated tensordict only rewrites its own file: write a fresh copy instead.
        source = obj.contiguous()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            source.consolidate(filename=data)
    except (TypeError, RuntimeError, NotImplementedError, ValueError, KeyError) as exc:
        raise UnsupportedContentError(
            f"{data.parent}: tensordict cannot write this object as a consolidated file "
            f"({type(exc).__name__}: {exc}). Non-tensor data must be plain JSON data there; "
            "use layout='memmap' for anything else.",
            path=str(data.parent),
        ) from exc


def _manifest(
    data: Path,
    algorithm: str,
    step: int | None,
    metadata: dict[str, Any],
    state: StateRecord | None,
    *,
    fsync: bool,
) -> Manifest:
    """Read the data file back through tdckpt's checks, fsync it, and describe it."""
    try:
        storage = open_consolidated(data)
    except TdckptError as exc:
        raise UnsupportedContentError(
            f"{data.parent}: tensordict wrote a consolidated file tdckpt cannot read back "
            f"({exc}). Use layout='memmap'.",
            path=str(data.parent),
        ) from exc
    if storage is None:  # pragma: no cover - tensordict always writes the footer
        raise UnsupportedContentError(
            f"{data}: not a consolidated file after writing it.", path=str(data)
        )
    with storage:
        if fsync:
            os.fsync(storage._fd)
        leaves = _leaf_records(storage, algorithm)
        whole = new_hasher(algorithm)
        size = storage._stat[2]
        offset = 0
        while offset < size:
            chunk = os.pread(storage._fd, min(CHUNK_BYTES, size - offset), offset)
            if not chunk:
                break
            whole.update(chunk)
            offset += len(chunk)
        root_cls = storage.root_class()
    return new_manifest(
        step=step,
        root_type=_ROOT_TYPES.get(root_cls, root_cls),
        files=[FileRecord(path=DATA_NAME, size=size, checksum=f"{algorithm}:{whole.hexdigest()}")],
        user_metadata=metadata,
        state=state,
        consolidated=ConsolidatedRecord(file=DATA_NAME, leaves=leaves),
    )


def _leaf_records(storage: ConsolidatedStorage, algorithm: str) -> list[LeafChecksumRecord]:
    records = []
    for key, start, nbytes in storage.leaf_ranges():
        hasher = new_hasher(algorithm)
        offset = 0
        while offset < nbytes:
            chunk = os.pread(storage._fd, min(CHUNK_BYTES, nbytes - offset), start + offset)
            if not chunk:
                break
            hasher.update(chunk)
            offset += len(chunk)
        records.append(
            LeafChecksumRecord(
                key=list(key),
                offset=start,
                size=nbytes,
                checksum=f"{algorithm}:{hasher.hexdigest()}",
            )
        )
    return records
