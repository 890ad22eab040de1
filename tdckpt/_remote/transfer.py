"""Moving a step's files between a local folder and an attempt prefix.

Upload: the files of the step, planned as a local save plans them
(:mod:`tdckpt._remote.encode`), go up concurrently from memory - large ones as objects of
their own, small ones packed back to back (:data:`~tdckpt._remote.layout.PACK_FILE_MAX`) -
each file's checksum computed over the bytes as they are sent.

Download: ranged reads of exactly each file's bytes, issued together (``cat_ranges``:
concurrent on s3fs), in bounded batches; each file's checksum is computed over the bytes as
they arrive and compared with the manifest before the file counts as read. A mismatch is
read once more (a transfer glitch), then reported as an
:class:`~tdckpt.errors.IntegrityError` naming the file and its key; nothing is restored from
a step that fails."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tdckpt._manage.verify import VerifyProblem, VerifyReport
from tdckpt._remote.encode import EncodedFile
from tdckpt._remote.layout import (
    PACK_FILE_MAX,
    PACK_TARGET,
    CommitRecord,
    Location,
    ObjectRecord,
)
from tdckpt._remote.store import STREAM_ABOVE, Store
from tdckpt._write.checksum import new_hasher
from tdckpt.errors import IntegrityError
from tdckpt.schema import MANIFEST_NAME, FileRecord, Manifest

__all__ = ["check_uploaded", "download_step", "plan_objects", "upload_encoded"]

#: Bytes per ranged read, and bytes in flight per batch of ranged reads.
RANGE_BYTES = 16 << 20
BATCH_BYTES = 128 << 20
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
            h = new_hasher(algorithm)
            for part in by_rel[rel].parts:
                h.update(part)  # zlib / hashlib release the GIL: uploads hash in parallel
            sums[rel] = f"{algorithm}:{h.hexdigest()}"
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


def check_uploaded(store: Store, prefix: str, objects: list[ObjectRecord]) -> None:
    """One listing per prefix: every object is there with its size (a store that
    acknowledged a short write, or an earlier step's object that is gone, is caught here,
    before the commit)."""
    listings: dict[str, dict[str, dict[str, Any]]] = {}
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


def _key(record: FileRecord) -> tuple[str, ...] | None:
    return tuple(record.key) if record.key is not None else None


def download_step(
    store: Store,
    prefix: str,
    record: CommitRecord,
    dest: Path | None,
    *,
    step: int,
    progress: Callable[[int, int], None] | None = None,
    report: VerifyReport | None = None,
    seen: dict[str, str] | None = None,
) -> int:
    """Read every file of the step into ``dest`` (a new folder; None: only check them,
    as ``verify`` does, writing nothing), verifying checksums.

    Each object is read whole, in ranges of RANGE_BYTES issued together (a pack of small
    files costs one request, not one per file); batches of objects stay under
    BATCH_BYTES in flight, the next batch downloading while this one is hashed and
    written. With ``report`` given, problems are appended to it instead of raised
    (``verify``); otherwise the first bad file raises :class:`IntegrityError`. Returns
    the bytes read.

    ``seen`` (with ``report``: verifying several steps): object path -> the checksum read
    for the one file it holds. An object another step of the same verification read (an
    incremental step's reference) is not read again: its file is compared with that
    checksum (``report.shared_checked``).
    """
    manifest: Manifest = record.manifest
    by_object: dict[int, list[FileRecord]] = {}
    for f in manifest.files:
        by_object.setdefault(record.locations[f.path].object, []).append(f)
    for files in by_object.values():
        files.sort(key=lambda f: record.locations[f.path].offset)
    if seen is not None and report is not None:
        for index in list(by_object):
            known = seen.get(record.object_path(index))
            files = by_object[index]
            if known is None or len(files) != 1:
                continue
            del by_object[index]  # read once already, for another step
            report.files_checked += 1
            report.shared_checked += 1
            f = files[0]
            if known != f.checksum:
                report.problems.append(VerifyProblem(f.path, _key(f), "changed", f.checksum, known))
    total = sum(f.size for f in manifest.files)
    done = 0
    if dest is not None:
        dest.mkdir(parents=True, exist_ok=False)
        for d in sorted({str(Path(f.path).parent) for f in manifest.files} - {"."}):
            (dest / d).mkdir(parents=True, exist_ok=True)

    def spans(index: int) -> list[tuple[str, int, int]]:
        files = by_object[index]
        rel = record.object_path(index)
        start = record.locations[files[0].path].offset
        end = max(record.locations[f.path].offset + f.size for f in files)
        return [(rel, s, min(s + RANGE_BYTES, end)) for s in range(start, end, RANGE_BYTES)]

    def problem(f: FileRecord, kind: str, expected: str, found: str) -> None:
        p = VerifyProblem(f.path, _key(f), kind, expected, found)  # type: ignore[arg-type]
        if report is not None:
            report.problems.append(p)
            return
        raise IntegrityError(
            f"{store.show(prefix)}: step {step} is damaged in the store: {p}; nothing was "
            "restored and the target is unchanged. Restore another step (see steps()), or "
            "re-save this one.",
            path=store.show(prefix),
            step=step,
            problems=[p],
        )

    # One listing first: an object that is gone or shorter than the record says is reported
    # from its listed size, unread. A record is not trusted to size the reads: one claiming
    # a petabyte object would otherwise plan millions of ranged reads.
    listings: dict[str, dict[str, dict[str, Any]]] = {}  # one per prefix (incremental steps)
    for index in sorted(by_object):
        obj = record.objects[index]
        where = record.object_path(index).rpartition("/")[0]
        if where not in listings:
            listings[where] = store.find(where)
        info = listings[where].get(obj.name)
        held = None if info is None else info.get("size")
        if info is not None and (type(held) is not int or held >= obj.size):
            continue  # there, and long enough (or its size unknown): the checksums decide
        keep = []
        for f in by_object[index]:
            end = record.locations[f.path].offset + f.size
            if info is None:
                problem(f, "missing", f"{f.size} bytes", f"no object {obj.name}")
            elif isinstance(held, int) and end > held:
                problem(
                    f,
                    "short",
                    f"{f.size} bytes",
                    f"object {obj.name} holds {held} bytes, the record says {obj.size}",
                )
            else:
                keep.append(f)
        if keep:
            by_object[index] = keep
        else:
            del by_object[index]

    batches: list[list[int]] = []
    size = 0
    for index in sorted(by_object):
        nbytes = sum(f.size for f in by_object[index])
        if not batches or (size + nbytes > BATCH_BYTES and batches[-1]):
            batches.append([])
            size = 0
        batches[-1].append(index)
        size += nbytes

    def fetch(batch: list[int]) -> list[tuple[int, list[bytes]]]:
        per = [spans(i) for i in batch]
        flat = [r for s in per for r in s]
        if not flat:
            return [(per_start, []) for per_start in batch]
        data = store.cat_ranges([r[0] for r in flat], [r[1] for r in flat], [r[2] for r in flat])
        out, i = [], 0
        for index, s in zip(batch, per, strict=True):
            out.append((index, data[i : i + len(s)]))
            i += len(s)
        return out

    def pieces(index: int, chunks: list[bytes], f: FileRecord) -> list[memoryview] | int:
        """The file's bytes as views into the object's chunks (or how many arrived)."""
        base = record.locations[by_object[index][0].path].offset
        lo = record.locations[f.path].offset - base
        hi = lo + f.size
        out, pos = [], 0
        for c in chunks:
            a, b = max(lo, pos), min(hi, pos + len(c))
            if a < b:
                out.append(memoryview(c)[a - pos : b - pos])
            pos += len(c)
        got = sum(len(p) for p in out)
        return out if got == f.size else got

    def digest(parts: list[memoryview], algorithm: str) -> str:
        h = new_hasher(algorithm)
        for part in parts:
            h.update(part)
        return f"{algorithm}:{h.hexdigest()}"

    with ThreadPoolExecutor(1, "tdckpt-prefetch") as pool:
        pending = pool.submit(fetch, batches[0]) if batches else None
        for number, batch in enumerate(batches):
            assert pending is not None
            try:
                got = pending.result()
            except FileNotFoundError:
                got = []  # which objects are gone: read them one by one
                for index in batch:
                    try:
                        got += fetch([index])
                    except FileNotFoundError as exc:
                        for f in by_object[index]:
                            problem(f, "missing", f"{f.size} bytes", f"no object ({exc})")
            # read ahead: the next batch downloads while this one is hashed and written
            pending = pool.submit(fetch, batches[number + 1]) if number + 1 < len(batches) else None
            for index, chunks in got:
                for f in by_object[index]:
                    parts = pieces(index, chunks, f)
                    if isinstance(parts, int):
                        kind = "short" if parts < f.size else "long"
                        problem(f, kind, f"{f.size} bytes", f"{parts} bytes")
                        continue
                    if f.checksum is not None:
                        algorithm = f.checksum.split(":", 1)[0]
                        found = digest(parts, algorithm)
                        if found != f.checksum:
                            # read once more: a glitch in transit is not damage at rest
                            loc = record.locations[f.path]
                            again = store.cat_ranges(
                                [record.object_path(loc.object)],
                                [loc.offset],
                                [loc.offset + f.size],
                            )
                            parts = [memoryview(again[0])]
                            found = digest(parts, algorithm)
                            if found != f.checksum:
                                problem(f, "changed", f.checksum, found)
                                continue
                        if seen is not None and len(by_object[index]) == 1:
                            seen[record.object_path(index)] = found
                    if dest is not None:
                        _write_new(dest / f.path, parts)
                    done += f.size
                    if report is not None:
                        report.files_checked += 1
                    if progress is not None:
                        progress(done, total)
    if dest is not None:
        text = manifest.model_dump_json(indent=1) + "\n"
        _write_new(dest / MANIFEST_NAME, [memoryview(text.encode())])
    return done


def _write_new(path: Path, chunks: list[memoryview]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        for c in chunks:
            view = memoryview(c)
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
