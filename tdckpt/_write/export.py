"""``tdckpt.save``: write one bare prefix (directory or ``.tdz``) atomically.

The manager's steps use the same writer and commit protocol; this is the function for a
single prefix outside a managed root, e.g. to hand a checkpoint to plain tensordict
users. What it writes, tensordict 0.15.3's ``TensorDict.load_memmap`` loads (the manifest
is an extra file tensordict ignores).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from tdckpt._write.atomic import fsync_dir, rename_noreplace
from tdckpt._write.save import write_checkpoint
from tdckpt.errors import CheckpointExistsError
from tdckpt.schema import Manifest

__all__ = ["save"]


def save(
    obj: Any,
    prefix: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    fsync: bool = True,
) -> Manifest:
    """Save a TensorDict (or tensorclass, lazy stack) to ``prefix``, all or nothing.

    The checkpoint is written into a temporary folder beside ``prefix``, fsynced, and
    renamed into place, so ``prefix`` either holds the whole checkpoint or is untouched.
    A ``prefix`` ending in ``.tdz`` becomes a tensordict-compatible zip archive.

    Args:
        obj: what to save.
        prefix: the destination directory, or ``*.tdz`` file.
        metadata: JSON data stored in tdckpt's manifest (``user_metadata``).
        overwrite: replace an existing ``prefix`` instead of refusing.
        fsync: make the data durable before the commit (on by default).

    Returns:
        The manifest written (sizes and checksums of every file).

    Raises:
        tdckpt.errors.CheckpointExistsError: ``prefix`` exists and overwrite is False.
    """
    dest = Path(prefix)
    if dest.exists() and not overwrite:
        raise CheckpointExistsError(
            f"{dest}: already exists. Pass overwrite=True to replace it, or choose another prefix.",
            path=str(dest),
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        manifest = write_checkpoint(obj, staging, user_metadata=metadata, fsync=fsync)
        if dest.suffix == ".tdz":
            from tdckpt._read.archive import write_archive

            if dest.exists() and not overwrite:
                raise CheckpointExistsError(f"{dest}: appeared while saving; not replaced.", path=str(dest))
            write_archive(staging, dest, fsync=fsync)  # temp file + os.replace: atomic
            return manifest
        if overwrite and dest.exists():
            old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:12]}"
            os.rename(dest, old)
            os.rename(staging, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            rename_noreplace(staging, dest)
        if fsync:
            fsync_dir(dest.parent)
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)
