"""``.tdz`` archives: a read-only :class:`Storage` over a zip file, and its writer.

A ``.tdz`` (tensordict >= 0.14, format-notes.md §1.9) is a standard zip whose entry tree is
the checkpoint directory tree: ``meta.json`` per level, ``*.memmap`` leaves, encoded names.
tensordict STORES the leaves and pads each local header so that every leaf payload starts
on a 64-byte boundary; the whole file can then be mapped once and every leaf is a zero-copy
view into that mapping.

Archives come from anywhere, so the reader trusts nothing it has not checked. Opening one
reads the central directory (zipfile, one pass) and then every local header (one ``pread``
each) and refuses, before anything is mapped:

* names that could leave the tree (absolute, ``..``/``.``/empty components, backslashes,
  NUL), duplicates, and a name that is both a file and a directory (``UnsafePathError``);
* encrypted entries, compression methods it cannot inflate, local headers that disagree
  with the central directory, payloads beyond the data area, and payloads that overlap
  (the "overlapping files" zip bomb) (``MetadataError``).

Inflating never produces more than the size the central directory declares, and a size is
checked against the caller's limit before a byte is inflated.
"""

from __future__ import annotations

import bz2
import itertools
import lzma
import mmap
import os
import secrets
import shutil
import stat
import struct
import threading
import weakref
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO, NoReturn, Protocol

import torch

from ._storage import (
    MAX_JSON_BYTES,
    DirectoryStorage,
    Listing,
    MapMode,
    Storage,
    check_component,
    join,
)
from .errors import CheckpointExistsError, CheckpointNotFoundError, MetadataError, UnsafePathError

__all__ = ["ALIGNMENT", "ArchiveStorage", "write_archive"]

#: Payload alignment of STORED ``.memmap`` entries (tensordict's ``_ALIGNMENT``): a multiple
#: of every dtype's itemsize, so a leaf can always be viewed in place.
ALIGNMENT = 64

# Local-header extra block that pads payloads to ALIGNMENT; spells b"td" (tensordict's id).
_PAD_EXTRA_ID = 0x6474
# zipfile appends this many bytes of zip64 extra to a local header under force_zip64=True.
_ZIP64_LOCAL_EXTRA_SIZE = 20
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # signature .. extra length: 30 bytes
_LOCAL_SIGNATURE = b"PK\x03\x04"

_FLAG_ENCRYPTED = 0x0001
_FLAG_LZMA_EOS = 0x0002
_FLAG_STRONG_ENCRYPTION = 0x0040
_FLAG_UTF8 = 0x0800
_METHOD_NAMES = {
    zipfile.ZIP_STORED: "stored",
    zipfile.ZIP_DEFLATED: "deflate",
    zipfile.ZIP_BZIP2: "bzip2",
    zipfile.ZIP_LZMA: "lzma",
}
_WRITE_METHODS = {"stored": zipfile.ZIP_STORED, "deflate": zipfile.ZIP_DEFLATED}

_READ_CHUNK = 1 << 20  # compressed bytes per pread while inflating
_INFLATE_CHUNK = 16 << 20  # inflated bytes per step: bounds memory beyond the kept prefix
_COPY_CHUNK = 16 << 20  # bytes per read when packing a leaf
# Fixed entry timestamp (the zip epoch): the same directory always packs to the same bytes.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)

# What zipfile raises on a hostile central directory, besides BadZipFile: bad UTF-8 names,
# truncated structures, negative seeks, "zip file version" for unknown extract versions.
_ZIP_PARSE_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    ValueError,
    struct.error,
    EOFError,
    OverflowError,
    NotImplementedError,
    IndexError,
    KeyError,
    OSError,
)


@dataclass(frozen=True, slots=True)
class _Entry:
    """One file entry, as checked against both of its headers."""

    name: str
    payload: int  # offset of the first payload byte in the file
    size: int  # uncompressed size (central directory)
    compress_size: int
    method: int
    crc: int
    flags: int


@dataclass
class _Dir:
    files: dict[str, int] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)


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

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.location = os.fspath(path)
        self._lock = threading.Lock()
        self._private: torch.Tensor | None = None
        self._shared: torch.Tensor | None = None
        try:
            fd = os.open(self.location, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
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
                f"{self.location}: not a tensordict archive (not a regular file). Expected "
                "a .tdz zip file or a checkpoint directory.",
                path=self.location,
            )
        self._stat = (st.st_dev, st.st_ino, st.st_size)
        try:
            self._entries, self._tree = self._index(st.st_size)
        except BaseException:
            self.close()
            raise
        # mode="r+" refuses archives with any compressed entry; found once, not per leaf.
        self._first_compressed = min(
            (e.name for e in self._entries.values() if e.method != zipfile.ZIP_STORED),
            default=None,
        )

    # -- opening ---------------------------------------------------------------------
    def _where(self, name: str) -> str:
        return f"{self.location}: entry {name!r}"

    def _index(self, file_size: int) -> tuple[dict[str, _Entry], dict[str, _Dir]]:
        """Read and check the central directory and every local header."""
        try:
            with open(self._fd, "rb", closefd=False) as fh, zipfile.ZipFile(fh) as zf:
                infos = zf.infolist()
                data_end = min(getattr(zf, "start_dir", file_size), file_size)
        except _ZIP_PARSE_ERRORS as exc:
            raise MetadataError(
                f"{self.location}: not a tensordict archive: the zip directory cannot be "
                f"read ({type(exc).__name__}: {exc}). Expected a .tdz written by tensordict "
                "or tdckpt; the file is truncated, damaged or not a zip file.",
                path=self.location,
            ) from exc

        files: dict[str, zipfile.ZipInfo] = {}
        explicit_dirs: set[str] = set()
        for info in infos:
            rel, is_dir = self._check_name(info.orig_filename)
            # "a" beside "a/" is a file/directory clash, caught once the tree is built.
            if rel in (explicit_dirs if is_dir else files):
                raise UnsafePathError(
                    f"{self._where(info.orig_filename)}: the name appears twice in the zip "
                    "directory. Readers disagree on which copy wins, so tdckpt reads "
                    "neither; the archive is damaged or hostile. Re-create it from the "
                    "original checkpoint.",
                    path=self.location,
                    name=info.orig_filename,
                )
            if is_dir:
                explicit_dirs.add(rel)
                continue
            if info.flag_bits & (_FLAG_ENCRYPTED | _FLAG_STRONG_ENCRYPTION):
                raise MetadataError(
                    f"{self._where(rel)}: the entry is encrypted (flag bits "
                    f"{info.flag_bits:#06x}). tdckpt reads only plain entries, as tensordict "
                    "writes them; decrypt the archive (unzip, then re-pack) first.",
                    path=self.location,
                    name=rel,
                )
            if info.compress_type not in _METHOD_NAMES:
                raise MetadataError(
                    f"{self._where(rel)}: compression method {info.compress_type} is not "
                    f"supported (expected one of {sorted(_METHOD_NAMES.values())}). Re-pack "
                    "the archive with tensordict or tdckpt.",
                    path=self.location,
                    name=rel,
                )
            files[rel] = info

        if "meta.json" not in files:
            raise MetadataError(
                f"{self.location}: not a tensordict archive: the zip has no top-level "
                "'meta.json' entry. Expected a .tdz written by tensordict or tdckpt, whose "
                "root holds meta.json.",
                path=self.location,
            )

        entries = {rel: self._read_local_header(rel, info, data_end) for rel, info in files.items()}
        self._check_overlaps(entries, files)
        return entries, self._build_tree(entries, explicit_dirs)

    def _check_name(self, name: str) -> tuple[str, bool]:
        """Return ``(relative path, is a directory entry)``; refuse zip-slip names."""
        is_dir = name.endswith("/")
        rel = name[:-1] if is_dir else name
        reason = None
        if "\0" in name:
            reason = "contains a NUL character"
        elif "\\" in name:
            reason = "contains a backslash (a path separator on Windows)"
        elif name.startswith("/"):
            reason = "is an absolute path"
        elif any(part in ("", ".", "..") for part in rel.split("/")):
            reason = "has an empty, '.' or '..' component"
        if reason is not None:
            raise UnsafePathError(
                f"{self._where(name)}: the name {reason}, so it could resolve outside the "
                "checkpoint (zip-slip). Expected a relative POSIX path such as "
                "'nested/a%20b.memmap'. The archive is damaged or hostile: do not extract "
                "it; re-create it from a trusted copy.",
                path=self.location,
                name=name,
            )
        return rel, is_dir

    def _read_local_header(self, rel: str, info: zipfile.ZipInfo, data_end: int) -> _Entry:
        """Find the payload of ``info`` and check its local header against the directory."""
        encoding = "utf-8" if info.flag_bits & _FLAG_UTF8 else "cp437"
        try:
            expected_name = info.orig_filename.encode(encoding)
        except UnicodeEncodeError:  # a name zipfile took from an extra field, not the header
            expected_name = b""
        start = info.header_offset
        fixed = _LOCAL_HEADER.size
        head = os.pread(self._fd, fixed + len(expected_name), start) if start >= 0 else b""
        problem = None
        if len(head) < fixed or head[:4] != _LOCAL_SIGNATURE:
            problem = f"no local file header at byte {start}"
        else:
            fields = _LOCAL_HEADER.unpack_from(head)
            flags, method, name_len, extra_len = fields[2], fields[3], fields[9], fields[10]
            local_name = head[fixed : fixed + name_len]
            if name_len != len(expected_name) or local_name != expected_name:
                problem = f"the local header names {local_name!r} instead"
            elif method != info.compress_type:
                problem = (
                    f"the local header says compression method {method}, the central "
                    f"directory {info.compress_type}"
                )
            elif flags & (_FLAG_ENCRYPTED | _FLAG_STRONG_ENCRYPTION):
                problem = "the local header marks the entry as encrypted"
        if problem is not None:
            raise MetadataError(
                f"{self._where(rel)}: {problem}; expected a local header that matches the "
                "central directory. Zip readers would disagree about this entry, so tdckpt "
                "refuses it; the archive is damaged or hostile. Re-create it.",
                path=self.location,
                name=rel,
            )
        payload = start + fixed + name_len + extra_len
        end = payload + info.compress_size
        if end > data_end:
            raise MetadataError(
                f"{self._where(rel)}: its data (bytes {payload}..{end}) runs past the end of "
                f"the archive's data area (byte {data_end}); expected every payload before "
                "the zip directory. The archive is truncated or damaged; re-create it.",
                path=self.location,
                name=rel,
            )
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise MetadataError(
                f"{self._where(rel)}: a stored entry whose stored size ({info.compress_size}) "
                f"differs from its size ({info.file_size}); expected them equal. The archive "
                "is damaged or hostile; re-create it.",
                path=self.location,
                name=rel,
            )
        return _Entry(
            rel, payload, info.file_size, info.compress_size, info.compress_type,
            info.CRC, info.flag_bits,
        )  # fmt: skip

    def _check_overlaps(
        self, entries: dict[str, _Entry], infos: dict[str, zipfile.ZipInfo]
    ) -> None:
        """Refuse two entries whose local records share bytes (overlap zip bombs)."""
        spans = sorted(
            (infos[rel].header_offset, e.payload + e.compress_size, rel)
            for rel, e in entries.items()
        )
        for (_, end, prev), (start, _, rel) in itertools.pairwise(spans):
            if start < end:
                raise MetadataError(
                    f"{self._where(rel)}: its header (byte {start}) lies inside the data of "
                    f"entry {prev!r} (which ends at byte {end}); expected entries that do not "
                    "overlap. Overlapping entries are a zip-bomb technique; the archive is "
                    "hostile or damaged. Re-create it.",
                    path=self.location,
                    name=rel,
                )

    def _build_tree(self, entries: dict[str, _Entry], explicit_dirs: set[str]) -> dict[str, _Dir]:
        """Index directories, explicit (``a/`` entries) and implicit (path prefixes)."""
        tree: dict[str, _Dir] = {"": _Dir()}

        def ensure(rel: str) -> _Dir:
            # Iterative: a hostile name may have tens of thousands of components.
            node = tree.get(rel)
            if node is not None:
                return node
            node = tree[rel] = _Dir()
            child = rel
            while child:  # register the new directory in each parent, up to a known one
                parent, _, base = child.rpartition("/")
                holder = tree.get(parent)
                if holder is not None:
                    holder.dirs.add(base)
                    break
                holder = tree[parent] = _Dir()
                holder.dirs.add(base)
                child = parent
            return node

        for rel in explicit_dirs:
            ensure(rel)
        for rel, entry in entries.items():
            parent, _, base = rel.rpartition("/")
            ensure(parent).files[base] = entry.size
        clash = next((rel for rel in entries if rel in tree), None)
        if clash is not None:
            raise UnsafePathError(
                f"{self._where(clash)}: the name is both a file and a directory in the "
                "archive; expected each path to be one or the other. The archive is damaged "
                "or hostile; re-create it.",
                path=self.location,
                name=clash,
            )
        return tree

    # -- Storage interface -----------------------------------------------------------
    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ValueError(f"{self.location}: the archive storage is closed.")

    def _split(self, rel: str) -> str:
        for part in rel.split("/") if rel else []:
            check_component(part, where=self.display(rel))
        return rel

    def _entry(self, rel: str) -> _Entry:
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
            return data
        return bytes(self._inflate(entry, entry.size))

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
    def _map_shared(self, entry: _Entry, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
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
        mmap maps the descriptor that was validated, not whatever the path names now.
        ACCESS_COPY and ACCESS_WRITE are writable buffers, so frombuffer does not warn.
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
            if shared:
                buffer = self._map_writable()
            else:
                buffer = mmap.mmap(self._fd, self._stat[2], access=mmap.ACCESS_COPY)
            base = torch.frombuffer(buffer, dtype=torch.uint8)
            if shared:
                self._shared = base
            else:
                self._private = base
            return base

    def _map_writable(self) -> mmap.mmap:
        try:
            fd = os.open(self.location, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except PermissionError as exc:
            raise PermissionError(
                exc.errno,
                f"{self.location}: mode='r+' needs a writable archive; use mode='r' or "
                "mode=None, or make the file writable",
            ) from exc
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino, st.st_size) != self._stat:
                raise MetadataError(
                    f"{self.location}: the archive was replaced or resized since it was "
                    "opened; reopen it before mapping it with mode='r+'.",
                    path=self.location,
                )
            return mmap.mmap(fd, self._stat[2], access=mmap.ACCESS_WRITE)
        finally:
            os.close(fd)  # mmap holds its own duplicate

    # -- inflating -------------------------------------------------------------------
    def _corrupt(self, entry: _Entry, what: str) -> NoReturn:
        raise MetadataError(
            f"{self._where(entry.name)}: {what} ({_METHOD_NAMES[entry.method]}, "
            f"{entry.compress_size} bytes stored, {entry.size} declared). The archive is "
            "damaged or hostile; re-create it from the original checkpoint.",
            path=self.location,
            name=entry.name,
        )

    def _inflate(self, entry: _Entry, keep: int) -> bytearray:
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
            entry.method == zipfile.ZIP_LZMA and not entry.flags & _FLAG_LZMA_EOS
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


def _decoder(entry: _Entry) -> _Decoder:
    if entry.method == zipfile.ZIP_DEFLATED:
        return _Inflate()
    if entry.method == zipfile.ZIP_BZIP2:
        return bz2.BZ2Decompressor()
    return _ZipLzma(entry.size)


# -- writing -------------------------------------------------------------------------
def write_archive(
    source_dir: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    compression: str = "stored",
    fsync: bool = True,
) -> None:
    """Pack a checkpoint directory into a ``.tdz`` that tensordict 0.15.3 loads.

    The layout is tensordict's own (``pack_memmap``): per level ``meta.json`` first, then
    the other files by name, then sub-directories; ``.memmap`` payloads 64-byte aligned by
    a ``0x6474`` local-header extra block; every entry zip64; side files stored. Timestamps
    are fixed, so one directory always packs to the same bytes.

    The archive is written to a temporary file beside ``dest``, synced, and renamed onto
    ``dest``: a crash leaves the old ``dest`` (or none), never a partial one.

    Args:
        source_dir: a checkpoint directory (holding ``meta.json``).
        dest: the archive to create or replace; its directory must exist.
        compression: ``"stored"`` (mappable without copies) or ``"deflate"``; applies to
            ``.memmap`` entries only.
        fsync: sync the archive and its directory to disk (off only for tests and
            throw-away archives).

    Raises:
        CheckpointNotFoundError: ``source_dir`` or ``dest``'s directory does not exist.
        MetadataError: ``source_dir`` has no ``meta.json``.
        UnsafePathError: ``dest`` lies inside ``source_dir``, or the directory holds a
            name an archive cannot carry safely (backslash, non-UTF-8, unsafe symlink).
        CheckpointExistsError: ``dest`` is a directory.

    Example:
        >>> write_archive("runs/exp1/1000", "exp1-1000.tdz")  # doctest: +SKIP
    """
    if compression not in _WRITE_METHODS:
        raise ValueError(f"compression must be 'stored' or 'deflate', got {compression!r}")
    method = _WRITE_METHODS[compression]
    source, target = Path(source_dir), Path(dest)
    if not source.is_dir():
        raise CheckpointNotFoundError(
            f"{source}: no such checkpoint directory to pack.", path=str(source)
        )
    if not (source / "meta.json").is_file():
        raise MetadataError(
            f"{source}: not a checkpoint directory (no meta.json); expected the directory "
            "that holds the top-level meta.json.",
            path=str(source),
        )
    if target.is_dir():
        raise CheckpointExistsError(
            f"{target}: is a directory; expected a .tdz file path to write.", path=str(target)
        )
    parent = target.parent
    if not parent.is_dir():
        raise CheckpointNotFoundError(
            f"{parent}: the destination directory does not exist; create it first.",
            path=str(parent),
        )
    real_source = os.path.realpath(source)
    if os.path.realpath(parent).startswith(real_source.rstrip(os.sep) + os.sep) or (
        os.path.realpath(parent) == real_source
    ):
        raise UnsafePathError(
            f"{target}: the archive would be written inside the directory it packs "
            f"({source}); choose a destination outside it.",
            path=str(target),
        )
    files = list(_walk(DirectoryStorage(source), ""))  # check every name before writing

    tmp = parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
    # os.open with 0o666 lets the umask decide the final mode, as for any new file.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with open(fd, "wb") as fh:
            with zipfile.ZipFile(fh, "w", allowZip64=True) as zf:
                for arcname, path in files:
                    _write_entry(zf, fh, arcname, path, method)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(parent)


def _walk(storage: DirectoryStorage, rel: str) -> Iterator[tuple[str, Path]]:
    """Yield ``(entry name, file)`` in tensordict's order, refusing unsafe names."""
    listing = storage.listdir(rel)
    if listing.unsafe:
        name, reason = sorted(listing.unsafe.items())[0]
        raise UnsafePathError(
            f"{storage.display(join(rel, name))}: {reason}; an archive cannot carry it. "
            "Replace it with a regular file inside the checkpoint.",
            path=storage.display(join(rel, name)),
        )
    names = sorted(listing.files)
    for name in [n for n in names if n == "meta.json"] + [n for n in names if n != "meta.json"]:
        arcname = join(rel, name)
        _check_writable_name(storage, arcname)
        path = storage.physical_path(arcname)
        assert path is not None  # a DirectoryStorage always has one
        yield arcname, path
    for name in sorted(listing.dirs):
        _check_writable_name(storage, join(rel, name))
        yield from _walk(storage, join(rel, name))


def _check_writable_name(storage: DirectoryStorage, arcname: str) -> None:
    # The reader refuses these, so the writer must not produce them.
    try:
        arcname.encode("utf-8")
        bad = "\\" in arcname
    except UnicodeEncodeError:
        bad = True
    if bad:
        raise UnsafePathError(
            f"{storage.display(arcname)}: the name holds a backslash or is not valid UTF-8, "
            "so it cannot be stored safely in an archive. Rename the key with robust "
            "(percent-encoded) names first.",
            path=storage.display(arcname),
        )


def _padding_extra(header_offset: int, name_len: int) -> bytes:
    """The ``0x6474`` extra block that puts the payload on an ALIGNMENT boundary.

    The payload starts after the 30-byte header, the name, this block (4 + pad bytes)
    and the 20-byte zip64 block zipfile appends under ``force_zip64``.
    """
    start = header_offset + _LOCAL_HEADER.size + name_len + 4 + _ZIP64_LOCAL_EXTRA_SIZE
    pad = -start % ALIGNMENT
    return struct.pack("<HH", _PAD_EXTRA_ID, pad) + b"\0" * pad


def _write_entry(zf: zipfile.ZipFile, fh: BinaryIO, arcname: str, path: Path, method: int) -> None:
    leaf = arcname.endswith(".memmap")
    zinfo = zipfile.ZipInfo(arcname, date_time=_ZIP_EPOCH)
    zinfo.compress_type = method if leaf else zipfile.ZIP_STORED
    zinfo.external_attr = 0o644 << 16
    with open(path, "rb") as src:
        zinfo.file_size = os.fstat(src.fileno()).st_size
        align = leaf and zinfo.compress_type == zipfile.ZIP_STORED
        if align:
            # zf.start_dir is where zipfile writes the next local header (as tensordict uses).
            zinfo.extra = _padding_extra(zf.start_dir, len(arcname.encode("utf-8")))
        with zf.open(zinfo, "w", force_zip64=True) as dst:
            if align and fh.tell() % ALIGNMENT:
                raise RuntimeError(
                    f"internal error: the payload of {arcname!r} is not {ALIGNMENT}-byte "
                    "aligned; zipfile's local header layout changed. Please report it."
                )
            _copy(src, dst)


def _copy(src: IO[bytes], dst: IO[bytes]) -> None:
    """Stream one file into its entry in bounded chunks (leaves can be huge)."""
    shutil.copyfileobj(src, dst, _COPY_CHUNK)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
