"""Uploading a step's files into an attempt prefix.

The files of the step, planned as a local save plans them
(:mod:`tdckpt._remote.encode`), go up concurrently from memory - large ones as objects of
their own, small ones packed back to back (:data:`~tdckpt._remote.layout.PACK_FILE_MAX`) -
each file's checksum computed over the bytes as they are sent.

Reading a step back is :mod:`tdckpt._read.object_storage`'s (ranged, checked reads).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tdckpt._remote.encode import EncodedFile
from tdckpt._remote.layout import (
    PACK_FILE_MAX,
    PACK_TARGET,
    Location,
    ObjectRecord,
)
from tdckpt._remote.store import STREAM_ABOVE, Store
from tdckpt.errors import IntegrityError
from tdckpt.schema import FileRecord

__all__ = ["check_uploaded", "plan_objects", "upload_encoded"]

#: Concurrent uploads.
UPLOAD_THREADS = 16


def plan_objects(
    files: list[FileRecord],
) -> tuple[list[ObjectRecord], dict[str, Location], list[list[str]]]:
    """Objects (name, size), each file's location, and each object's files in order."""
    groups: list[list[FileRecord]] = []  # large files alone, small ones in packs
    pack: list[FileRecord] = []
    pack_size = 0
    for record in sorted(files, key=lambda f: f.path):
        if record.size > PACK_FILE_MAX:
            groups.append([record])
            continue
        if pack and pack_size + record.size > PACK_TARGET:
            groups.append(pack)
            pack, pack_size = [], 0
        pack.append(record)
        pack_size += record.size
    if pack:
        groups.append(pack)
    objects: list[ObjectRecord] = []
    locations: dict[str, Location] = {}
    for index, group in enumerate(groups):
        offset = 0
        for record in group:
            locations[record.path] = Location(object=index, offset=offset)
            offset += record.size
        objects.append(ObjectRecord(name=f"data-{index}", size=offset))
    return objects, locations, [[r.path for r in g] for g in groups]


def upload_encoded(
    store: Store,
    prefix: str,
    files: list[EncodedFile],
    objects: list[ObjectRecord],
    members: list[list[str]],
    algorithm: str,
) -> dict[str, str]:
    """Upload each object (concurrently) from memory, hashing each file's bytes on the way;
    return path -> checksum. Any failure raises after the other uploads stop."""
    by_rel = {f.rel: f for f in files}
    sums: dict[str, str] = {}

    def one(index: int) -> None:
        if objects[index].prefix is not None:
            return  # an earlier step's object (an incremental save): nothing to upload
        parts: list[memoryview] = []
        for rel in members[index]:
            sums[rel] = by_rel[rel].checksum(algorithm)  # uploads hash in parallel
            parts += by_rel[rel].parts
        rel = f"{prefix}/{objects[index].name}"
        if objects[index].size > STREAM_ABOVE:
            store.put_parts(rel, parts)  # a large leaf: streamed, never copied whole
            return
        store.put_bytes(rel, parts[0].tobytes() if len(parts) == 1 else b"".join(parts))

    _run_all(one, len(objects))
    return sums


def _run_all(fn: Callable[[int], None], n: int) -> None:
    if n <= 1:
        for i in range(n):
            fn(i)
        return
    with ThreadPoolExecutor(min(UPLOAD_THREADS, n), "tdckpt-upload") as pool:
        futures = [pool.submit(fn, i) for i in range(n)]
        errors = [exc for f in futures if (exc := f.exception()) is not None]
    if errors:
        raise errors[0]


def check_uploaded(
    store: Store,
    prefix: str,
    objects: list[ObjectRecord],
    listed: dict[str, dict[str, dict[str, Any]]] | None = None,
) -> None:
    """One listing per prefix: every object is there with its size (a store that
    acknowledged a short write, or an earlier step's object that is gone, is caught here,
    before the commit). ``listed``: listings of earlier steps' prefixes the save made
    already, under the writer lock that keeps them (an incremental save's base)."""
    listings: dict[str, dict[str, dict[str, Any]]] = dict(listed or {})
    for obj in objects:
        where = obj.prefix or prefix
        if where not in listings:
            listings[where] = store.find(where)
        info = listings[where].get(obj.name)
        size = None if info is None else info.get("size")
        if size != obj.size:
            what = "uploaded" if obj.prefix is None else "an earlier step's object of"
            raise IntegrityError(
                f"{store.show(where + '/' + obj.name)}: {what} {obj.size} bytes but the store "
                f"holds {'nothing' if info is None else f'{size} bytes'}; the step was not "
                "committed. Retry the save.",
                path=store.show(where + "/" + obj.name),
            )
