"""One checkpoint root in an fsspec filesystem: the few operations tdckpt needs, retried.

Every call that reaches the store goes through :meth:`Store._call`, which retries
transient failures (connection resets, throttling, 5xx: any ``OSError`` that is not a
definite answer such as "not found" or "exists") a few times with backoff, then raises a
:class:`~tdckpt.errors.RemoteError` naming the object, the operation and what to do. A
definite answer is never retried.

The one write with a meaning beyond "put these bytes" is :meth:`Store.create`: an
exclusive create (S3 ``If-None-Match: *`` through s3fs's ``mode="create"``; ``O_EXCL``
for ``file://``; an existence check under the interpreter lock for ``memory://``, which
lives in one process). It is how a step is committed and how the lease is taken.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Any, TypeVar

from tdckpt.errors import MetadataError, RemoteError

__all__ = ["MAX_CONTROL_BYTES", "Store", "open_store", "shorten"]

T = TypeVar("T")

#: Tries of one store call before it fails (the first try included), and the first wait.
ATTEMPTS = 5
BACKOFF_S = 0.05
#: Objects larger than this are streamed (multipart) rather than joined in memory; the
#: block size of such streams.
STREAM_ABOVE = 64 << 20
STREAM_BLOCK = 32 << 20

#: Most bytes read of a small control object (a lease record); a larger one is refused
#: unread. Commit records and manifests hold a step's file list and share the local
#: manifest cap (:data:`tdckpt._remote.layout.MAX_RECORD_BYTES`).
MAX_CONTROL_BYTES = 1 << 20
#: Longest piece of text from a store (a name, a field, a parser's complaint) put in a message.
MAX_SHOWN_CHARS = 200

#: Answers that are facts about the store, not failures of the request: never retried.
_DEFINITE: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)

#: Definite answers that are not facts a caller acts on (as it does on "not found" and
#: "exists"): raised as RemoteError naming the URL, not as the library's bare error.
_REFUSED: tuple[type[BaseException], ...] = (
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, _DEFINITE):
        return False
    if isinstance(exc, (OSError, ConnectionError, TimeoutError)):
        return True
    # botocore / aiohttp errors that s3fs did not translate to OSError
    name = type(exc).__name__
    return any(s in name for s in ("Connection", "Timeout", "ClientError", "ServerError"))


def shorten(text: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """``text`` for a message: at most ``limit`` characters, unprintable ones as ``?``.

    Whatever a store holds is user-controlled: a 20 MB field must not become a 20 MB
    message.
    """
    raw = text if isinstance(text, str) else repr(text)[: limit + 1]
    out = "".join(ch if ch.isprintable() else "?" for ch in raw[:limit])
    return out + ("..." if len(raw) > limit else "")


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """The store at ``url`` (fsspec ``url_to_fs``); RemoteError if fsspec or the protocol's
    package is missing, naming what to install."""
    try:
        from fsspec.core import url_to_fs
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RemoteError(
            f"{url}: object storage needs fsspec; install it with pip install 'tdckpt[remote]'.",
            path=url,
        ) from exc
    try:
        fs, root = url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        raise RemoteError(
            f"{url}: the filesystem for this URL is not installed ({exc}); for s3:// install "
            "pip install 'tdckpt[remote]' (fsspec + s3fs), for gs:// gcsfs.",
            path=url,
        ) from exc
    except (ValueError, TypeError) as exc:
        raise RemoteError(
            f"{url}: fsspec cannot open this URL with these storage options ({exc}). Check the "
            "URL's protocol and the --storage-option / storage_options names.",
            path=url,
        ) from exc
    return Store(fs, str(root).rstrip("/"), url.rstrip("/"))


class Store:
    """A root in an fsspec filesystem. Paths given to methods are relative to the root."""

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root
        self.url = url
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.protocol = str(protocol)
        #: requests sent (each try counts), for tests and the benchmark
        self.calls = 0

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def full(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def show(self, rel: str) -> str:
        """The URL of ``rel``, for messages."""
        return f"{self.url}/{rel}" if rel else self.url

    def rel(self, name: str) -> str:
        """A name the filesystem listed, relative to the root."""
        name = name.rstrip("/")
        root = self.root.lstrip("/")
        bare = name.lstrip("/")
        if bare == root:
            return ""
        if root and bare.startswith(root + "/"):
            return bare[len(root) + 1 :]
        return bare if not root else name

    # -- the retry loop ------------------------------------------------------------------
    def _call(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        delay = BACKOFF_S
        for attempt in range(ATTEMPTS):
            self.calls += 1
            try:
                return fn()
            except BaseException as exc:
                if not _transient(exc) or attempt == ATTEMPTS - 1:
                    if isinstance(exc, _REFUSED):
                        raise RemoteError(
                            f"{self.show(rel)}: {what} refused by the store "
                            f"({shorten(repr(exc), 300)}). Check the credentials and "
                            "permissions for this URL (storage_options).",
                            path=self.show(rel),
                            operation=what,
                        ) from exc
                    if _transient(exc):
                        raise RemoteError(
                            f"{self.show(rel)}: {what} failed {ATTEMPTS} times ({exc!r}); the "
                            "store is unreachable or failing. Nothing was committed by this "
                            "call; retry later, or check the endpoint and credentials.",
                            path=self.show(rel),
                            operation=what,
                        ) from exc
                    raise
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def invalidate(self) -> None:
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache()

    # -- reading -------------------------------------------------------------------------
    def ls(self, rel: str) -> list[dict[str, Any]]:
        """The entries directly under ``rel`` (``[]`` if there is none), fresh from the store."""
        self.invalidate()
        try:
            entries = self._call("list", rel, lambda: self.fs.ls(self.full(rel), detail=True))
        except FileNotFoundError:
            return []
        return [e for e in entries if self.rel(e["name"]) != rel]

    def find(self, rel: str) -> dict[str, dict[str, Any]]:
        """Every object under ``rel``: relative path (to ``rel``) -> info."""
        self.invalidate()
        try:
            found = self._call(
                "list", rel, lambda: self.fs.find(self.full(rel), detail=True, withdirs=False)
            )
        except FileNotFoundError:
            return {}
        out = {}
        base = rel.rstrip("/")
        for name, info in found.items():
            r = self.rel(name)
            if info.get("type") == "directory":
                continue
            sub = r[len(base) + 1 :] if base and r.startswith(base + "/") else r
            if sub:
                out[sub] = info
        return out

    def cat(self, rel: str) -> bytes:
        return bytes(self._call("read", rel, lambda: self.fs.cat_file(self.full(rel))))

    def cat_capped(self, rel: str, cap: int, what: str) -> bytes:
        """Read ``rel`` (a control object: a record, a lease, a manifest), at most ``cap``
        bytes: a larger object is refused (:class:`~tdckpt.errors.MetadataError` naming its
        URL) without being read whole. One ranged read of ``cap + 1`` bytes."""
        data = bytes(
            self._call("read", rel, lambda: self.fs.cat_file(self.full(rel), start=0, end=cap + 1))
        )
        if len(data) > cap:
            raise MetadataError(
                f"{self.show(rel)}: more than {cap} bytes, too large for a {what}; it was not "
                f"read. It is not a {what} tdckpt wrote: delete or replace it.",
                path=self.show(rel),
            )
        return data

    def cat_ranges(self, rels: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        """Ranged reads (concurrent where the filesystem is asynchronous, as s3fs is)."""
        full = [self.full(r) for r in rels]
        what = f"ranged read of {len(rels)} range(s)"
        out = self._call(
            what,
            rels[0] if rels else "",
            lambda: self.fs.cat_ranges(full, starts, ends, on_error="raise"),
        )
        for data in out:
            if isinstance(data, BaseException):  # pragma: no cover - on_error="raise"
                raise data
        return [bytes(d) for d in out]

    # -- writing -------------------------------------------------------------------------
    def _parents(self, rel: str) -> None:
        # A filesystem with real directories (file://) needs the parent to exist.
        if self.protocol in ("file", "local"):
            self.fs.makedirs(self.fs._parent(self.full(rel)), exist_ok=True)

    def put_bytes(self, rel: str, data: bytes) -> None:
        self._parents(rel)
        self._call("upload", rel, lambda: self.fs.pipe_file(self.full(rel), data))

    def put_parts(self, rel: str, parts: list[memoryview]) -> None:
        """Upload the concatenation of ``parts`` without joining them in memory first (a
        streamed, multipart upload on s3fs: memory stays about one block)."""
        self._parents(rel)

        def stream() -> None:
            with self.fs.open(self.full(rel), "wb", block_size=STREAM_BLOCK) as fh:
                for part in parts:
                    for start in range(0, len(part), STREAM_BLOCK):
                        fh.write(part[start : start + STREAM_BLOCK])

        self._call("upload", rel, stream)

    def put_file(self, local: str, rel: str) -> None:
        self._parents(rel)
        self._call("upload", rel, lambda: self.fs.put_file(local, self.full(rel)))

    def create(self, rel: str, data: bytes) -> None:
        """Create ``rel`` holding ``data`` only if it does not exist: FileExistsError if it
        does. A retried create that finds its own bytes (the lost answer of a request that
        succeeded) counts as done."""
        path = self.full(rel)
        tried = False

        def once() -> None:
            nonlocal tried
            if tried:
                with contextlib.suppress(FileNotFoundError):
                    # at most one byte more than ours: a larger object is not ours
                    if bytes(self.fs.cat_file(path, start=0, end=len(data) + 1)) == data:
                        return
            tried = True
            self._create_once(path, data)

        self._call("conditional create", rel, once)

    def _create_once(self, path: str, data: bytes) -> None:
        if self.protocol in ("s3", "s3a"):
            # s3fs sends one PutObject with If-None-Match: * for mode="create"; the 412 of
            # an existing key becomes FileExistsError.
            try:
                self.fs.pipe_file(path, data, mode="create")
            except OSError as exc:
                if "precondition" in str(exc).lower():  # a 412 s3fs did not translate
                    raise FileExistsError(path) from exc
                raise
            return
        if self.protocol in ("memory",):
            # One process, one dict: check and create without releasing the GIL between.
            store = self.fs.store
            key = self.fs._strip_protocol(path)
            if key in store:
                raise FileExistsError(path)
            with self.fs.open(path, "wb") as fh:
                fh.write(data)
            return
        if self.protocol in ("file", "local"):
            import os

            self.fs.makedirs(self.fs._parent(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            return
        # Any other fsspec filesystem: its own exclusive create ("xb"), if it has one.
        with self.fs.open(path, "xb") as fh:
            fh.write(data)

    def rm_files(self, rels: Iterable[str]) -> None:
        for rel in rels:
            full = self.full(rel)

            def delete(full: str = full) -> None:
                self.fs.rm_file(full)

            with contextlib.suppress(FileNotFoundError):
                self._call("delete", rel, delete)

    def rm_tree(self, rel: str) -> None:
        """Delete every object under ``rel`` (already gone is fine).

        fsspec's ``rm`` reads its paths as glob patterns: under a root such as
        ``s3://b/exp[lr=0.1]`` it matches nothing, and would delete nothing while the caller
        reported the objects gone. Such paths are deleted object by object, by exact name.
        """
        names = list(self.find(rel))
        literal = _has_magic(self.full(rel))
        if names and literal:
            self.rm_files(f"{rel}/{n}" for n in names)
        elif names:
            full = [self.full(f"{rel}/{n}") for n in names]
            with contextlib.suppress(FileNotFoundError):
                self._call("delete", rel, lambda: self.fs.rm(full))
        with contextlib.suppress(Exception):  # the directory of a filesystem that has them
            path = self.full(rel)
            if self.fs.exists(path):
                if literal:  # its (now empty) folders, deepest first, by exact name
                    dirs = [
                        d
                        for d, info in self.fs.find(path, withdirs=True, detail=True).items()
                        if info.get("type") == "directory"
                    ]
                    for d in sorted(dirs, key=len, reverse=True):
                        self.fs.rmdir(d)
                    self.fs.rmdir(path)
                else:
                    self.fs.rm(path, recursive=True)
        self.invalidate()


def _has_magic(path: str) -> bool:
    """Whether fsspec would read ``path`` as a glob pattern (``*``, ``?`` or ``[``)."""
    return any(c in path for c in "*?[")


def mtime(info: dict[str, Any]) -> float | None:
    """An object's modification time (POSIX seconds) from a listing's info, if it has one."""
    for key in ("LastModified", "mtime", "created", "updated", "last_modified"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=timezone.utc)
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None
