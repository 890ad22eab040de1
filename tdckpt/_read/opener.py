"""Open a checkpoint prefix as the :class:`~tdckpt._read.storage.Storage` that can read it.

The one place that knows every local layout: a directory (:class:`DirectoryStorage`) or a
``.tdz`` zip archive (:class:`ArchiveStorage`). It sits above both implementations, so
neither imports the other.
"""

from __future__ import annotations

import os
from pathlib import Path

from tdckpt._read.archive import ArchiveStorage
from tdckpt._read.storage import DirectoryStorage, Storage
from tdckpt.errors import CheckpointNotFoundError

__all__ = ["open_storage"]


def open_storage(prefix: str | os.PathLike[str], *, defer_leaf_sizes: bool = False) -> Storage:
    """Open a checkpoint prefix: a directory, or a ``.tdz`` zip archive.

    ``defer_leaf_sizes``: a restore's open - a directory lists its ``*.memmap`` files
    without a stat (their sizes :data:`~tdckpt._read.storage.UNKNOWN_SIZE`; see
    :class:`DirectoryStorage`).
    """
    try:
        # Listing the prefix is the first thing a read does: opening it here tells a
        # directory from an archive without a separate stat.
        scan = os.scandir(prefix)
    except OSError:
        pass  # not a directory (or not listable: the reader says so when it lists it)
    else:
        return DirectoryStorage(prefix, defer_leaf_sizes=defer_leaf_sizes, _scan=scan)
    if os.path.isdir(prefix):
        return DirectoryStorage(prefix, defer_leaf_sizes=defer_leaf_sizes)
    path = Path(prefix)
    if path.is_file():
        return ArchiveStorage(path)
    raise CheckpointNotFoundError(
        f"{path}: no checkpoint here (neither a directory nor a .tdz archive). Check the "
        "path; a checkpoint is the directory that holds meta.json, or a .tdz file.",
        path=str(path),
    )
