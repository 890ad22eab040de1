"""Read and check the zip structure of a ``.tdz`` archive, trusting nothing in it.

Archives come from anywhere. :func:`read_index` reads the central directory (zipfile, one
pass) and then every local header (one ``pread`` each) and refuses, before anything is
mapped or inflated:

* names that could leave the tree (absolute, ``..``/``.``/empty components, backslashes,
  NUL), duplicates, and a name that is both a file and a directory (``UnsafePathError``);
* encrypted entries, compression methods it cannot inflate, local headers that disagree
  with the central directory, payloads beyond the data area, and payloads that overlap
  (the "overlapping files" zip bomb) (``MetadataError``).

What it returns - every file entry with its checked payload offset, and every directory,
explicit or implied - is what :class:`tdckpt._read.archive.ArchiveStorage` reads through.
"""

from __future__ import annotations

import itertools
import os
import struct
import zipfile
from dataclasses import dataclass, field

from tdckpt.errors import MetadataError, UnsafePathError

__all__ = [
    "FLAG_LZMA_EOS",
    "LOCAL_HEADER",
    "METHOD_NAMES",
    "Directory",
    "Entry",
    "read_index",
    "where",
]

LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # signature .. extra length: 30 bytes
_LOCAL_SIGNATURE = b"PK\x03\x04"

#: Archives with more entries are refused before the zip directory is parsed (each costs
#: about 1.5 kB of memory and 50 us once indexed; a 10,000-leaf tensordict has ~10,000).
MAX_ARCHIVE_ENTRIES = 1_000_000

_FLAG_ENCRYPTED = 0x0001
FLAG_LZMA_EOS = 0x0002
_FLAG_STRONG_ENCRYPTION = 0x0040
_FLAG_UTF8 = 0x0800
METHOD_NAMES = {
    zipfile.ZIP_STORED: "stored",
    zipfile.ZIP_DEFLATED: "deflate",
    zipfile.ZIP_BZIP2: "bzip2",
    zipfile.ZIP_LZMA: "lzma",
}

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
class Entry:
    """One file entry, as checked against both of its headers."""

    name: str
    payload: int  # offset of the first payload byte in the file
    size: int  # uncompressed size (central directory)
    compress_size: int
    method: int
    crc: int
    flags: int


@dataclass
class Directory:
    """One directory of the archive: its files (name -> size) and sub-directories."""

    files: dict[str, int] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)


def where(location: str, name: str) -> str:
    """How messages name an entry of the archive at ``location``."""
    return f"{location}: entry {name!r}"


def read_index(
    fd: int, location: str, file_size: int
) -> tuple[dict[str, Entry], dict[str, Directory]]:
    """Read and check the central directory and every local header of the archive ``fd``.

    Returns the file entries and the directories (``""`` is the root), by relative path.
    ``location`` names the archive in messages.
    """
    return _Indexer(fd, location).read(file_size)


class _Indexer:
    """The checks of :func:`read_index`, on one open archive."""

    def __init__(self, fd: int, location: str) -> None:
        self._fd = fd
        self.location = location

    def _where(self, name: str) -> str:
        return where(self.location, name)

    def read(self, file_size: int) -> tuple[dict[str, Entry], dict[str, Directory]]:
        """Read and check the central directory and every local header."""
        with open(self._fd, "rb", closefd=False) as fh:
            self._check_count(fh)
        try:
            with open(self._fd, "rb", closefd=False) as fh, zipfile.ZipFile(fh) as zf:
                infos = zf.infolist()
                data_end = min(getattr(zf, "start_dir", file_size), file_size)
        except _ZIP_PARSE_ERRORS as exc:
            raise MetadataError(
                f"{self.location}: not a memory-mapped tensordict archive: the zip directory "
                f"cannot be read ({type(exc).__name__}: {exc}). Expected a .tdz written by "
                "tensordict or tdckpt; the file is truncated, damaged or not a zip file.",
                path=self.location,
            ) from exc

        if len(infos) > MAX_ARCHIVE_ENTRIES:
            self._too_many(len(infos))
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
            if info.compress_type not in METHOD_NAMES:
                raise MetadataError(
                    f"{self._where(rel)}: compression method {info.compress_type} is not "
                    f"supported (expected one of {sorted(METHOD_NAMES.values())}). Re-pack "
                    "the archive with tensordict or tdckpt.",
                    path=self.location,
                    name=rel,
                )
            files[rel] = info

        if "meta.json" not in files:
            raise MetadataError(
                f"{self.location}: not a memory-mapped tensordict archive: the zip has no "
                "top-level 'meta.json' entry. Expected a .tdz written by tensordict or tdckpt, "
                "whose root holds meta.json.",
                path=self.location,
            )

        entries = {rel: self._read_local_header(rel, info, data_end) for rel, info in files.items()}
        self._check_overlaps(entries, files)
        return entries, self._build_tree(entries, explicit_dirs)

    def _check_count(self, fh: object) -> None:
        """Refuse an archive whose end record declares more than MAX_ARCHIVE_ENTRIES.

        Read from the end-of-directory record (zip64 too) before zipfile builds one object
        per entry; the count actually parsed is checked again after.
        """
        end_record = getattr(zipfile, "_EndRecData", None)
        index = getattr(zipfile, "_ECD_ENTRIES_TOTAL", None)
        try:
            record = end_record(fh) if end_record is not None and index is not None else None
        except _ZIP_PARSE_ERRORS:
            return  # zipfile says what is wrong next
        declared = record[index] if record else 0
        if isinstance(declared, int) and declared > MAX_ARCHIVE_ENTRIES:
            self._too_many(declared)

    def _too_many(self, count: int) -> None:
        raise MetadataError(
            f"{self.location}: the zip directory holds {count} entries, more than the "
            f"{MAX_ARCHIVE_ENTRIES} tdckpt reads in one archive (a tensordict of 10,000 leaves "
            "has about 10,000). The archive is damaged or hostile; if it is genuine, save the "
            "checkpoint as a directory or in fewer, larger tensors.",
            path=self.location,
        )

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

    def _read_local_header(self, rel: str, info: zipfile.ZipInfo, data_end: int) -> Entry:
        """Find the payload of ``info`` and check its local header against the directory."""
        encoding = "utf-8" if info.flag_bits & _FLAG_UTF8 else "cp437"
        try:
            expected_name = info.orig_filename.encode(encoding)
        except UnicodeEncodeError:  # a name zipfile took from an extra field, not the header
            expected_name = b""
        start = info.header_offset
        fixed = LOCAL_HEADER.size
        head = os.pread(self._fd, fixed + len(expected_name), start) if start >= 0 else b""
        problem = None
        if len(head) < fixed or head[:4] != _LOCAL_SIGNATURE:
            problem = f"no local file header at byte {start}"
        else:
            fields = LOCAL_HEADER.unpack_from(head)
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
        return Entry(
            rel, payload, info.file_size, info.compress_size, info.compress_type,
            info.CRC, info.flag_bits,
        )  # fmt: skip

    def _check_overlaps(self, entries: dict[str, Entry], infos: dict[str, zipfile.ZipInfo]) -> None:
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

    def _build_tree(
        self, entries: dict[str, Entry], explicit_dirs: set[str]
    ) -> dict[str, Directory]:
        """Index directories, explicit (``a/`` entries) and implicit (path prefixes)."""
        tree: dict[str, Directory] = {"": Directory()}

        def ensure(rel: str) -> Directory:
            # Iterative: a hostile name may have tens of thousands of components.
            node = tree.get(rel)
            if node is not None:
                return node
            node = tree[rel] = Directory()
            child = rel
            while child:  # register the new directory in each parent, up to a known one
                parent, _, base = child.rpartition("/")
                holder = tree.get(parent)
                if holder is not None:
                    holder.dirs.add(base)
                    break
                holder = tree[parent] = Directory()
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
