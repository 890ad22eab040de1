"""Incremental steps in object storage: a record refers to an earlier step's object.

An incremental save (``CheckpointManager("s3://...", incremental=True)``) plans its objects
as any save (:func:`tdckpt._remote.transfer.plan_objects`: a large file is an object of its
own, small ones are packed). Each object that holds one file whose path, size and checksum
equal those of the latest committed step's file - itself a whole object of that step - is
not uploaded: the new record names that object, under the attempt prefix that holds it
(``ObjectRecord.prefix``; a record with such objects is commit record version 2). Packs of
small files are always uploaded (cheap, and never shared).

References are counted across every committed record: retention deletes a step's record,
then only the objects of its attempt that no remaining record names; ``gc`` keeps, in an
attempt no record names any more, the objects another record names. A record tdckpt cannot
parse (a newer writer's, a damaged one) protects every attempt prefix its bytes mention:
nothing it might name is deleted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tdckpt._remote.encode import EncodedFile
from tdckpt._remote.layout import (
    MAX_RECORD_BYTES,
    CommitRecord,
    ObjectRecord,
    attempt_name,
    commit_name,
    parse_attempt,
)
from tdckpt._remote.store import Store
from tdckpt.errors import TdckptError

__all__ = [
    "Protected",
    "mentioned_attempts",
    "orphaned_objects",
    "protected",
    "referenced_objects",
    "remove_attempt",
    "share_objects",
    "shared_file_bytes",
]

#: An attempt prefix's name inside a record's raw bytes (parseable or not).
_ATTEMPT_TEXT = re.compile(rb"(?:0|[1-9][0-9]{0,3999})\.attempt-[0-9a-f]{32}")


def share_objects(
    store: Store,
    base: CommitRecord | None,
    files: list[EncodedFile],
    objects: list[ObjectRecord],
    members: list[list[str]],
    algorithm: str,
) -> tuple[list[ObjectRecord], dict[str, str], dict[str, dict[str, Any]]]:
    """``objects`` with every object the ``base`` record already holds replaced by a
    reference to it, the checksums of the files of those objects (path -> checksum), and
    the listings of the prefixes that hold them (the commit's check reuses them).

    An object qualifies when it holds one file, the base's file of the same path is a whole
    object of its own, the store holds that object with the size the base's record gives
    (one listing per prefix), and the sizes and checksums (of the save's algorithm; computed
    here over the bytes to upload, on one thread per core) are equal. An object the base
    names but the store lacks (a damaged base) is uploaded again: a damaged step never
    makes the saves after it fail.
    """
    if base is None:
        return objects, {}, {}
    old_files = {f.path: f for f in base.manifest.files}
    by_rel = {f.rel: f for f in files}
    prefix = f"{algorithm}:"
    candidates: list[tuple[int, str, ObjectRecord]] = []
    for index, rels in enumerate(members):
        if len(rels) != 1:
            continue
        rel = rels[0]
        old = old_files.get(rel)
        new = by_rel[rel]
        if old is None or old.key is None or new.key is None or old.size != new.size:
            continue
        if old.checksum is None or not old.checksum.startswith(prefix):
            continue
        loc = base.locations[rel]
        obj = base.objects[loc.object]
        if loc.offset != 0 or obj.size != new.size:
            continue  # packed with other files in the base: not shared
        held = obj.prefix or attempt_name(base.step, base.attempt)
        candidates.append((index, rel, ObjectRecord(name=obj.name, size=obj.size, prefix=held)))
    if not candidates:
        return objects, {}, {}
    threads = max(1, min(len(candidates), os.cpu_count() or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="tdckpt-prehash") as pool:
        digests = list(pool.map(lambda c: by_rel[c[1]].checksum(algorithm), candidates))
    equal = [
        (c, digest)
        for c, digest in zip(candidates, digests, strict=True)
        if digest == old_files[c[1]].checksum
    ]
    # the objects the equal files would refer to, checked in the store (one listing each)
    listings = {str(ref.prefix): store.find(str(ref.prefix)) for (_, _, ref), _ in equal}
    out = list(objects)
    sums: dict[str, str] = {}
    for (index, rel, ref), digest in equal:
        if listings[str(ref.prefix)].get(ref.name, {}).get("size") == ref.size:
            out[index] = ref
            sums[rel] = digest
    return out, sums, listings


def referenced_objects(records: Iterable[CommitRecord]) -> dict[str, set[str]]:
    """attempt prefix -> names of its objects that the records name (their own attempts'
    objects and the earlier steps' objects they refer to)."""
    named: dict[str, set[str]] = {}
    for record in records:
        for index in range(len(record.objects)):
            where, _, name = record.object_path(index).rpartition("/")
            named.setdefault(where, set()).add(name)
    return named


def mentioned_attempts(raw: bytes) -> set[str]:
    """Every attempt prefix a record's raw bytes mention (for a record tdckpt cannot parse:
    what it might name is kept)."""
    return {m.decode("ascii") for m in _ATTEMPT_TEXT.findall(raw)}


#: What deletions must keep: attempt prefix -> object names some record names, and the
#: attempt prefixes a record tdckpt cannot parse mentions (None: keep every attempt).
Protected = tuple[dict[str, set[str]], set[str] | None]


def protected(
    store: Store, committed: dict[int, CommitRecord], damaged: Iterable[int]
) -> Protected:
    """What no deletion may touch, given the root's committed records and damaged steps."""
    named = referenced_objects(committed.values())
    mentioned: set[str] = set()
    for step in damaged:
        try:
            raw = store.cat_capped(commit_name(step), MAX_RECORD_BYTES, "commit record")
        except FileNotFoundError:
            continue  # deleted since the listing
        except (OSError, TdckptError):
            return named, None  # unreadable: it might name anything
        mentioned |= mentioned_attempts(raw)
    return named, mentioned


def orphaned_objects(
    retired: Iterable[Any],
    own: Collection[str],
    remaining: dict[int, CommitRecord],
    keep: Protected,
) -> list[tuple[str, tuple[str, ...]]]:
    """``(attempt, object names)`` of earlier attempts whose objects only the ``retired``
    commit records (their own attempts ``own``) named: an incremental record names objects
    of an earlier step's attempt, which stay while a record names them. Attempts of the
    ``remaining`` records, and any a record that cannot be read may name, are left alone."""
    live = {attempt_name(s, r.attempt) for s, r in remaining.items()}
    earlier: dict[str, set[str]] = {}
    for record in retired:
        for obj in getattr(record, "objects", ()):
            prefix = obj.prefix
            if (
                prefix
                and prefix not in live
                and prefix not in own
                and parse_attempt(prefix) is not None
            ):
                earlier.setdefault(prefix, set()).add(obj.name)
    named, mentioned = keep
    out = []
    for name, held in sorted(earlier.items()):
        if mentioned is None or name in mentioned:
            continue  # a record that cannot be read may name them: left for gc
        orphaned = tuple(sorted(held - named.get(name, set())))
        if orphaned:
            out.append((name, orphaned))
    return out


def remove_attempt(store: Store, name: str, keep: Protected) -> bool:
    """Delete the objects of attempt ``name`` that nothing in ``keep`` names; True when the
    whole attempt went."""
    named, mentioned = keep
    if mentioned is None or name in mentioned:
        return False
    kept = named.get(name)
    if not kept:
        store.rm_tree(name)
        return True
    doomed = [f"{name}/{obj}" for obj in store.find(name) if obj not in kept]
    if doomed:
        store.rm_files(doomed)
    return False


def shared_file_bytes(committed: dict[int, CommitRecord]) -> dict[int, int]:
    """``step -> bytes of its files lying in objects another record names too``."""
    owners: dict[str, int] = {}
    for record in committed.values():
        for where in {record.object_path(i) for i in range(len(record.objects))}:
            owners[where] = owners.get(where, 0) + 1
    return {
        step: sum(
            f.size
            for f in record.manifest.files
            if owners[record.object_path(record.locations[f.path].object)] > 1
        )
        for step, record in committed.items()
    }
