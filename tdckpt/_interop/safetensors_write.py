"""Writing one safetensors file: the header, then every tensor's bytes, straight from memory.

The layout is the format's (see :mod:`tdckpt._interop.safetensors`): an 8-byte little-endian
header length, the JSON header (padded with spaces so the data starts 8-byte aligned), and
the tensors' bytes, largest alignment first, as safetensors orders them.

How the bytes reach the file, since an export is often as large as the memory:

* the file gets its final size first (:func:`~tdckpt._write.preallocate.preallocate`: its
  blocks reserved where the file system can, so a full disk fails the export before it
  writes);
* the tensors are written with ``os.writev`` from views of their own memory, gathered into
  calls of at most :data:`GATHER_BYTES` (a large tensor is cut into views of that size, small
  ones share a call): no tensor is copied into a ``bytes`` object or a user-space buffer;
* with ``fsync``, every :data:`WRITEBACK_BYTES` written are handed to the disk at once
  (:func:`~tdckpt._write.atomic.start_writeback`, ``sync_file_range`` on Linux), so the one
  ``fsync`` at the end finds them written or under way instead of writing all of them then.

A file is written beside its final name and renamed onto it when complete (and synced, with
``fsync``); if anything fails, the new file is removed and the old one left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tdckpt._write.atomic import start_writeback
from tdckpt._write.preallocate import preallocate

__all__ = ["GATHER_BYTES", "WRITEBACK_BYTES", "header", "write_bytes", "write_file"]

#: The most bytes one ``writev`` call writes (views are cut at this size).
GATHER_BYTES = 1 << 20
#: With ``fsync``: writeback is started for every this many bytes written.
WRITEBACK_BYTES = 32 << 20


def _iov_max() -> int:
    """The most buffers one ``writev`` call takes here (POSIX guarantees 16; Linux 1024)."""
    try:
        limit = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 16
    return min(1024, limit) if limit > 0 else 16


_MAX_BUFFERS = _iov_max()
_WRITEV = getattr(os, "writev", None)  # not on Windows: one os.write per buffer there


def header(
    entries: dict[str, torch.Tensor], meta: dict[str, str], dtypes: Mapping[torch.dtype, str]
) -> tuple[bytes, list[str]]:
    """The header bytes (padded to a multiple of 8), and the names in data order.

    ``dtypes``: safetensors' name of each tensor's dtype (every one of ``entries`` has one).
    """
    # Largest alignment first, as safetensors orders them, so every tensor starts on a
    # multiple of its itemsize (readers then view it in place).
    order = sorted(entries, key=lambda n: (-entries[n].element_size(), n))
    doc: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name in order:
        tensor = entries[name]
        nbytes = tensor.numel() * tensor.element_size()
        doc[name] = {
            "dtype": dtypes[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return raw, order


def write_file(
    path: Path,
    entries: dict[str, torch.Tensor],
    meta: dict[str, str],
    dtypes: Mapping[torch.dtype, str],
    *,
    fsync: bool,
) -> int:
    """Write ``entries`` as one safetensors file at ``path``; return the tensor bytes written.

    ``meta``: the header's ``__metadata__``; ``dtypes``: as :func:`header`.
    """
    head, order = header(entries, meta, dtypes)
    tensors = [_contiguous(entries[name]) for name in order]
    data = sum(t.numel() * t.element_size() for t in tensors)
    with _replacing(path, fsync=fsync) as fd:
        preallocate(fd, 8 + len(head) + data)
        out = _Gather(fd, writeback=fsync)
        out.add(memoryview(struct.pack("<Q", len(head))))
        out.add(memoryview(head))
        for tensor in tensors:
            if tensor.numel():
                out.add_large(_bytes_of(tensor))
        out.flush()
    return data


def write_bytes(path: Path, data: bytes, *, fsync: bool) -> None:
    """Write ``data`` as the file ``path`` (beside it, then renamed onto it)."""
    with _replacing(path, fsync=fsync) as fd:
        out = _Gather(fd, writeback=False)
        out.add_large(memoryview(data))
        out.flush()


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values in one dense block (copied only where they are not already)."""
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A byte view of a contiguous tensor's memory (no copy; it keeps the tensor alive)."""
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


class _Gather:
    """Buffers gathered into ``writev`` calls of at most :data:`GATHER_BYTES`."""

    def __init__(self, fd: int, *, writeback: bool) -> None:
        self.fd = fd
        self.buffers: list[memoryview] = []
        self.size = 0
        self.written = 0
        #: where the next writeback starts; None once the file system declined one
        self.writeback_from: int | None = 0 if writeback else None

    def add(self, buf: memoryview) -> None:
        """Queue ``buf`` (at most :data:`GATHER_BYTES`), writing what was queued when full."""
        if self.size + len(buf) > GATHER_BYTES or len(self.buffers) >= _MAX_BUFFERS:
            self.flush()
        self.buffers.append(buf)
        self.size += len(buf)

    def add_large(self, buf: memoryview) -> None:
        """Queue ``buf`` cut into views of at most :data:`GATHER_BYTES` (no copy)."""
        for start in range(0, len(buf), GATHER_BYTES):
            self.add(buf[start : start + GATHER_BYTES])

    def flush(self) -> None:
        """Write everything queued (a short write continues where it stopped)."""
        buffers, self.buffers, self.size = self.buffers, [], 0
        while buffers:
            if _WRITEV is not None:
                done = _WRITEV(self.fd, buffers)
            else:  # pragma: no cover - Windows
                done = os.write(self.fd, buffers[0])
            self.written += done
            while buffers and done >= len(buffers[0]):
                done -= len(buffers[0])
                buffers.pop(0)
            if done:
                buffers[0] = buffers[0][done:]
        start = self.writeback_from
        if start is not None and self.written - start >= WRITEBACK_BYTES:
            started = start_writeback(self.fd, start, self.written - start)
            self.writeback_from = self.written if started else None


@contextlib.contextmanager
def _replacing(path: Path, *, fsync: bool) -> Iterator[int]:
    """A new file beside ``path`` (its descriptor), synced and renamed onto it when the block
    ends. If the block fails, the new file is removed and ``path`` is left as it was."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(tmp, flags, 0o666)
        try:
            yield fd
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
