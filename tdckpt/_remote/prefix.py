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

from tdckpt._remote.store import open_store
from tdckpt._write.checksum import new_hasher
from tdckpt.errors import CheckpointNotFoundError, IntegrityError, MetadataError, UnsafePathError
from tdckpt.schema import MANIFEST_NAME, Manifest

__all__ = ["local_prefix", "relabel", "relabel_warnings"]

T = TypeVar("T")

_BATCH_FILES = 256


def _memory_tmp() -> str | None:
    from tdckpt._remote.manager import _memory_tmp as tmp

    return tmp()


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
            yield dest
            return
        dest = tmp / "prefix"
        dest.mkdir()
        for rel in found:
            _safe(rel, store.url)
        manifest: Manifest | None = None
        if MANIFEST_NAME in found:
            raw = store.cat(MANIFEST_NAME)
            try:
                manifest = Manifest.model_validate(json.loads(raw))
            except (ValueError, UnicodeDecodeError):
                manifest = None  # the local validate reports an invalid manifest
        sums = {f.path: f.checksum for f in manifest.files} if manifest is not None else {}
        wanted = [r for r in sorted(found) if data or not r.endswith(".memmap")]
        for rel in sorted(found):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            if rel not in wanted:
                size = int(found[rel].get("size") or 0)
                with open(dest / rel, "wb") as fh:
                    fh.truncate(size)
        for start in range(0, len(wanted), _BATCH_FILES):
            batch = wanted[start : start + _BATCH_FILES]
            sizes = [int(found[r].get("size") or 0) for r in batch]
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
        yield dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def relabel(result: T, local: Path, url: str) -> T:
    """``result`` (a report) with the local folder's name replaced by the URL everywhere."""
    here = os.fspath(local)

    def fix(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(here, url)
        if isinstance(value, Path):
            return url if os.fspath(value) == here else value
        if isinstance(value, list):
            return [fix(v) for v in value]
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


@contextlib.contextmanager
def relabel_warnings(local: Path, url: str) -> Iterator[None]:
    """Warnings raised in the block name ``url`` instead of the private local copy, and
    point at the caller's line (the first frame outside tdckpt)."""
    from tdckpt._restore.policy import user_stacklevel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    here = os.fspath(local)
    for w in caught:
        text = str(w.message).replace(here, url)
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
