"""The manifests of a checkpoint root's step entries, and the status rows of its entries.

A root holds ``<step>/`` folders and ``<step>.tdz`` archives; an entry is a committed step
when it holds a valid tdckpt manifest. :class:`StepIndex` reads the manifest of an entry
(bounded; cached by file identity, so a long-lived manager re-reads only what changed);
:class:`tdckpt._store.local.LocalStepStore` scans the root, resolves the step a caller asks
for and lists every entry - committed, damaged or left incomplete by a crash - as a
:class:`StepStatus`. It only reads.
"""

from __future__ import annotations

import lzma
import os
import stat
import struct
import threading
import zipfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tdckpt._shard.manifest import parse_step_manifest
from tdckpt.errors import MetadataError
from tdckpt.schema import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, explain

__all__ = ["StepIndex", "StepStatus", "preferred"]

#: Manifests larger than this are refused (bounded parsing; writers never write one).
_MAX_MANIFEST_BYTES = MAX_MANIFEST_BYTES

#: What zipfile raises on a damaged or hostile archive besides BadZipFile: an encrypted
#: entry (RuntimeError), an unknown method (NotImplementedError), bad compressed data
#: (zlib.error, LZMAError; bz2 raises OSError), lying or truncated structures.
ZIP_READ_ERRORS: tuple[type[BaseException], ...] = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    OSError,
    EOFError,
    ValueError,
    RuntimeError,
    NotImplementedError,
    OverflowError,
    IndexError,
    struct.error,
    zlib.error,
    lzma.LZMAError,
)


@dataclass(frozen=True)
class StepStatus:
    """One entry of a checkpoint root, as ``tdckpt ls`` shows it.

    Attributes:
        step: the step number (None for a leftover whose name carries none).
        path: the folder, archive or leftover.
        kind: ``"dir"``, ``"archive"``, ``"sharded"`` (a step saved by several ranks:
            ``detail`` lists its shards' rows) or ``"tmp"``.
        status: ``"committed"``, ``"damaged"`` (unreadable manifest) or ``"incomplete"``.
        size: bytes of the checkpoint's files, from the manifest.
    """

    step: int | None
    path: Path | str  # a URL (str) for a root in object storage
    kind: str
    status: str
    size: int = 0
    format_version: int | None = None
    key_encoding: str | None = None
    created: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    detail: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}  # every field, in order


def preferred(forms: dict[str, Any], *, archive: bool) -> Any:
    """Of one step's forms (``"dir"``/``"archive"`` -> anything), the one to use.

    The manager's own form (an archive when it saves archives) when the step has it,
    else the other one.
    """
    first = "archive" if archive else "dir"
    return forms[first] if first in forms else next(iter(forms.values()))


class StepIndex:
    """The manifests of the step-named entries of one root (cached by file identity).

    Args:
        root: the checkpoint root.
        lock: guards the manifest cache; the manager passes the lock that also guards its
            own state, so a reader never sees the cache in the middle of a change.
    """

    def __init__(self, root: Path, lock: threading.RLock) -> None:
        self.root = root
        self._lock = lock
        self._manifests: dict[Path, tuple[tuple[int, ...], Manifest | MetadataError]] = {}

    def manifest(self, path: Path, kind: str) -> Manifest:
        """The manifest of a step entry (cached by file identity). Raises MetadataError."""
        where = path / MANIFEST_NAME if kind == "dir" else path
        try:
            st = os.stat(where, follow_symlinks=False)
        except FileNotFoundError as exc:
            raise MetadataError(
                f"{where}: missing; a step is committed only with its manifest. It was not "
                "written by tdckpt, or it is damaged.",
                path=str(where),
            ) from exc
        if not stat.S_ISREG(st.st_mode):
            raise MetadataError(
                f"{where}: not a regular file (a symlink or directory?); expected the manifest.",
                path=str(where),
            )
        signature = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            cached = self._manifests.get(path)
        if cached is not None and cached[0] == signature:
            if isinstance(cached[1], MetadataError):
                raise cached[1]
            return cached[1]
        result: Manifest | MetadataError
        try:
            result = parse_step_manifest(self._manifest_bytes(where, kind, st.st_size))
        except MetadataError as exc:
            result = exc
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            what = explain(exc) if isinstance(exc, ValidationError) else str(exc).splitlines()[0]
            result = MetadataError(
                f"{where}: the tdckpt manifest is invalid ({what}); "
                "expected a manifest of schema version 1. The step is damaged or was written "
                "by a newer tdckpt.",
                path=str(where),
            )
        with self._lock:
            self._manifests[path] = (signature, result)
        if isinstance(result, MetadataError):
            raise result
        return result

    @staticmethod
    def _manifest_bytes(where: Path, kind: str, size: int) -> bytes:
        # Opened once, never through a link and without blocking (a FIFO swapped in after
        # the stat above must not hang a listing), then judged on the open file.
        try:
            fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise MetadataError(
                f"{where}: cannot be opened ({exc.strerror}); expected the step's manifest "
                "as a regular file. The step is damaged or was changed while being read.",
                path=str(where),
            ) from exc
        with open(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise MetadataError(
                    f"{where}: not a regular file; expected the step's manifest. The step is "
                    "damaged or was changed while being read.",
                    path=str(where),
                )
            if kind == "dir":
                if st.st_size > _MAX_MANIFEST_BYTES:
                    raise MetadataError(
                        f"{where}: {st.st_size} bytes, too large for a manifest.",
                        path=str(where),
                    )
                return fh.read(_MAX_MANIFEST_BYTES + 1)
            return _archive_manifest(where, fh)


def _archive_manifest(where: Path, fh: Any) -> bytes:
    """The manifest entry of a step archive read from the open file ``fh`` (size-capped)."""
    try:
        with zipfile.ZipFile(fh) as zf:
            info = zf.getinfo(MANIFEST_NAME)
            if info.file_size > _MAX_MANIFEST_BYTES:
                raise MetadataError(
                    f"{where}: its manifest is {info.file_size} bytes, too large.",
                    path=str(where),
                )
            return zf.read(info)
    except KeyError as exc:
        raise MetadataError(
            f"{where}: the archive holds no {MANIFEST_NAME}; it was not written by tdckpt.",
            path=str(where),
        ) from exc
    except ZIP_READ_ERRORS as exc:
        raise MetadataError(
            f"{where}: not a readable archive ({exc}); it is truncated or damaged.",
            path=str(where),
        ) from exc
