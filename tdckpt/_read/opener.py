"""Open a checkpoint prefix as the :class:`~tdckpt._read.storage.Storage` that can read it.

The one place that knows every local layout: a directory (:class:`DirectoryStorage`), a
``.tdz`` zip archive (:class:`ArchiveStorage`) or a consolidated file
(:class:`~tdckpt._read.consolidated.ConsolidatedStorage`). It sits above the
implementations, so none imports another.
"""

from __future__ import annotations

import os
from pathlib import Path

from tdckpt._read.archive import ArchiveStorage
from tdckpt._read.consolidated import DATA_NAME, open_consolidated
from tdckpt._read.directory import DirectoryStorage
from tdckpt._read.storage import Storage
from tdckpt.errors import CheckpointNotFoundError

__all__ = ["open_storage"]


def open_storage(prefix: str | os.PathLike[str], *, defer_leaf_sizes: bool = False) -> Storage:
    """Open a checkpoint prefix: a directory, a ``.tdz`` zip archive, or a consolidated file
    (``td.consolidate(filename=...)``, see ``consolidated.py``).

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
        data = os.path.join(prefix, DATA_NAME)
        if os.path.lexists(data) and not os.path.lexists(os.path.join(prefix, "meta.json")):
            # A step saved with layout="consolidated": its one data file, never through a
            # link (a directory's entries stay inside it).
            try:
                consolidated = open_consolidated(data, follow=False, manifest_dir=os.fspath(prefix))
            except BaseException:
                scan.close()
                raise
            if consolidated is not None:
                scan.close()
                return consolidated
        return DirectoryStorage(prefix, defer_leaf_sizes=defer_leaf_sizes, _scan=scan)
    if os.path.isdir(prefix):
        return DirectoryStorage(prefix, defer_leaf_sizes=defer_leaf_sizes)
    path = Path(prefix)
    if path.is_file():
        consolidated = open_consolidated(path)
        if consolidated is not None:
            return consolidated
        return ArchiveStorage(path)
    raise CheckpointNotFoundError(
        f"{path}: no checkpoint here (neither a directory nor a .tdz archive). Check the "
        "path; a checkpoint is the directory that holds meta.json, or a .tdz file.",
        path=str(path),
    )
