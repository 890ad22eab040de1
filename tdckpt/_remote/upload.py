"""A plain tensordict prefix in object storage: what ``tdckpt.save(obj, url)`` writes.

The checkpoint is first written, with every check of a local save, into a private local
folder; then each of its files is uploaded as the object of the same relative name under
the URL - leaf files and nested ``meta.json`` first, tdckpt's manifest next, the root
``meta.json`` last. Until that last object exists no reader takes the prefix for a
checkpoint (``tdckpt.load_memmap(url)`` finds no ``meta.json``); from then on every file is
read checked against the manifest (:mod:`tdckpt._read.object_storage`).

A ``.tdz`` archive is one object, uploaded by one request (all or nothing).

Object storage has no atomic rename, so an existing prefix is never replaced or cleaned: a
save to a URL that already holds objects is refused before anything is written, and a save
that fails part-way names the objects it left (without the root ``meta.json``) for the user
to delete. Steps that must be replaced or retried atomically belong in a
:class:`~tdckpt.CheckpointManager` on the URL (a commit record per step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tdckpt._remote.store import Store, open_store
from tdckpt.errors import CheckpointExistsError, RemoteError, TdckptError
from tdckpt.schema import MANIFEST_NAME

__all__ = ["empty_prefix", "upload_prefix"]

_ROOT_META = "meta.json"


def empty_prefix(url: str, storage_options: dict[str, Any] | None) -> Store:
    """The store at ``url``, refused unless nothing lies under it yet.

    Raises:
        CheckpointExistsError: objects already lie under ``url`` (nothing is replaced).
    """
    store = open_store(url, storage_options)
    found = store.find("")
    if not found and store._call("stat", "", lambda: store.fs.isfile(store.root)):
        raise CheckpointExistsError(
            f"{store.url}: an object already lies at this URL; object storage cannot replace "
            "it all or nothing with a checkpoint, so nothing was written. Delete it first "
            "(fsspec: fs.rm(url)) or save to a new URL.",
            path=store.url,
        )
    if found:
        first = sorted(found)[:3]
        raise CheckpointExistsError(
            f"{store.url}: {len(found)} object(s) already lie under this prefix (e.g. "
            f"{', '.join(first)}); object storage cannot replace a prefix all or nothing, so "
            "nothing was written. Delete the prefix first (fsspec: fs.rm(url, "
            "recursive=True)), save to a new URL, or use CheckpointManager(url).save(step, "
            "obj) for steps committed atomically.",
            path=store.url,
        )
    return store


def upload_prefix(store: Store, local: Path) -> None:
    """Upload the checkpoint folder ``local`` under ``store``'s URL, root ``meta.json`` last
    (a ``.tdz`` archive file: as the one object at the URL).

    Raises:
        RemoteError: an upload kept failing; the message names what was left behind.
    """
    if local.is_file():  # one object: a PUT is all or nothing
        try:
            store.put_file(str(local), "")
        finally:
            store.invalidate()
        return
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    last = [name for name in (MANIFEST_NAME, _ROOT_META) if name in files]
    order = [name for name in files if name not in last] + last
    done: list[str] = []
    try:
        for rel in order:
            store.put_file(str(local / rel), rel)
            done.append(rel)
    except TdckptError as exc:
        left = (
            f"{len(done)} object(s) were uploaded without the root meta.json (no reader "
            "takes them for a checkpoint); delete the prefix (fs.rm(url, recursive=True)) "
            "before saving there again"
            if done
            else "nothing was uploaded"
        )
        raise RemoteError(
            f"{store.url}: tdckpt.save could not upload {rel} ({exc}); {left}.",
            path=store.url,
            key=rel,
        ) from exc
    finally:
        store.invalidate()
