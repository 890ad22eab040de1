"""``.tdz`` archives: a read-only :class:`Storage` over a zip file.

A ``.tdz`` (tensordict >= 0.14, format-notes.md §1.9) is a standard zip whose entry tree is
the checkpoint directory tree: ``meta.json`` per level, ``*.memmap`` leaves, encoded names.
tensordict STORES the leaves and pads each local header so that every leaf payload starts
on a 64-byte boundary; the whole file can then be mapped once and every leaf is a zero-copy
view into that mapping.

Archives come from anywhere, so :class:`ArchiveStorage` opens one only after
:mod:`tdckpt._read.archive_index` has checked its whole zip structure (names, headers, bounds,
overlaps). Inflating never produces more than the size the central directory declares,
and a size is checked against the caller's limit before a byte is inflated.

The writer, :func:`write_archive`, lives in :mod:`tdckpt._write.archive_write`.
"""

from __future__ import annotations

import bz2
import lzma
import mmap
import os
import stat
import struct
import threading
import weakref
import zipfile
import zlib
from typing import NoReturn, Protocol

import torch

from tdckpt._read.archive_index import FLAG_LZMA_EOS, METHOD_NAMES, Entry, read_index, where
from tdckpt._read.expected import check_read
from tdckpt._read.mapping import map_reopened_writable
from tdckpt._read.storage import MAX_JSON_BYTES, Listing, MapMode, Storage, check_component
from tdckpt.errors import CheckpointNotFoundError, MetadataError

__all__ = ["ArchiveStorage"]

#: Opening the archive: a FIFO opens at once (fstat refuses it), a tty never controls us.
_OPEN_FLAGS = sum(getattr(os, flag, 0) for flag in ("O_CLOEXEC", "O_NONBLOCK", "O_NOCTTY"))
_READ_CHUNK = 1 << 20  # compressed bytes per pread while inflating
_INFLATE_CHUNK = 16 << 20  # inflated bytes per step: bounds memory beyond the kept prefix


class ArchiveStorage(Storage):
    """A checkpoint packed into one ``.tdz`` zip archive (read-only, except ``mode="r+"``).

    The archive is validated when it is opened; leaves are mapped lazily. All tensors
    returned in one mode share one mapping of the file, created on the first ``map``:
    private (copy-on-write) for ``mode=None``/``"r"``, shared for ``mode="r+"``.

    Example:
        >>> with ArchiveStorage("ckpt.tdz") as storage:  # doctest: +SKIP
        ...     meta = storage.read_json("meta.json")
        ...     a = storage.map("a.memmap", torch.float32, 6, mode="r")
    """

    kind = "archive"

    def __init__(self, path: str | os.PathLike[str], *, location: str | None = None) -> None:
        #: ``location``: the name messages use, when it is not ``path`` (an archive read
        #: from object storage into an anonymous in-memory file is named by its URL).
        self.location = os.fspath(path) if location is None else location
        opened = os.fspath(path)
        self._lock = threading.Lock()
        self._private: torch.Tensor | None = None
        self._shared: torch.Tensor | None = None
        try:
            # Opened once: the index is read, every entry read and every mapping made from
            # this one descriptor, never from the path again. O_NONBLOCK: a FIFO put where
            # the archive was opens at once (and fstat refuses it) instead of hanging.
            fd = os.open(opened, os.O_RDONLY | _OPEN_FLAGS)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.location}: no such archive. Check the path.", path=self.location
            ) from exc
        # A raw fd (not a file object): nothing to warn about if the storage is dropped
        # without close(), and the mapping is made from the very file that was validated.
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            self.close()
            raise MetadataError(
                f"{self.location}: not a memory-mapped tensordict archive (not a regular "
                "file). Expected a .tdz zip file or a checkpoint directory.",
                path=self.location,
            )
        self._stat = (st.st_dev, st.st_ino, st.st_size)
        try:
            self._entries, self._tree = read_index(fd, self.location, st.st_size)
        except BaseException:
            self.close()
            raise
        # mode="r+" refuses archives with any compressed entry; found once, not per leaf.
        self._first_compressed = min(
            (e.name for e in self._entries.values() if e.method != zipfile.ZIP_STORED),
            default=None,
        )

    # -- Storage interface -----------------------------------------------------------
    def _where(self, name: str) -> str:
        return where(self.location, name)

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ValueError(f"{self.location}: the archive storage is closed.")

    def _split(self, rel: str) -> str:
        for part in rel.split("/") if rel else []:
            check_component(part, where=self.display(rel))
        return rel

    def _entry(self, rel: str) -> Entry:
        self._check_open()
        entry = self._entries.get(self._split(rel))
        if entry is None:
            if rel in self._tree:
                raise MetadataError(
                    f"{self.display(rel)}: expected a file, found a directory.",
                    path=self.display(rel),
                )
            raise CheckpointNotFoundError(
                f"{self.display(rel)}: no such entry in the archive.", path=self.display(rel)
            )
        return entry

    def listdir(self, rel: str) -> Listing:
        self._check_open()
        node = self._tree.get(self._split(rel))
        if node is None:
            if rel in self._entries:
                raise MetadataError(
                    f"{self.display(rel)}: expected a directory, found a file.",
                    path=self.display(rel),
                )
            raise CheckpointNotFoundError(
                f"{self.display(rel)}: no such directory in the archive.",
                path=self.display(rel),
            )
        return Listing(files=dict(node.files), dirs=set(node.dirs))

    def read_bytes(self, rel: str, *, max_bytes: int = MAX_JSON_BYTES) -> bytes:
        entry = self._entry(rel)
        # Checked on the declared size, before a single byte is read or inflated.
        if entry.size > max_bytes:
            raise MetadataError(
                f"{self._where(rel)}: declares {entry.size} bytes, more than the {max_bytes} "
                "bytes tdckpt reads for a metadata file. The archive is damaged or hostile "
                "(a zip bomb declares huge sizes); re-create it.",
                path=self.location,
                name=rel,
            )
        if entry.method == zipfile.ZIP_STORED:
            data = os.pread(self._fd, entry.size, entry.payload)
            if len(data) != entry.size:
                self._corrupt(entry, f"only {len(data)} of its {entry.size} bytes could be read")
            # Stored leaves are exempt, as in tensordict: mode="r+" writes them in place and
            # leaves their CRC stale (refresh_archive_checksums), yet they are still valid.
            if not rel.endswith(".memmap") and zlib.crc32(data) != entry.crc:
                self._corrupt(entry, "its CRC-32 does not match the zip directory")
        else:
            data = bytes(self._inflate(entry, entry.size))
        check_read(self, rel, data)  # a managed step's manifest, when one is declared
        return data

    def map(self, rel: str, dtype: torch.dtype, numel: int, *, mode: MapMode) -> torch.Tensor:
        if mode not in (None, "r", "r+"):
            raise ValueError(f"mode must be None, 'r' or 'r+', got {mode!r}")
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        entry = self._entry(rel)
        nbytes = numel * dtype.itemsize
        if nbytes > entry.size:
            # Never read past the entry: the bytes beyond belong to other entries.
            raise MetadataError(
                f"{self._where(rel)}: holds {entry.size} bytes, but {numel} elements of "
                f"{dtype} need {nbytes}. The metadata and the leaf disagree; the checkpoint "
                "is damaged.",
                path=self.location,
                name=rel,
            )
        if mode == "r+":
            return self._map_shared(entry, dtype, nbytes)
        if entry.method != zipfile.ZIP_STORED:
            return torch.frombuffer(self._inflate(entry, nbytes), dtype=torch.uint8).view(dtype)
        flat = self._mapping(shared=False)[entry.payload : entry.payload + nbytes]
        if entry.payload % dtype.itemsize:
            # An archive packed by a plain zip tool: the view would be misaligned, so copy.
            flat = flat.clone()
        return flat.view(dtype)

    def close(self) -> None:
        """Drop this storage's mapping references and close the file.

        Tensors already returned stay valid: each keeps the mapping it views alive.
        """
        with self._lock:
            self._private = self._shared = None
        self._finalizer()

    # -- mapping ---------------------------------------------------------------------
    def _map_shared(self, entry: Entry, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        first = self._first_compressed
        if first is not None:
            raise MetadataError(
                f"{self.location}: mode='r+' needs an archive without compressed entries, "
                f"but entry {first!r} (at least) is compressed, and writes to an inflated "
                "copy could never reach the file. Use mode='r', or re-pack the archive with "
                "compression='stored'.",
                path=self.location,
                name=first,
            )
        if entry.payload % dtype.itemsize:
            raise MetadataError(
                f"{self._where(entry.name)}: mode='r+' needs a payload aligned to "
                f"{dtype.itemsize} bytes for {dtype}, found offset {entry.payload} (packed by "
                "a plain zip tool?). Use mode='r', or re-pack the archive with tdckpt.",
                path=self.location,
                name=entry.name,
            )
        return self._mapping(shared=True)[entry.payload : entry.payload + nbytes].view(dtype)

    def _mapping(self, *, shared: bool) -> torch.Tensor:
        """The whole file as one uint8 tensor, mapped on first use.

        mmap + ``torch.frombuffer`` rather than ``torch.from_file``: both map lazily at the
        same speed (measured on a 1 GiB file: ~0.1 ms to map, equal page-fault cost), but
        mmap maps the descriptor that was validated, not whatever the path names now, and
        never grows the file (it refuses a length past the end; ``from_file(shared=True)``
        would ftruncate the file up to it). ACCESS_COPY and ACCESS_WRITE are writable
        buffers, so frombuffer does not warn.

        A file truncated *after* it was mapped cannot be guarded against: touching the
        lost pages raises SIGBUS, as with every memory map.
        """
        with self._lock:
            self._check_open()
            cached = self._shared if shared else self._private
            if cached is not None:
                return cached
            st = os.fstat(self._fd)
            if st.st_size != self._stat[2]:
                raise MetadataError(
                    f"{self.location}: the archive changed size since it was opened "
                    f"({self._stat[2]} -> {st.st_size} bytes); reopen it.",
                    path=self.location,
                )
            try:
                if shared:
                    buffer = self._map_writable()
                else:
                    buffer = mmap.mmap(self._fd, self._stat[2], access=mmap.ACCESS_COPY)
            except ValueError as exc:
                # mmap refuses a length past the end of the file: truncated just now.
                raise MetadataError(
                    f"{self.location}: the archive was truncated since it was opened "
                    f"({exc}); reopen it.",
                    path=self.location,
                ) from exc
            base = torch.frombuffer(buffer, dtype=torch.uint8)
            if shared:
                self._shared = base
            else:
                self._private = base
            return base

    def _map_writable(self) -> mmap.mmap:
        """A shared, writable mapping of the very file that was opened and validated."""
        return map_reopened_writable(self._fd, self.location, self._stat, self._stat[2])

    # -- inflating -------------------------------------------------------------------
    def _corrupt(self, entry: Entry, what: str) -> NoReturn:
        raise MetadataError(
            f"{self._where(entry.name)}: {what} ({METHOD_NAMES[entry.method]}, "
            f"{entry.compress_size} bytes stored, {entry.size} declared). The archive is "
            "damaged or hostile; re-create it from the original checkpoint.",
            path=self.location,
            name=entry.name,
        )

    def _inflate(self, entry: Entry, keep: int) -> bytearray:
        """Inflate ``entry``, verifying its size and CRC-32; return its first ``keep`` bytes.

        The whole stream is inflated (the CRC covers it all), but output is produced in
        bounded steps and never beyond the declared size, and memory grows with the bytes
        actually produced, not with what a header claims.
        """
        self._check_open()
        out = bytearray()
        decoder = _decoder(entry)
        pos, end = entry.payload, entry.payload + entry.compress_size
        produced = crc = stalls = 0
        while not decoder.eof:
            data = b""
            if decoder.needs_input and pos < end:
                data = os.pread(self._fd, min(_READ_CHUNK, end - pos), pos)
                if not data:
                    self._corrupt(entry, "its compressed data is cut short")
                pos += len(data)
            limit = min(_INFLATE_CHUNK, entry.size - produced + 1)  # +1 detects excess
            try:
                piece = decoder.decompress(data, limit)
            except (zlib.error, lzma.LZMAError, OSError, EOFError, ValueError) as exc:
                # bz2 reports bad data as OSError, lzma headers as ValueError here.
                self._corrupt(entry, f"its compressed data is invalid ({exc})")
            if produced + len(piece) > entry.size:
                self._corrupt(entry, "it inflates to more bytes than it declares")
            crc = zlib.crc32(piece, crc)
            if produced < keep:
                out += memoryview(piece)[: keep - produced]
            produced += len(piece)
            if piece or data:
                stalls = 0
            elif decoder.needs_input and pos >= end:
                break  # input exhausted before the end of the stream
            else:
                stalls += 1
                if stalls > 2:
                    self._corrupt(entry, "its compressed stream makes no progress")
        ended = decoder.eof or (
            entry.method == zipfile.ZIP_LZMA and not entry.flags & FLAG_LZMA_EOS
        )
        if produced != entry.size or not ended:
            self._corrupt(entry, f"it inflates to {produced} bytes, not the declared size")
        if decoder.unused_data or pos != end:
            self._corrupt(entry, "its compressed stream ends before its stored data does")
        if crc != entry.crc:
            self._corrupt(entry, "its CRC-32 does not match the zip directory")
        return out


class _Decoder(Protocol):
    @property
    def eof(self) -> bool: ...
    @property
    def needs_input(self) -> bool: ...
    @property
    def unused_data(self) -> bytes: ...

    def decompress(self, data: bytes, max_length: int) -> bytes: ...


class _Inflate:
    """zlib raw-deflate with bz2/lzma's interface (keeps its own unconsumed input)."""

    def __init__(self) -> None:
        self._z = zlib.decompressobj(-zlib.MAX_WBITS)
        self._tail = b""

    @property
    def eof(self) -> bool:
        return self._z.eof

    @property
    def needs_input(self) -> bool:
        return not self._tail

    @property
    def unused_data(self) -> bytes:
        return self._z.unused_data

    def decompress(self, data: bytes, max_length: int) -> bytes:
        out = self._z.decompress(self._tail + data if self._tail else data, max_length)
        self._tail = self._z.unconsumed_tail
        return out


class _ZipLzma:
    """LZMA as zip stores it: 2-byte version, 2-byte properties size, 5 properties bytes."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._head = b""
        self._d: lzma.LZMADecompressor | None = None

    @property
    def eof(self) -> bool:
        return self._d is not None and self._d.eof

    @property
    def needs_input(self) -> bool:
        return self._d is None or self._d.needs_input

    @property
    def unused_data(self) -> bytes:
        return b"" if self._d is None else self._d.unused_data

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if self._d is None:
            self._head += data
            if len(self._head) >= 4 and struct.unpack_from("<H", self._head, 2)[0] != 5:
                raise ValueError("unexpected LZMA properties size")
            if len(self._head) < 9:
                return b""
            props = self._head[4:9]
            if props[0] >= 9 * 5 * 5:
                raise ValueError("invalid LZMA properties")
            lc, rest = props[0] % 9, props[0] // 9
            # No match reaches further back than the output, so a dictionary larger than
            # the declared size is never needed: clamp it (a hostile header can ask for 4 GiB).
            dict_size = max(4096, min(struct.unpack_from("<I", props, 1)[0], self._size))
            filters = [{"id": lzma.FILTER_LZMA1, "lc": lc, "lp": rest % 5, "pb": rest // 5,
                        "dict_size": dict_size}]  # fmt: skip
            self._d = lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=filters)
            data, self._head = self._head[9:], b""
        return self._d.decompress(data, max_length)


def _decoder(entry: Entry) -> _Decoder:
    if entry.method == zipfile.ZIP_DEFLATED:
        return _Inflate()
    if entry.method == zipfile.ZIP_BZIP2:
        return bz2.BZ2Decompressor()
    return _ZipLzma(entry.size)
