"""Opening object storage for reading: a plain prefix at a URL from one listing (a single
object there - a ``.tdz`` archive or a consolidated file - read whole into memory), a
committed step of an object-storage root from its commit record.

Both give an :class:`~tdckpt._read.object_storage.ObjectStorage` (or, for a single object,
the archive or consolidated reader over an anonymous in-memory file) that knows every file
of the prefix up front, with the bytes, sizes and checksums it must find; every message
names the URL and the object.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tdckpt._read.object_storage import ObjectStorage, Span, is_leaf
from tdckpt._read.storage import Storage
from tdckpt._remote.urls import is_url, require_local_options
from tdckpt._report import ProblemKind, VerifyProblem
from tdckpt.errors import (
    CheckpointNotFoundError,
    MetadataError,
    TdckptError,
    UnsafePathError,
)
from tdckpt.schema import MANIFEST_NAME, FileRecord, Manifest

if TYPE_CHECKING:
    from tdckpt._remote.layout import CommitRecord
    from tdckpt._remote.store import Store

__all__ = ["open_source", "open_step_storage", "open_url_storage"]


def _safe(rel: str, url: str) -> None:
    parts = rel.split("/")
    if "\x00" in rel or any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(
            f"{url}: the object {rel!r} has a name that would leave the prefix ('..', an "
            "empty or '.' component); refusing to read it.",
            path=f"{url}/{rel}",
        )


def _key(record: FileRecord) -> tuple[str, ...] | None:
    """The nested key a manifest records for a file, as a tuple."""
    return tuple(record.key) if record.key is not None else None


def _size(info: dict[str, Any]) -> int:
    size = info.get("size")
    return size if type(size) is int and size >= 0 else 0


def _open_single(store: Store) -> Storage:
    """The single object at the store's root - a ``.tdz`` archive or a consolidated file -
    read whole into an anonymous in-memory file (``memfd_create``: no path anywhere) and
    opened by the archive or consolidated reader, every message naming the URL. An archive
    is one zip whose index lies at its end, so it is not read by ranges."""
    from tdckpt._read.archive import ArchiveStorage
    from tdckpt._read.consolidated import open_consolidated

    memfd_create = getattr(os, "memfd_create", None)
    proc = "/proc/self/fd"
    if memfd_create is None or not os.path.isdir(proc):  # pragma: no cover - not Linux
        raise MetadataError(
            f"{store.url}: a single object (a .tdz archive or a consolidated file) is read "
            "in memory only on Linux. Download it (fsspec's get) and open the local file.",
            path=store.url,
        )
    data = store.cat("")
    fd = memfd_create("tdckpt-url", getattr(os, "MFD_CLOEXEC", 0))
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        del view, data
        # The readers open the file again (their own descriptor keeps it alive) and check
        # it as they check a local one.
        path = f"{proc}/{fd}"
        consolidated = open_consolidated(path, location=store.url)
        if consolidated is not None:
            return consolidated
        return ArchiveStorage(path, location=store.url)
    finally:
        os.close(fd)


def _is_object(store: Store) -> bool:
    """Whether the store's root is itself an object (not a prefix of objects)."""
    try:
        return bool(store._call("stat", "", lambda: store.fs.isfile(store.root)))
    except (OSError, TdckptError):
        return False


def open_url_storage(url: str, storage_options: dict[str, Any] | None) -> Storage:
    """The plain prefix at ``url`` (a folder of objects a tensordict save wrote), from one
    listing; checked against its ``tdckpt.manifest.json`` where it has a valid one. A single
    object there (a ``.tdz`` archive, a consolidated file) is read whole into memory and
    opened as the local file would be (see :func:`_open_single`).

    Raises:
        CheckpointNotFoundError: no object under the prefix.
        UnsafePathError: an object name that leaves the prefix, or is a file and a folder.
    """
    from tdckpt._remote.store import open_store

    store = open_store(url, storage_options)
    found = store.find("")
    if not found and _is_object(store):
        return _open_single(store)
    if not found:
        raise CheckpointNotFoundError(
            f"{store.url}: no objects under this prefix; pass the URL of a saved tensordict "
            "(the folder holding meta.json).",
            path=store.url,
        )
    for rel in found:
        _safe(rel, store.url)
    spans = {rel: Span(rel, 0, _size(info)) for rel, info in found.items()}
    storage = ObjectStorage(store, store.url, spans)
    storage.read_small_files()  # the manifest with the rest: one batch of reads
    raw = storage.peek(MANIFEST_NAME)
    if raw is not None:
        try:
            model = Manifest.model_validate_json(raw)
        except ValueError:  # pydantic's ValidationError: the read path reports it
            model = None
        if model is not None:
            for record in model.files:
                known = spans.get(record.path)
                if known is not None:
                    spans[record.path] = Span(
                        record.path, 0, known.size, record.checksum, _key(record)
                    )
            storage.check_ready()  # what was read ahead, against the manifest now known
    return storage


def open_source(
    prefix: str | os.PathLike[str], storage_options: dict[str, Any] | None
) -> str | os.PathLike[str] | Storage:
    """What the read path opens for ``prefix``: a URL's object storage
    (:func:`open_url_storage`), or the local prefix itself (refusing ``storage_options``)."""
    if is_url(prefix):
        return open_url_storage(str(prefix), storage_options)
    require_local_options(prefix, storage_options)
    return prefix


def open_step_storage(
    store: Store,
    url: str,
    record: CommitRecord,
    objects: Sequence[str],
    step: int,
    *,
    problems: list[VerifyProblem] | None = None,
) -> ObjectStorage:
    """A committed step of an object-storage root, for reading: the one call the step store
    makes. ``url`` names the step in every message; ``objects[i]`` is where the record's
    ``objects[i]`` lies (a path relative to the store's root: the caller resolves it, so a
    record may name objects of earlier steps); each file lies in its object at the offset
    the record gives and must match the record's manifest. One listing of each folder
    holding the step's objects first: an object gone or shorter than the record says is
    refused from its listed size, unread (a record is not trusted to size the reads).
    With ``problems`` (verify, a download of every file): nothing is read ahead, and the
    files of such objects are appended there instead of refused.

    Raises:
        IntegrityError: an object the step needs is gone or short ("step N is damaged").
    """
    damaged = f"{url}: step {step} is damaged in the store"
    if len(objects) != len(record.objects):
        raise ValueError(f"{url}: {len(objects)} object paths for {len(record.objects)} objects")
    files = {f.path: f for f in record.manifest.files}
    spans = {
        path: Span(
            objects[loc.object],
            loc.offset,
            files[path].size,
            files[path].checksum,
            _key(files[path]),
        )
        for path, loc in record.locations.items()
    }
    manifest = (record.manifest.model_dump_json(indent=1) + "\n").encode()
    storage = ObjectStorage(
        store, url, spans, inline={MANIFEST_NAME: manifest}, damaged=damaged, step=step
    )
    if problems is not None:
        problems += _listing_problems(record, objects, _list_objects(store, objects), files)
        return storage
    # The listing and the metadata reads go out together (one round trip less per restore):
    # metadata reads are capped, so no record can make them large; no leaf is read before
    # the listing has vouched for every object's size.
    read_error: TdckptError | None = None
    with ThreadPoolExecutor(1, "tdckpt-list") as pool:
        listing = pool.submit(_list_objects, store, objects)
        try:
            storage.read_small_files()
        except TdckptError as exc:
            read_error = exc
        listed = listing.result()
    found = _listing_problems(record, objects, listed, files)
    if any(not is_leaf(problem.path) for problem in found):
        raise storage.damage(found[0])  # metadata every restore reads
    # A leaf in a damaged object is refused when it is read: a selective restore that
    # leaves it out is not stopped by it (a whole restore reads it ahead, and stops).
    storage.hold_damage(found)
    if read_error is not None:
        raise read_error
    return storage


def _list_objects(store: Store, objects: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Every object in the folders that hold ``objects``: path -> info (one listing each)."""
    listed: dict[str, dict[str, Any]] = {}
    for folder in sorted({o.rpartition("/")[0] for o in objects}):
        listed.update({f"{folder}/{k}": v for k, v in store.find(folder).items()})
    return listed


def _listing_problems(
    record: CommitRecord,
    objects: Sequence[str],
    listed: dict[str, dict[str, Any]],
    files: dict[str, FileRecord],
) -> list[VerifyProblem]:
    """The files of objects that are gone or shorter than the record says."""
    problems = []
    for index, obj in enumerate(record.objects):
        info = listed.get(objects[index])
        held = None if info is None else info.get("size")
        if info is not None and (type(held) is not int or held >= obj.size):
            continue
        for path, loc in sorted(record.locations.items()):
            if loc.object != index:
                continue
            kind: ProblemKind
            if info is None:
                kind, found = "missing", f"no object {obj.name}"
            elif loc.offset + files[path].size > held:  # type: ignore[operator]
                kind = "short"
                found = f"object {obj.name} holds {held} bytes, the record says {obj.size}"
            else:
                continue
            size = f"{files[path].size} bytes"
            problems.append(VerifyProblem(path, _key(files[path]), kind, size, found))
    return problems
