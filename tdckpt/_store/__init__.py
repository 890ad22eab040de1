"""The store layer: where numbered steps live and how they are committed (see ``base``).

:func:`open_step_store` is the one place that tells a local folder from an object-storage
URL; everything above it asks the store's :class:`~tdckpt._store.base.Capabilities`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from tdckpt._remote.urls import is_url, require_local_options
from tdckpt._store.base import Attempt, Capabilities, StepRecord, StepStore

__all__ = ["Attempt", "Capabilities", "StepRecord", "StepStore", "open_step_store"]


def open_step_store(
    root: str | os.PathLike[str],
    *,
    state: threading.RLock,
    manager_id: str,
    archive: bool,
    fsync: bool,
    checksum: str,
    compression: str,
    layout: str,
    storage_options: dict[str, Any] | None,
    lease_ttl: float | None,
    cache_dir: str | os.PathLike[str] | None,
) -> StepStore:
    """The step store of ``root``: a local folder, or an fsspec URL in object storage.

    Refuses (ValueError, before anything is created) the options that mean nothing for
    that kind of root, naming the root and what to drop.
    """
    if not is_url(root):
        require_local_options(root, storage_options)
        for name, value in (("lease_ttl", lease_ttl), ("cache_dir", cache_dir)):
            if value is not None:
                raise ValueError(
                    f"{root}: {name} is for object-storage roots (s3://..., memory://...); a "
                    f"local root is guarded by a file lock and read in place. Drop {name}."
                )
        from tdckpt._store.local import LocalStepStore

        return LocalStepStore(
            Path(root),
            state=state,
            manager_id=manager_id,
            archive=archive,
            fsync=fsync,
            checksum=checksum,
            compression=compression,
            layout=layout,
        )
    url = str(root)
    if archive:
        raise ValueError(
            f"{url}: archive=True is for local roots; a step in object storage is already "
            "packed into a few objects. Drop archive=True."
        )
    if compression != "stored":
        raise ValueError(f"{url}: compression applies to archives only (local roots).")
    if layout != "memmap":
        raise ValueError(
            f"{url}: layout={layout!r} is for local roots; a step in object storage is "
            "packed into a few objects already. Drop layout=."
        )
    from tdckpt._store.objects import ObjectStepStore

    return ObjectStepStore(
        url,
        storage_options=storage_options,
        state=state,
        manager_id=manager_id,
        checksum=checksum,
        lease_ttl=lease_ttl,
        cache_dir=cache_dir,
    )
