"""Plain tensordict prefixes at a URL: ``tdckpt.load_memmap(url)``, ``validate``, ``inspect``
and ``upgrade(dry_run=True)``.

The prefix's objects are read into a private local folder (memory-backed ``/dev/shm``
when there is one) and the local function runs on it: the same validated read path, the
same all-or-nothing restore. Readers of metadata only (validate, inspect, a dry-run
upgrade) fetch every file except the ``*.memmap`` leaves, which become sparse files of
the listed size (those functions check sizes and never read leaf bytes). A prefix with a
``tdckpt.manifest.json`` has every fetched file's checksum verified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from tdckpt._remote.layout import MAX_RECORD_BYTES
from tdckpt._remote.store import open_store
from tdckpt._write.checksum import new_hasher
from tdckpt.errors import (
    CheckpointNotFoundError,
    IntegrityError,
    MetadataError,
    TdckptError,
    UnsafePathError,
)
from tdckpt.schema import MANIFEST_NAME, Manifest

__all__ = ["local_prefix", "relabel", "relabel_error", "relabel_warnings"]

T = TypeVar("T")

_BATCH_FILES = 256


def _memory_tmp() -> str | None:
    from tdckpt._remote.store import memory_tmp

    return memory_tmp()


def _safe(rel: str, url: str) -> None:
    parts = rel.split("/")
    if "\x00" in rel or any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(
            f"{url}: the object {rel!r} has a name that would leave the prefix ('..', an "
            "empty or '.' component); refusing to read it.",
            path=f"{url}/{rel}",
        )


@contextlib.contextmanager
def local_prefix(url: str, storage_options: dict[str, Any] | None, *, data: bool) -> Iterator[Path]:
    """The prefix at ``url`` as a local path while the block runs (then deleted)."""
    store = open_store(url, storage_options)
    found = store.find("")
    single = False
    if not found:
        with contextlib.suppress(Exception):
            single = bool(store.fs.isfile(store.root))
        if not single:
            raise CheckpointNotFoundError(
                f"{store.url}: no objects under this prefix; pass the URL of a saved "
                "tensordict (the folder holding meta.json) or of a .tdz archive.",
                path=store.url,
            )
    tmp = Path(tempfile.mkdtemp(prefix="tdckpt-url-", dir=_memory_tmp()))
    try:
        if single:
            name = store.root.rsplit("/", 1)[-1] or "checkpoint"
            dest = tmp / name
            (tmp / name).write_bytes(store.cat(""))
            with _errors_named(dest, store.url):
                yield dest
            return
        dest = tmp / "prefix"
        dest.mkdir()
        for rel in found:
            _safe(rel, store.url)
        folders = {rel.rsplit("/", i)[0] for rel in found for i in range(1, rel.count("/") + 1)}
        clash = sorted(folders & set(found))
        if clash:
            raise UnsafePathError(
                f"{store.show(clash[0])}: an object that is also the prefix of other objects "
                f"({len(clash)} such name(s)); a tensordict prefix cannot hold it (a file and a "
                "folder of one name). Nothing was read; remove the stray object.",
                path=store.show(clash[0]),
            )
        # A metadata file over the cap the local reader applies to it is never fetched: a
        # sparse file of its listed size stands in, which the reader refuses unread.
        oversized = {r for r in found if _size(found[r]) > _cap(r)}
        manifest: Manifest | None = None
        raw = b""
        if MANIFEST_NAME in found and MANIFEST_NAME not in oversized:
            raw = store.cat_capped(MANIFEST_NAME, MAX_RECORD_BYTES, "manifest")
            try:
                manifest = Manifest.model_validate(json.loads(raw))
            except (ValueError, RecursionError):  # UnicodeDecodeError, pydantic's too
                manifest = None  # the local validate reports an invalid manifest
        sums = {f.path: f.checksum for f in manifest.files} if manifest is not None else {}
        wanted = [
            r for r in sorted(found) if (data or not r.endswith(".memmap")) and r not in oversized
        ]
        for rel in sorted(found):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            if rel not in wanted:
                with open(dest / rel, "wb") as fh:
                    fh.truncate(_size(found[rel]))
        for start in range(0, len(wanted), _BATCH_FILES):
            batch = wanted[start : start + _BATCH_FILES]
            sizes = [_size(found[r]) for r in batch]
            blobs = store.cat_ranges(batch, [0] * len(batch), sizes)
            for rel, blob in zip(batch, blobs, strict=True):
                expected = sums.get(rel)
                if expected is not None:
                    algorithm = expected.split(":", 1)[0]
                    h = new_hasher(algorithm)
                    h.update(blob)
                    got = f"{algorithm}:{h.hexdigest()}"
                    if got != expected:
                        raise IntegrityError(
                            f"{store.show(rel)}: checksum {got}, the manifest says {expected}; "
                            "the object is damaged in the store. Nothing was restored.",
                            path=store.show(rel),
                        )
                if rel == MANIFEST_NAME:
                    blob = raw
                with open(dest / rel, "xb") as fh:
                    fh.write(blob)
        with _errors_named(dest, store.url):
            yield dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _heres(local: Path) -> list[str]:
    """The spellings of the local folder a message may hold (as given, and resolved)."""
    here = os.fspath(local)
    real = os.path.realpath(here)
    return [here] if real == here else [here, real]


def _size(info: dict[str, Any]) -> int:
    size = info.get("size")
    return size if type(size) is int and size >= 0 else 0


def _cap(rel: str) -> float:
    """The most bytes the local reader reads of ``rel`` (infinite for a leaf, mapped)."""
    from tdckpt._read.storage import MAX_JSON_BYTES
    from tdckpt._read.tree import MAX_PT_BYTES

    if rel == MANIFEST_NAME:
        return MAX_RECORD_BYTES
    if rel.endswith(".json"):
        return MAX_JSON_BYTES
    if rel.endswith(".pt"):
        return MAX_PT_BYTES
    return float("inf")


@contextlib.contextmanager
def _errors_named(local: Path, url: str) -> Iterator[None]:
    """An error raised in the block names ``url``, not ``local`` (see :func:`relabel_error`)."""
    try:
        yield
    except Exception as exc:
        relabel_error(exc, local, url)
        raise


def relabel(result: T, local: Path, url: str) -> T:
    """``result`` (a report, an error's fact) with the local folder's name replaced by the
    URL everywhere."""
    heres = _heres(local)

    def text(value: str) -> str:
        for here in heres:
            value = value.replace(here, url)
        return value

    def fix(value: Any) -> Any:
        if isinstance(value, str):
            return text(value)
        if isinstance(value, Path):
            shown = os.fspath(value)
            for here in heres:
                if shown == here or shown.startswith(here + os.sep):
                    return url + shown[len(here) :].replace(os.sep, "/")
            return value
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(fix(v) for v in value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {f.name: fix(getattr(value, f.name)) for f in dataclasses.fields(value)}
            try:
                return dataclasses.replace(value, **changes)
            except (TypeError, ValueError):
                return value
        return value

    return fix(result)  # type: ignore[no-any-return]


def refuse_write(url: str, what: str) -> MetadataError:
    return MetadataError(
        f"{url}: {what} of a checkpoint in object storage is not supported (it would rewrite "
        "objects in place). Download it, run it locally, and upload the result; or use "
        "--dry-run to see the plan.",
        path=url,
    )


def relabel_error(exc: BaseException, local: Path, url: str) -> None:
    """Rewrite ``exc`` in place so that it names ``url``, not the private local copy: its
    message and arguments, a tdckpt error's facts (a report's prefix, a path), an
    ``OSError``'s file names. The exception keeps its type and traceback."""
    heres = _heres(local)

    def text(value: str) -> str:
        for here in heres:
            value = value.replace(here, url)
        return value

    if isinstance(exc, TdckptError):
        exc.message = text(exc.message)
        exc.facts = {name: relabel(value, local, url) for name, value in exc.facts.items()}
        for name, value in exc.facts.items():
            with contextlib.suppress(AttributeError):
                setattr(exc, name, value)
    exc.args = tuple(text(a) if isinstance(a, str) else a for a in exc.args)
    if isinstance(exc, OSError):
        for attr in ("filename", "filename2"):
            value = getattr(exc, attr, None)
            if isinstance(value, (str, Path)):
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(exc, attr, str(relabel(value, local, url)))


@contextlib.contextmanager
def relabel_warnings(local: Path, url: str) -> Iterator[None]:
    """Warnings and errors raised in the block name ``url`` instead of the private local
    copy; the warnings point at the caller's line (the first frame outside tdckpt)."""
    from tdckpt._restore.policy import user_stacklevel

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    except Exception as exc:
        relabel_error(exc, local, url)
        raise
    heres = _heres(local)
    for w in caught:
        text = str(w.message)
        for here in heres:
            text = text.replace(here, url)
        message: Warning
        if isinstance(w.message, Warning):
            # the instance was made for this warning: relabel it (keeps its attributes)
            message = w.message
            message.args = (text,)
            if isinstance(getattr(message, "message", None), str):  # tdckpt's own warnings
                message.message = text  # type: ignore[attr-defined]
        else:
            message = w.category(text)
        warnings.warn(message, stacklevel=user_stacklevel())
