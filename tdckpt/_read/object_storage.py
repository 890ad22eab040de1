"""Object storage (any fsspec URL) as a read-only :class:`~tdckpt._read.storage.Storage`.

A step in object storage is read where it lies: no local copy, no temporary folder. The
storage knows every file of the prefix up front - from one listing of a plain prefix, or
from a managed step's commit record (object, offset, size, checksum of each file) - and
reads bytes by ranged, concurrent reads, each straight into the buffer that keeps its bytes
(:func:`_read_into`; on s3fs a ``GetObject`` body read into it as it arrives):

* opening reads every small file the read path needs whole (``meta.json``, size tables,
  JSON types, pickles; never a ``*.memmap`` leaf) in one batch of ranges, each capped as
  the local reader caps it (a file over its cap is refused from its listed size, unread);
* :meth:`ObjectStorage.prefetch` reads exactly the leaves a restore kept (after ``keys=`` /
  ``exclude=`` pruned the tree): ranges of one object that lie close together are merged,
  long ones split, batches bounded in flight;
* :meth:`ObjectStorage.stream` reads any files batch by batch (``verify`` and a
  ``cache_dir`` download read every file of a step through it, the next batch read ahead);
* every file whose size and checksum a manifest records is checked as it arrives (read once
  more on a mismatch: a glitch in transit is not damage at rest), before it is parsed,
  unpickled or used; a mismatch is an :class:`~tdckpt.errors.IntegrityError`.

Leaves live in memory: each is one private, writable buffer (``mode="r"`` semantics, as an
archive's copy-on-write mapping), owned by its tensor. A manager with ``cache_dir`` keeps
file-backed copies instead (see :mod:`tdckpt._store.objects`). Every message names the URL
and the file, never a local path: there is none.

Capabilities, not types: ``file_backed = False`` (no file to map, nothing shared),
``ranged_reads = True``, ``writable_in_place = False``.

:mod:`tdckpt._read.object_open` opens one: a plain prefix (``tdckpt.load_memmap("s3://...")``)
or a committed step of an object-storage root.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from tdckpt._keys import NESTED_SHAPE_SUFFIX
from tdckpt._read import storage as _storage
from tdckpt._read.expected import check_read
from tdckpt._read.storage import MAX_JSON_BYTES, Listing, MapMode, Storage, check_component
from tdckpt._report import ProblemKind, VerifyProblem
from tdckpt._write.checksum import new_hasher
from tdckpt.errors import (
    CheckpointNotFoundError,
    IntegrityError,
    MetadataError,
    UnsafePathError,
)
from tdckpt.schema import MANIFEST_NAME
from tdckpt.schema import MAX_MANIFEST_BYTES as _MAX_MANIFEST

if TYPE_CHECKING:
    from tdckpt._remote.store import Store

__all__ = ["ObjectStorage", "Span", "is_leaf"]

#: Bytes per ranged read, and bytes in flight per batch of ranged reads.
RANGE_BYTES = 16 << 20
BATCH_BYTES = 128 << 20
#: Ranges in one batch at most (a prefix of 100,000 tiny files is read in many batches).
BATCH_RANGES = 1024
#: Two wanted ranges of one object at most this far apart are read as one range (a pack of
#: small files costs one request, not one per file); the bytes between are dropped.
MERGE_GAP = 64 << 10
#: Largest manifest read at a plain prefix (a commit record's own cap).
MAX_MANIFEST_BYTES = _MAX_MANIFEST


@dataclass(frozen=True)
class Span:
    """Where one file of the prefix lies: ``size`` bytes at ``offset`` of the object
    ``obj`` (a path relative to the store's root), and what its bytes must hash to."""

    obj: str
    offset: int
    size: int
    checksum: str | None = None
    key: tuple[str, ...] | None = None


def is_leaf(rel: str) -> bool:
    """Whether ``rel`` holds a tensor's bytes (read only when restored, never ahead)."""
    return rel.endswith(".memmap") and not rel.endswith(NESTED_SHAPE_SUFFIX)


def _cap(rel: str) -> float:
    """The largest ``rel`` opening reads ahead (a leaf: never; a metadata file: up to the
    read path's cap for it, a larger one is refused from its size, unread; any other small
    file: a pickle, say, read ahead below MAX_JSON_BYTES, on demand above)."""
    from tdckpt._read.tree import MAX_PT_BYTES

    if rel == MANIFEST_NAME:
        return MAX_MANIFEST_BYTES
    if rel.endswith(".json"):
        return _storage.MAX_JSON_BYTES  # looked up now: tests lower it
    if rel.endswith(".pt"):
        return MAX_PT_BYTES
    if rel.endswith(NESTED_SHAPE_SUFFIX):  # a nested tensor's size table: validation reads it
        return MAX_JSON_BYTES
    if rel.endswith(".memmap"):
        return float("inf")
    return MAX_JSON_BYTES


class ObjectStorage(Storage):
    """The files of one prefix in object storage, read by ranges (see the module docstring).

    ``spans``: every file, relative POSIX path -> :class:`Span`. ``inline``: files whose
    bytes the opener already holds (a managed step's manifest, from its record).
    ``damaged``: the message prefix of an integrity error (``"<url>: step 5 is damaged in
    the store"``). One storage serves one restore; :meth:`close` drops buffers not yet
    taken.
    """

    kind = "object"
    file_backed = False
    ranged_reads = True
    writable_in_place = False

    def __init__(
        self,
        store: Store,
        location: str,
        spans: dict[str, Span],
        *,
        inline: dict[str, bytes] | None = None,
        damaged: str | None = None,
        step: int | None = None,
    ) -> None:
        self.location = location
        self._store = store
        self._spans = spans
        self._inline = dict(inline or {})
        self._damaged = damaged or f"{location}: the checkpoint is damaged in the store"
        self._step = step
        self._lock = threading.Lock()
        #: verified bytes read ahead, taken by read_bytes / map
        self._ready: dict[str, bytearray] = {}
        #: leaves the object listing found gone or short: refused when read (hold_damage)
        self._held: dict[str, VerifyProblem] = {}
        #: bytes and ranged reads this storage fetched (tests and the benchmark count them)
        self.bytes_fetched = 0
        self.ranges_fetched = 0
        self._levels: dict[str, Listing] = {"": Listing()}
        for rel in sorted(set(spans) | set(self._inline)):
            parts = rel.split("/")
            for part in parts:
                check_component(part, where=self.display(rel))
            for depth in range(len(parts) - 1):
                parent = "/".join(parts[:depth])
                self._levels.setdefault(parent, Listing()).dirs.add(parts[depth])
                self._levels.setdefault("/".join(parts[: depth + 1]), Listing())
            parent = "/".join(parts[:-1])
            size = spans[rel].size if rel in spans else len(self._inline[rel])
            self._levels.setdefault(parent, Listing()).files[parts[-1]] = size
        clash = sorted(
            (f"{parent}/{name}" if parent else name)
            for parent, level in self._levels.items()
            for name in level.files.keys() & level.dirs
        )
        if clash:
            raise UnsafePathError(
                f"{self.display(clash[0])}: an object that is also the prefix of other objects "
                f"({len(clash)} such name(s)); a tensordict prefix cannot hold it (a file and a "
                "folder of one name). Nothing was read; remove the stray object.",
                path=self.display(clash[0]),
            )

    # -- Storage interface -----------------------------------------------------------
    def display(self, rel: str) -> str:
        return f"{self.location}/{rel}" if rel else self.location

    def listdir(self, rel: str) -> Listing:
        level = self._levels.get(rel)
        if level is None:
            raise CheckpointNotFoundError(
                f"{self.display(rel)}: no such folder in the checkpoint.", path=self.display(rel)
            )
        return Listing(files=dict(level.files), dirs=set(level.dirs))

    def read_bytes(self, rel: str, *, max_bytes: int = MAX_JSON_BYTES) -> bytes:
        if rel in self._inline:
            return self._inline[rel]
        span = self.span(rel)
        # the caller's cap; a JSON file's is the module's now (tests lower it), as opening
        # read ahead only the JSON files under it
        cap = min(max_bytes, _storage.MAX_JSON_BYTES) if rel.endswith(".json") else max_bytes
        if span.size > cap:
            raise MetadataError(
                f"{self.display(rel)}: {span.size} bytes, more than the {int(cap)} bytes tdckpt "
                "reads for a metadata file; it was not fetched. The object is damaged or hostile.",
                path=self.display(rel),
            )
        data = bytes(self._take(rel))
        check_read(self, rel, data)
        return data

    def map(self, rel: str, dtype: torch.dtype, numel: int, *, mode: MapMode) -> torch.Tensor:
        """The first ``numel`` elements of ``rel`` as a 1-D tensor over a private buffer
        (read ahead by :meth:`prefetch`, else read now); writes stay in memory."""
        if mode == "r+":
            raise PermissionError(
                f"{self.display(rel)}: mode='r+' makes writes reach the checkpoint's files; a "
                "checkpoint in object storage is read into memory, so they never could. Use "
                "mode='r' or None."
            )
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        span = self.span(rel)
        need = numel * dtype.itemsize
        if span.size < need:
            raise MetadataError(
                f"{self.display(rel)}: {span.size} bytes, but {numel} elements of {dtype} need "
                f"{need}. The object is truncated; restore another step or re-save it.",
                path=self.display(rel),
            )
        buffer = self._take(rel)
        return torch.frombuffer(buffer, dtype=dtype, count=numel)

    def close(self) -> None:
        with self._lock:
            self._ready.clear()

    # -- reading ---------------------------------------------------------------------
    def span(self, rel: str) -> Span:
        """Where ``rel`` lies and what it must hash to."""
        span = self._spans.get(rel)
        if span is None:
            raise CheckpointNotFoundError(
                f"{self.display(rel)}: no such file in the checkpoint.", path=self.display(rel)
            )
        return span

    def _take(self, rel: str) -> bytearray:
        with self._lock:
            ready = self._ready.pop(rel, None)
        if ready is not None:
            return ready
        return self._fetch([rel])[rel]

    def prefetch(self, rels: Iterable[str]) -> None:
        """Read ``rels`` ahead (concurrent ranged reads, checked): what a restore maps next."""
        with self._lock:
            wanted = sorted({r for r in rels if r in self._spans and r not in self._ready})
        if wanted:
            fetched = self._fetch(wanted)
            with self._lock:
                self._ready.update(fetched)

    def stream(
        self,
        rels: Iterable[str],
        on_problem: Callable[[VerifyProblem], None] | None = None,
        *,
        read_ahead: bool = False,
    ) -> Iterator[tuple[str, bytearray | memoryview]]:
        """Each file of ``rels`` with its checked bytes, batch by batch (with ``read_ahead``,
        the next batch downloading while the caller uses this one).

        Each range is read straight into one buffer (:func:`_read_into`): a file alone in
        its range - a leaf - gets that buffer (a ``bytearray`` its tensor may own, no copy of
        its bytes made on the way); a file of a merged range (small ones) is a view of it. A
        file that does not match its span raises :class:`~tdckpt.errors.IntegrityError`, or
        with ``on_problem`` is given to it and skipped (``verify`` reports every problem).
        """
        wanted = list(rels)
        if self._held:
            for rel in wanted:
                if rel in self._held:
                    if on_problem is None:
                        raise self.damage(self._held[rel])
                    on_problem(self._held[rel])
            wanted = [rel for rel in wanted if rel not in self._held]
        batches = _batches(self._runs(wanted))
        read = self._read_ahead(batches) if read_ahead else map(self._read_batch, batches)
        for batch, (buffers, held) in zip(batches, read, strict=True):
            for (_, start, end, files), buf, got in zip(batch, buffers, held, strict=True):
                for rel in files:
                    span = self._spans[rel]
                    lo = span.offset - start
                    data: bytearray | memoryview
                    if lo == 0 and span.size == end - start and got == span.size:
                        data = buf  # the run is this file: its buffer is the file's
                    else:  # a file of a merged run, or the object ended first: its bytes
                        data = memoryview(buf)[lo : max(lo, min(lo + span.size, got))]
                    checked = self._checked(rel, span, data, on_problem)
                    if checked is not None:
                        yield rel, checked

    def _fetch(self, rels: Iterable[str]) -> dict[str, bytearray]:
        """Every file of ``rels``, checked, each in a buffer of its own."""
        return {rel: _own(data) for rel, data in self.stream(rels)}

    def _read_batch(
        self, batch: list[tuple[str, int, int, list[str]]]
    ) -> tuple[list[bytearray], list[int]]:
        """One buffer per run of ``batch``, read (:meth:`_read_runs`): (buffers, bytes got)."""
        buffers = [bytearray(end - start) for _, start, end, _ in batch]
        runs = [(obj, start, buf) for (obj, start, _, _), buf in zip(batch, buffers, strict=True)]
        return buffers, self._read_runs(runs)

    def _read_ahead(
        self, batches: list[list[tuple[str, int, int, list[str]]]]
    ) -> Iterator[tuple[list[bytearray], list[int]]]:
        """:meth:`_read_batch` of each batch in turn, the next one read while the caller
        uses this one."""
        if not batches:
            return
        with ThreadPoolExecutor(1, "tdckpt-prefetch") as pool:
            pending = pool.submit(self._read_batch, batches[0])
            for following in [*batches[1:], None]:
                got = pending.result()
                if following is not None:
                    pending = pool.submit(self._read_batch, following)
                yield got

    def _runs(self, rels: Sequence[str]) -> list[tuple[str, int, int, list[str]]]:
        """Ranges to read: (object, start, end, files wholly inside), merged and split."""
        by_obj: dict[str, list[str]] = {}
        for rel in rels:
            by_obj.setdefault(self._spans[rel].obj, []).append(rel)
        runs: list[tuple[str, int, int, list[str]]] = []
        for obj, files in sorted(by_obj.items()):
            files.sort(key=lambda r: self._spans[r].offset)
            current: tuple[str, int, int, list[str]] | None = None
            for rel in files:
                span = self._spans[rel]
                end = span.offset + span.size
                if (
                    current is not None
                    and span.offset - current[2] <= MERGE_GAP
                    and end - current[1] <= RANGE_BYTES
                ):
                    current = (obj, current[1], max(current[2], end), [*current[3], rel])
                    continue
                if current is not None:
                    runs.append(current)
                current = (obj, span.offset, end, [rel])
            if current is not None:
                runs.append(current)
        return runs

    def _read_runs(self, runs: list[tuple[str, int, bytearray]]) -> list[int]:
        """Read each ``(object, start, buffer)``: the buffer's length of bytes from
        ``start``, a large one as RANGE_BYTES pieces issued together, every piece straight
        into its slice of the buffer. The bytes each run got, counted from its start (fewer
        than its length: the object ended first)."""
        pieces: list[tuple[str, int, memoryview]] = []
        counts: list[int] = []
        for obj, start, buf in runs:
            view = memoryview(buf)
            size = len(buf)
            split = [
                (obj, start + lo, view[lo : min(lo + RANGE_BYTES, size)])
                for lo in range(0, size, RANGE_BYTES)
            ]
            pieces += split
            counts.append(len(split))
        try:
            got = _read_into(self._store, pieces)
        except FileNotFoundError as exc:
            raise IntegrityError(
                f"{self._damaged}: an object it names is gone ({exc}); nothing was restored and "
                "the target is unchanged. Restore another step, or re-save this one.",
                path=self.location,
                step=self._step,
            ) from exc
        finally:
            lengths = [piece[2].nbytes for piece in pieces]
            for piece in pieces:
                piece[2].release()  # the buffers are the files' (never resized) from here on
        with self._lock:  # a batch read ahead on another thread counts too
            self.ranges_fetched += len(pieces)
            self.bytes_fetched += sum(got)
        out, i = [], 0
        for n in counts:
            held = 0
            for length, count in zip(lengths[i : i + n], got[i : i + n], strict=True):
                held += count
                if count < length:
                    break  # the object ended inside this piece: nothing after it
            out.append(held)
            i += n
        return out

    def _checked(
        self,
        rel: str,
        span: Span,
        data: bytearray | memoryview,
        on_problem: Callable[[VerifyProblem], None] | None = None,
    ) -> bytearray | memoryview | None:
        """``data`` if it holds ``rel``'s recorded size and checksum (else the bytes read
        again once, if they do); else the problem raised, or given to ``on_problem``."""
        problem = _problem(rel, span, data)
        if problem is not None and problem.kind == "changed":
            # a checksum mismatch: read once more (a glitch in transit is not damage at rest)
            again = bytearray(span.size)
            (got,) = self._read_runs([(span.obj, span.offset, again)])
            data = again if got == span.size else memoryview(again)[:got]
            problem = _problem(rel, span, data)
        if problem is None:
            return data
        if on_problem is None:
            raise self.damage(problem)
        on_problem(problem)
        return None

    def hold_damage(self, problems: Iterable[VerifyProblem]) -> None:
        """Leaves whose objects the listing found gone or short: each is refused with its
        problem when it is read, and only then - a selective restore that does not read it
        is not stopped by it (verify reports it)."""
        self._held.update((problem.path, problem) for problem in problems)

    def damage(self, problem: VerifyProblem) -> IntegrityError:
        """The error refusing the checkpoint for ``problem`` (naming the file's URL)."""
        return IntegrityError(
            f"{self._damaged}: {problem}; nothing was restored and the target is unchanged. "
            "Restore another step (see steps()), or re-save this one.",
            path=self.display(problem.path),
            step=self._step,
            problems=[problem],
        )

    def peek(self, rel: str) -> bytearray | None:
        """The bytes of ``rel`` read ahead, left for the reader (None if not read ahead)."""
        with self._lock:
            return self._ready.get(rel)

    def check_ready(self) -> None:
        """Check what was read ahead against the spans as they are now (a plain prefix's
        checksums are known only once its manifest, read in the same batch, is parsed)."""
        with self._lock:
            ready = list(self._ready.items())
        for rel, data in ready:
            checked = self._checked(rel, self._spans[rel], data)
            if checked is not data and checked is not None:  # read again: the new bytes
                with self._lock:
                    self._ready[rel] = _own(checked)

    def read_small_files(self) -> None:
        """Read ahead every file the read path reads whole (metadata, not leaves), in one
        batch of ranges; a file over its cap is left for :meth:`read_bytes` to refuse."""
        from tdckpt._read.tree import MAX_METADATA_BYTES

        # Smallest first, up to the read path's budget for all metadata together: what is
        # left over is read on demand, where the read path refuses it (nothing here holds
        # more in memory than the local reader would parse).
        small, total = [], 0
        for rel, span in sorted(self._spans.items(), key=lambda item: item[1].size):
            if is_leaf(rel) or span.size > _cap(rel):
                continue
            if total + span.size > MAX_METADATA_BYTES:
                break
            small.append(rel)
            total += span.size
        self.prefetch(small)


def _read_into(store: Store, reads: Sequence[tuple[str, int, memoryview]]) -> list[int]:
    """Each ``(path, offset, buffer)``: the object ``path`` (relative to the store's root)
    read from ``offset`` straight into ``buffer``, all concurrently; the bytes each got
    (fewer than the buffer's length: the object ended first).

    On s3fs every range is one ``GetObject`` whose body is read into its buffer as it
    arrives (:func:`_s3_read_into`): no bytes object of the range is made, and s3fs's own
    retry wrapper retries a request that fails, the body's reading included, as its reads
    do. Any other filesystem: fsspec's ``cat_ranges``, each range copied into its buffer.
    Either way the call goes through the store's retry loop.
    """
    if not reads:
        return []
    what = f"ranged read of {len(reads)} range(s)"
    fs = store.fs
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None and isinstance(fs, s3fs.S3FileSystem):
        from fsspec.asyn import sync

        async def read_all() -> list[int]:
            got = await asyncio.gather(
                *(_s3_read_into(fs, store.full(p), off, buf) for p, off, buf in reads),
                return_exceptions=True,
            )
            for result in got:
                if isinstance(result, BaseException):
                    raise result
            return cast("list[int]", got)

        return store._call(what, reads[0][0], lambda: sync(fs.loop, read_all))
    ends = [off + buf.nbytes for _, off, buf in reads]
    chunks = store.cat_ranges([p for p, _, _ in reads], [off for _, off, _ in reads], ends)
    out = []
    for (_, _, buf), data in zip(reads, chunks, strict=True):
        n = min(len(data), buf.nbytes)
        buf[:n] = memoryview(data)[:n]
        out.append(n)
    return out


async def _s3_read_into(fs: Any, path: str, offset: int, buffer: memoryview) -> int:
    """One ranged ``GetObject`` of ``path`` read into ``buffer`` (see :func:`_read_into`);
    the bytes read. The request and the reading of its body are retried together by
    s3fs's retry wrapper, as s3fs's ``_cat_file`` retries them."""
    from s3fs.core import _error_wrapper, version_id_kw

    bucket, key, version = fs.split_path(path)
    size = buffer.nbytes
    if not size:
        return 0

    async def once() -> int:
        resp = await fs._call_s3(
            "get_object",
            Bucket=bucket,
            Key=key,
            Range=f"bytes={offset}-{offset + size - 1}",
            **version_id_kw(version),
        )
        body = resp["Body"]
        try:
            pos = 0
            while pos < size:
                n = await body.readinto(buffer[pos:])
                if not n:
                    break
                pos += n
            return pos
        finally:
            body.close()

    return int(await _error_wrapper(once, retries=fs.retries))


def _own(data: bytearray | memoryview) -> bytearray:
    """``data`` as a private, writable buffer (a view's bytes copied once)."""
    return data if isinstance(data, bytearray) else bytearray(data)


def _problem(rel: str, span: Span, data: bytearray | memoryview) -> VerifyProblem | None:
    """What is wrong with ``data``, read as ``rel``, or None if it is what ``span`` records."""
    kind: ProblemKind
    size = len(data)
    if size != span.size:
        kind = "short" if size < span.size else "long"
        return VerifyProblem(rel, span.key, kind, f"{span.size} bytes", f"{size} bytes")
    if span.checksum is None:
        return None
    algorithm, _, digest = span.checksum.partition(":")
    hasher = new_hasher(algorithm)
    hasher.update(data)
    found = hasher.hexdigest()
    if found == digest:
        return None
    return VerifyProblem(rel, span.key, "changed", span.checksum, f"{algorithm}:{found}")


def _batches(
    runs: list[tuple[str, int, int, list[str]]],
) -> list[list[tuple[str, int, int, list[str]]]]:
    """``runs`` in batches of at most BATCH_BYTES and BATCH_RANGES (one run alone may be
    larger)."""
    batches: list[list[tuple[str, int, int, list[str]]]] = []
    size = BATCH_BYTES
    for run in runs:
        nbytes = run[2] - run[1]
        full = size + nbytes > BATCH_BYTES or (batches and len(batches[-1]) >= BATCH_RANGES)
        if full and (not batches or batches[-1]):
            batches.append([])
            size = 0
        batches[-1].append(run)
        size += nbytes
    return batches
