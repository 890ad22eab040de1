"""A TorchRL replay buffer's tensordict storage, dumped and loaded by tdckpt.

:class:`TdckptStorageCheckpointer` (re-exported by :mod:`tdckpt.torchrl`) is a TorchRL
``StorageCheckpointerBase``: ``rb.dumps(path)`` writes the storage's tensordict as one tdckpt
checkpoint (checksummed, fsynced, renamed into place) with its row count in the manifest;
``rb.loads(path)`` verifies the dump and checks it fits the buffer before a row is copied
in. Needs ``torchrl``.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase

from tdckpt._interop.torchrl_payload import payload_manifest, verify_payload
from tdckpt._restore.engine import load_local
from tdckpt._write.export import save as _save_prefix
from tdckpt.errors import MetadataError, RestoreError, UnsupportedContentError

__all__ = ["STORAGE_METADATA", "TdckptStorageCheckpointer"]

#: The key of the tdckpt manifest's ``user_metadata`` that holds a storage's row count.
STORAGE_METADATA = "torchrl_storage"


class TdckptStorageCheckpointer(StorageCheckpointerBase):  # type: ignore[misc,unused-ignore]
    """A replay buffer's tensordict storage dumped and loaded by tdckpt.

    ``ReplayBuffer(storage=LazyMemmapStorage(n), checkpointer=TdckptStorageCheckpointer())``
    (or ``LazyTensorStorage``, ``TensorStorage``): ``rb.dumps(path)`` writes
    ``path/storage`` as one tdckpt checkpoint (every file checksummed and fsynced, renamed
    into place, replacing the previous dump atomically; the number of valid rows in its
    manifest), and ``rb.loads(path)`` verifies it, checks its keys, shapes and dtypes against
    the buffer's storage, and only then copies it in: a damaged or mismatched dump raises a
    tdckpt error naming the file, the buffer unchanged. The buffer keeps its own memory
    (a ``LazyMemmapStorage`` its scratch files), so later writes never reach the dump.

    Args:
        allow_pickle: whether :meth:`loads` loads pickled non-tensor data.
        fsync: make the dump durable before it is renamed into place.
        verify: before loading, re-read every file against the dump's checksums.
    """

    def __init__(
        self, *, allow_pickle: bool = False, fsync: bool = True, verify: bool = True
    ) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        self.fsync = fsync
        self.verify = verify

    def _no_hooks(self, path: Path) -> None:
        if self._save_hooks or self._load_hooks:
            raise UnsupportedContentError(
                f"{path}: TdckptStorageCheckpointer does not run storage save/load hooks "
                "(they rewrite the data in a layout of their own); nothing was done. Use "
                "TorchRL's checkpointer for a buffer with hooks.",
                path=str(path),
            )

    def dumps(self, storage: Any, path: str | os.PathLike[str]) -> None:
        """Write the storage's tensordict and row count to ``path`` (atomically, replacing)."""
        from tensordict import is_tensor_collection

        dest = Path(path)
        self._no_hooks(dest)
        data = getattr(storage, "_storage", None)
        if not getattr(storage, "initialized", False) or not is_tensor_collection(data):
            raise UnsupportedContentError(
                f"{dest}: the {type(storage).__name__} holds no tensordict yet (an empty lazy "
                "storage, or a storage of plain tensors); nothing was written. Extend the "
                "buffer first, or use TorchRL's checkpointer for a pytree storage.",
                path=str(dest),
            )
        metadata = {STORAGE_METADATA: {"len": int(storage._len), "type": type(storage).__name__}}
        _save_prefix(data, dest, metadata=metadata, overwrite=True, fsync=self.fsync)

    def loads(self, storage: Any, path: str | os.PathLike[str]) -> None:
        """Verify the dump at ``path``, check it fits ``storage``, then copy it in.

        Raises:
            tdckpt.errors.IntegrityError: a file differs from what was dumped.
            tdckpt.errors.RestoreError: the dump's keys, shapes or dtypes differ from the
                storage's (every difference listed), or its row count is missing.
        """
        src = Path(path)
        self._no_hooks(src)
        where = f"replay buffer storage {src}"
        manifest = payload_manifest(src, where)
        initialized = bool(getattr(storage, "initialized", False))
        if self.verify and initialized:  # the data is copied into the live storage: check first
            verify_payload(src, manifest, where)
        meta = manifest.user_metadata.get(STORAGE_METADATA)
        rows = meta.get("len") if isinstance(meta, dict) else None
        if type(rows) is not int or rows < 0:
            raise MetadataError(
                f"{where}: its manifest records no row count ({STORAGE_METADATA!r}); it was not "
                "dumped by TdckptStorageCheckpointer. Load it with TorchRL's checkpointer.",
                path=str(src),
            )
        loaded = load_local(
            src, robust_key=True, allow_pickle=self.allow_pickle, mode="r", manifest_checked=True
        )
        capacity = getattr(storage, "max_size", None)
        problems: list[str] = []
        if initialized:
            problems = _differences(storage._storage, loaded)
        elif capacity is not None and loaded.batch_size[:1] != torch.Size([capacity]):
            problems = [
                f"the dump's batch size is {list(loaded.batch_size)}, the storage holds "
                f"{capacity} rows"
            ]
        if rows > (loaded.batch_size[0] if loaded.batch_dims else 0):
            problems.append(f"the row count {rows} exceeds the dump's {loaded.batch_size}")
        if problems:
            raise RestoreError(
                f"{where}: does not fit this {type(storage).__name__}; nothing was loaded:\n  "
                + "\n  ".join(problems),
                path=str(src),
                problems=problems,
            )
        if initialized:
            storage._storage.update_(loaded)
        elif not self.verify:
            storage._init(loaded[0])
            storage._storage.update_(loaded)
        else:
            # An empty storage gets its tensordict while the checksums are read (the copy
            # and the hashing overlap); on any failure it is put back as it was: empty.
            before = dict(storage.__dict__)
            scratch = getattr(storage, "scratch_dir", None)
            existing = _files_under(scratch)
            with ThreadPoolExecutor(1, thread_name_prefix="tdckpt-verify") as pool:
                pending = pool.submit(verify_payload, src, manifest, where)
                try:
                    storage._init(loaded[0])
                    storage._storage.update_(loaded)
                    pending.result()
                except BaseException:
                    storage.__dict__.clear()
                    storage.__dict__.update(before)
                    _remove_new_files(scratch, existing)  # a LazyMemmapStorage's _init wrote them
                    raise
        storage._len = rows


def _files_under(root: Any) -> set[str]:
    """Every file and folder under ``root`` (``root`` itself included), or none."""
    if not root or not os.path.isdir(root):
        return set()
    found = {os.fspath(root)}
    for d, dirs, files in os.walk(root):
        found.update(os.path.join(d, name) for name in (*dirs, *files))
    return found


def _remove_new_files(root: Any, existing: set[str]) -> None:
    """Remove what appeared under ``root`` since ``existing`` was listed, deepest first."""
    for path in sorted(_files_under(root) - existing, key=len, reverse=True):
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)  # empty by now: its new files went first
            else:
                os.unlink(path)


def _differences(live: Any, saved: Any) -> list[str]:
    """Keys, shapes and dtypes where the storage's tensordict and the dump differ."""
    mine = {k: v for k, v in live.items(include_nested=True, leaves_only=True)}
    theirs = {k: v for k, v in saved.items(include_nested=True, leaves_only=True)}
    problems = [f"{_key(k)}: in the storage, not in the dump" for k in mine if k not in theirs]
    problems += [f"{_key(k)}: in the dump, not in the storage" for k in theirs if k not in mine]
    for key in mine.keys() & theirs.keys():
        a, b = mine[key], theirs[key]
        tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        if tensors and (a.shape != b.shape or a.dtype != b.dtype):
            problems.append(f"{_key(key)}: the storage has {_describe(a)}, the dump {_describe(b)}")
    if live.batch_size != saved.batch_size:
        problems.append(
            f"batch size: the storage {list(live.batch_size)}, the dump {list(saved.batch_size)}"
        )
    return sorted(problems)


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _key(key: Any) -> str:
    return ".".join(key) if isinstance(key, tuple) else str(key)
