"""Metadata checked on every restore of a managed step: each file read whole is compared with
the step's manifest as it is read.

A restore reads every ``meta.json`` (and each small file it reads whole: nested size tables,
``json_types.json``, pickles) anyway; hashing those bytes costs nothing measurable, so a
committed step's metadata is checked on every restore, not only under ``verify=True``
(which also re-reads every leaf). :func:`expecting` declares, for the block it guards, which
prefix is a step with which manifest; :meth:`Storage.read_bytes` of that prefix calls
:func:`check_read` on every file it returns. A file whose size or checksum differs from the
manifest, or that the manifest does not list, is refused with an
:class:`~tdckpt.errors.IntegrityError` naming the file and the step, before its bytes are
parsed or unpickled. A reader that turns the error into a validation problem cannot hide it:
:func:`expecting` re-raises the first mismatch as the IntegrityError itself.

The declaration is a context variable, so it follows the restoring thread (and its
context) only: another thread reading the same prefix meanwhile is not checked against it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tdckpt._write.checksum import new_hasher
from tdckpt.errors import IntegrityError, TdckptError
from tdckpt.schema import MANIFEST_NAME, FileRecord, Manifest

__all__ = ["check_read", "expecting"]


class _Reading(Protocol):
    """What :func:`check_read` needs of the storage that read the file (a ``Storage``)."""

    @property
    def location(self) -> str: ...

    def display(self, rel: str) -> str: ...


@dataclass
class _Expected:
    location: str
    where: str
    records: dict[str, FileRecord]
    mismatch: IntegrityError | None = field(default=None)


_EXPECTED: ContextVar[_Expected | None] = ContextVar("tdckpt_expected_metadata", default=None)


@contextmanager
def expecting(path: str | os.PathLike[str], manifest: Manifest, *, where: str) -> Iterator[None]:
    """Check every file read whole from ``path`` against ``manifest`` while the block runs.

    ``where`` names the step in messages (``"<path>: step 5"``). An error raised in the
    block after a mismatch was found - however a reader reported it - becomes that
    mismatch's :class:`~tdckpt.errors.IntegrityError`.
    """
    expected = _Expected(
        location=str(Path(path)),
        where=where,
        records={record.path: record for record in manifest.files},
    )
    token = _EXPECTED.set(expected)
    try:
        yield
    except TdckptError as exc:
        if expected.mismatch is not None and exc is not expected.mismatch:
            raise expected.mismatch from exc
        raise
    finally:
        _EXPECTED.reset(token)


def check_read(storage: _Reading, rel: str, data: bytes) -> None:
    """Refuse ``data``, just read whole from ``rel``, unless the declared manifest agrees."""
    expected = _EXPECTED.get()
    if expected is None or storage.location != expected.location or rel == MANIFEST_NAME:
        return  # the manifest, which the caller holds validated, cannot list itself
    record = expected.records.get(rel)
    if record is None:
        problem = "is not listed in the step's manifest"
    elif len(data) != record.size:
        problem = f"has {len(data)} bytes; the manifest records {record.size}"
    elif record.checksum is None:
        return  # written without a checksum: its size is all there is to check
    else:
        algorithm, _, digest = record.checksum.partition(":")
        hasher = new_hasher(algorithm)
        hasher.update(data)
        found = hasher.hexdigest()
        if found == digest:
            return
        problem = f"has checksum {algorithm}:{found}; the manifest records {record.checksum}"
    error = IntegrityError(
        f"{expected.where}: the file {rel} {problem}. The step was changed after it was "
        "committed (or is damaged), so nothing was restored and the target is unchanged. "
        "Run verify() (`tdckpt verify`) for the full report, and restore another step or "
        "re-save this one.",
        path=storage.display(rel),
    )
    if expected.mismatch is None:
        expected.mismatch = error
    raise error
