"""Pack a checkpoint directory into a ``.tdz`` archive that tensordict 0.15.3 loads.

:func:`write_archive` lays the archive out as tensordict's ``pack_memmap`` does - per level
``meta.json`` first, then the other files by name, then sub-directories - and STORES the
``.memmap`` leaves with each payload padded to a 64-byte boundary (:data:`ALIGNMENT`), so
that a reader can map the whole file once and view every leaf in place. It writes a
temporary file beside the destination and renames it into place: all or nothing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, BinaryIO

from tdckpt._read.archive_index import LOCAL_HEADER
from tdckpt._read.directory import DirectoryStorage
from tdckpt._read.storage import join
from tdckpt._write.atomic import (
    fsync_dir,
    rename_noreplace,
)
from tdckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    MetadataError,
    UnsafePathError,
)

__all__ = ["ALIGNMENT", "write_archive"]

#: Payload alignment of STORED ``.memmap`` entries (tensordict's ``_ALIGNMENT``): a multiple
#: of every dtype's itemsize, so a leaf can always be viewed in place.
ALIGNMENT = 64

# Local-header extra block that pads payloads to ALIGNMENT; spells b"td" (tensordict's id).
_PAD_EXTRA_ID = 0x6474
# zipfile appends this many bytes of zip64 extra to a local header under force_zip64=True.
_ZIP64_LOCAL_EXTRA_SIZE = 20
_WRITE_METHODS = {"stored": zipfile.ZIP_STORED, "deflate": zipfile.ZIP_DEFLATED}
_COPY_CHUNK = 16 << 20  # bytes per read when packing a leaf
# Fixed entry timestamp (the zip epoch): the same directory always packs to the same bytes.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


def write_archive(
    source_dir: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    compression: str = "stored",
    fsync: bool = True,
    tmp: str | os.PathLike[str] | None = None,
    replace: bool = True,
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
        tmp: the temporary file to write (beside ``dest``; it must not exist). Default: a
            fresh ``.<dest name>.<random>.tmp``.
        replace: replace an existing ``dest`` (default); with False an existing ``dest``
            is refused atomically (CheckpointExistsError) and the temporary file removed.

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

    tmp = Path(tmp) if tmp is not None else parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
    # os.open with 0o666 lets the umask decide the final mode, as for any new file.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with open(fd, "wb") as fh:
            with zipfile.ZipFile(fh, "w", allowZip64=True) as zf:
                for arcname, path in files:
                    _write_entry(zf, fh, arcname, path, method)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, target)
        else:
            try:
                rename_noreplace(tmp, target)
            except CheckpointExistsError:
                raise CheckpointExistsError(
                    f"{target}: already exists; not replaced.", path=str(target)
                ) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(parent)


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
    start = header_offset + LOCAL_HEADER.size + name_len + 4 + _ZIP64_LOCAL_EXTRA_SIZE
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
