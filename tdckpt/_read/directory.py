"""A checkpoint prefix that is a directory, read as a :class:`~tdckpt._read.storage.Storage`.

Every name is checked and opened relative to directory descriptors opened without following
links; a leaf is opened once, checked on its descriptor (a regular file, large enough) and
exactly that descriptor is mapped (``mapping.py``). See :mod:`tdckpt._read.storage` for the
guarantees.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
from collections.abc import Sequence
from pathlib import Path

import torch

from tdckpt._keys import NESTED_SHAPE_SUFFIX
from tdckpt._read.dir_tree import FILE_FLAGS, TreeOpener
from tdckpt._read.expected import check_read
from tdckpt._read.mapping import (
    MAP_FAILED,
    MAP_PRIVATE,
    MAP_SHARED,
    PROT_RW,
    libc_mmap_fast,
    map_fd,
    mapped_buffer_type,
)
from tdckpt._read.storage import (
    MAX_JSON_BYTES,
    UNKNOWN_SIZE,
    Listing,
    MapMode,
    Storage,
    join,
)
from tdckpt.errors import CheckpointNotFoundError, MetadataError, RestoreError

__all__ = ["DirectoryStorage"]


class DirectoryStorage(Storage):
    """A checkpoint saved as a directory tree.

    Leaves and metadata files are opened through the storage's :class:`TreeOpener`
    (``dir_tree.py``), relative to the directory descriptors it keeps open (``close()``
    releases them, and a storage never closed releases them when it is collected). One
    storage serves one thread at a time, as the read pipeline uses it.
    """

    kind = "directory"

    def __init__(
        self,
        prefix: str | os.PathLike[str],
        *,
        defer_leaf_sizes: bool = False,
        _scan: os._ScandirIterator[str] | None = None,
    ) -> None:
        #: open_storage's scandir of the prefix (it tells a directory from an archive);
        #: the first listdir("") reads it instead of opening the directory again.
        self._scan = _scan
        #: A restore's listing: ``*.memmap`` files that the directory entry shows regular
        #: are listed without a stat (size :data:`UNKNOWN_SIZE`); :meth:`map` checks their
        #: size on the very descriptor it maps, as it does for every leaf anyway. Saves one
        #: stat per leaf - the most expensive syscall of a restore after the map itself.
        self._defer_leaf_sizes = defer_leaf_sizes
        self.location = _normalized(prefix)
        self._root_str = self.location
        if isinstance(prefix, Path):  # immutable: reused rather than parsed again
            self.__dict__["root"] = prefix
        root = self._root_str
        # An absolute prefix without "." or ".." components is its own absolute path.
        self._abs_root = (
            root if root.startswith("/") and "/." not in root else os.path.abspath(root)
        )
        # Every name is opened through it. Its ``regular`` holds the files listdir saw as
        # regular (not symlinks), with their path and stat: mapping them needs no new
        # symlink check, no second stat for the size check and (usually) no access() call,
        # which keeps a 10,000-leaf restore free of 20,000 syscalls (the stat is None for
        # a leaf listed without one, ``defer_leaf_sizes``).
        self._tree = TreeOpener(root, self.location)
        self._euid = _effective_uid()

    @functools.cached_property
    def root(self) -> Path:
        """The prefix as a Path."""
        return Path(self._root_str)

    def close(self) -> None:
        if self._scan is not None:
            self._scan.close()
            self._scan = None
        self._tree.close()  # a later call opens what it needs again

    def listdir(self, rel: str) -> Listing:
        if rel:
            path = self._tree.resolve(rel)
            self._tree.check_chain(rel)
        else:
            path = self._root_str
        listing = Listing()
        try:
            it = self._scan if not rel and self._scan is not None else os.scandir(path)
            self._scan = None
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.display(rel)}: no such directory.", path=self.display(rel)
            ) from exc
        except NotADirectoryError as exc:
            raise MetadataError(
                f"{self.display(rel)}: expected a directory, found a file.",
                path=self.display(rel),
            ) from exc
        defer = self._defer_leaf_sizes
        files = listing.files
        regular = self._tree.regular
        below = f"{rel}/" if rel else ""
        with it:
            for entry in it:
                name = entry.name
                try:
                    if (
                        defer
                        and name.endswith(".memmap")
                        and not name.endswith(NESTED_SHAPE_SUFFIX)  # read by validation
                        and entry.is_file(follow_symlinks=False)  # the entry's type: no syscall
                    ):
                        # A regular leaf (not a link) by its entry's type: map() checks the
                        # descriptor it maps (regular, large enough), so no stat here.
                        files[name] = UNKNOWN_SIZE
                        regular[below + name] = (entry.path, None)
                        continue
                    is_link = entry.is_symlink()
                    if is_link:
                        reason = self._tree.check_link(Path(entry.path), join(rel, name))
                        if reason is not None:
                            listing.unsafe[name] = reason
                            continue
                    elif entry.is_dir(follow_symlinks=False):  # the entry's type: no syscall
                        listing.dirs.add(name)
                        continue
                    st = entry.stat()  # follows a (safe) symlink
                except OSError as exc:
                    listing.unsafe[name] = f"unreadable ({exc.strerror})"
                    continue
                if stat.S_ISDIR(st.st_mode):
                    listing.dirs.add(name)
                    if is_link:
                        listing.links.add(name)
                elif stat.S_ISREG(st.st_mode):
                    listing.files[name] = st.st_size
                    if not is_link:
                        self._tree.regular[f"{rel}/{name}" if rel else name] = (entry.path, st)
                else:
                    listing.unsafe[name] = "not a regular file or directory"
        return listing

    def dir_identity(self, rel: str) -> tuple[int, int] | None:
        # One stat per directory (not per leaf), before it is listed.
        path = self._tree.resolve(rel)
        if rel:
            self._tree.check_chain(rel)
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def _open_checked(self, rel: str) -> str:
        known = self._tree.regular.get(rel)
        if known is not None:
            return known[0]
        path = self._tree.resolve(rel)
        self._tree.check_chain(rel)
        return path

    # -- reading ---------------------------------------------------------------------
    def read_bytes(self, rel: str, *, max_bytes: int = MAX_JSON_BYTES) -> bytes:
        fd = self._tree.open_file(rel, os.O_RDONLY)
        try:
            st = self._tree.checked_stat(fd, rel)
            if st.st_size > max_bytes:
                raise MetadataError(
                    f"{self.display(rel)}: {st.st_size} bytes, more than the {max_bytes} "
                    "bytes tdckpt reads for a metadata file. The file is damaged or hostile.",
                    path=self.display(rel),
                )
            # Read what fstat promised (plus one byte, to notice a file growing under
            # us); never ask for max_bytes, which would allocate that much up front.
            data = _read_upto(fd, st.st_size + 1)
        finally:
            os.close(fd)
        check_read(self, rel, data)  # a managed step's manifest, when one is declared
        return data

    def map(self, rel: str, dtype: torch.dtype, numel: int, *, mode: MapMode) -> torch.Tensor:
        """Map the first ``numel`` elements of ``rel`` as a 1-D tensor, without copying.

        The file is opened once (no link followed, relative to its directory's descriptor,
        see :meth:`_open_file`), that descriptor is checked (a regular file of at least the
        bytes needed) and exactly that descriptor is mapped; a leaf truncated, or swapped for
        a symlink, FIFO or directory, after validation is refused with a TdckptError.

        Modes, as tensordict's: ``"r"`` is copy-on-write (writes stay in memory);
        ``None`` is shared where this process can write the file (writes reach the file,
        as with tensordict) and copy-on-write where it cannot; ``"r+"`` is shared and needs
        a writable file (PermissionError otherwise).

        Nothing is grown or created. ``torch.from_file(shared=True)`` is not used: it opens
        the path again (following links) with ``O_CREAT`` and ftruncates a short file up to
        the mapping's size. A file truncated *after* it was mapped cannot be guarded against
        by any reader: touching the lost pages raises SIGBUS, as with every memory map
        (tensordict's included).
        """
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        mapped = self.map_listed(((rel, dtype, numel),), mode)[0]
        if mapped is not None:
            return mapped
        return self._map_checked(rel, dtype, numel, mode)

    def map_listed(
        self, leaves: Sequence[tuple[str, torch.dtype, int]], mode: MapMode
    ) -> list[torch.Tensor | None]:
        """:meth:`map` of each ``(rel, dtype, numel)`` that is a usual leaf: a file listed
        as regular, opened, checked on its descriptor (a regular file large enough) and
        mapped; None for any other, and wherever anything is unusual (an open refused,
        not a regular file, too short, a failed map). :meth:`map` of a None checks it
        again from scratch and says what is wrong.

        One call per level rather than per leaf: a 10,000-leaf restore maps its leaves
        here, the per-leaf work being the four syscalls (open, fstat, mmap, close).
        """
        do_mmap = libc_mmap_fast()
        if do_mmap is None:  # pragma: no cover
            return [None] * len(leaves)
        regular = self._tree.regular
        dir_fds = self._tree.dir_fds
        euid = self._euid
        buffer_type = mapped_buffer_type
        frombuffer = torch.frombuffer
        fstat = os.fstat
        is_reg = stat.S_ISREG
        out: list[torch.Tensor | None] = []
        append = out.append
        for rel, dtype, numel in leaves:
            known = regular.get(rel)
            if known is None or not numel:
                append(None)
                continue
            if mode is None:
                st0 = known[1]
                # Listed without a stat: ask open() whether the file is writable.
                shared = (
                    st0 is None
                    or euid == 0
                    or st0.st_uid != euid
                    or bool(st0.st_mode & stat.S_IWUSR)
                )
            else:
                shared = mode == "r+"
            parent, _, name = rel.rpartition("/")
            dfd = dir_fds.get(parent)
            if dfd is None:
                dfd = self._tree.dir_fd(parent)
            try:
                fd = os.open(name, _RDWR_FILE if shared else _RDONLY_FILE, dir_fd=dfd)
            except OSError as exc:
                fd = -1
                if mode is None and shared and exc.errno in _NOT_WRITABLE:
                    # not writable by this process: copy-on-write, as tensordict maps it
                    shared = False
                    with contextlib.suppress(OSError):  # map() says why
                        fd = os.open(name, _RDONLY_FILE, dir_fd=dfd)
            mapped = None
            if fd >= 0:
                try:
                    st = fstat(fd)
                    need = numel * dtype.itemsize
                    # a file with other names (an incremental step's shared leaf) is
                    # never mapped shared here: _map_checked decides (and says why)
                    if (
                        st.st_size >= need
                        and is_reg(st.st_mode)
                        and not (shared and st.st_nlink > 1)
                    ):
                        addr = do_mmap(
                            None, need, PROT_RW, MAP_SHARED if shared else MAP_PRIVATE, fd, 0
                        )
                        if addr is not None and addr != MAP_FAILED:
                            mapped = frombuffer(
                                buffer_type(need).from_address(addr),  # type: ignore[union-attr]
                                dtype=dtype,
                            )
                finally:
                    os.close(fd)
            append(mapped)
        return out

    def _map_checked(self, rel: str, dtype: torch.dtype, numel: int, mode: MapMode) -> torch.Tensor:
        """:meth:`map`'s general path: every check, every fallback, every error message."""
        fd = -1
        shared = False
        if mode is not None:
            shared = mode == "r+"
        else:
            # Shared where the file is writable. A file the mode bits show read-only to its
            # owner is not even tried; anything else is asked of open() itself.
            known = self._tree.regular.get(rel)
            euid = self._euid
            shared = (
                known is None
                or known[1] is None
                or euid == 0
                or known[1].st_uid != euid
                or bool(known[1].st_mode & stat.S_IWUSR)
            )
        if shared:
            try:
                fd = self._tree.open_file(rel, os.O_RDWR)
            except OSError as exc:
                if exc.errno not in _NOT_WRITABLE:  # a missing file is not a read-only one
                    raise
                if mode == "r+":
                    raise PermissionError(
                        errno.EACCES,
                        f"{self.display(rel)}: mode='r+' needs a writable file; use mode='r' "
                        "or mode=None",
                    ) from exc
                shared = False
        if fd < 0:
            fd = self._tree.open_file(rel, os.O_RDONLY)
        try:
            st = self._tree.checked_stat(fd, rel)
            if shared and st.st_nlink > 1:
                # other names (an incremental step's shared leaf): never mapped shared
                opened, fd = fd, -1
                os.close(opened)
                _refuse_shared(self.display(rel), mode, st.st_nlink)
                fd = self._tree.open_file(rel, os.O_RDONLY)
                st = self._tree.checked_stat(fd, rel)
                shared = False
            need = numel * dtype.itemsize
            if st.st_size < need:
                known = self._tree.regular.get(rel)
                if known is not None and known[1] is None:
                    self.deferred_size_refused = True
                raise MetadataError(
                    f"{self.display(rel)}: {st.st_size} bytes, but {numel} elements of {dtype} "
                    f"need {need}. The file is truncated; tdckpt never grows a file to fit a "
                    "mapping. Restore it from a backup.",
                    path=self.display(rel),
                )
            return map_fd(fd, need, dtype, shared=shared)
        finally:
            if fd >= 0:
                os.close(fd)

    def physical_path(self, rel: str) -> Path | None:
        return Path(self._open_checked(rel)) if rel else self.root

    def absolute_str(self, rel: str) -> str:
        """The absolute path of ``rel`` (checked as ``physical_path``), as a string."""
        if rel not in self._tree.regular:
            self._open_checked(rel)
        # ``rel`` is a checked, normalised relative POSIX path: no os.path.join needed.
        return f"{self._abs_root}/{rel}" if rel else self._abs_root


def _refuse_shared(where: str, mode: MapMode, links: int) -> None:
    """A file with other names (hard links: the leaf of an incremental step, shared with
    other steps) is never mapped shared, as its writes would reach every step naming it:
    ``"r+"`` is refused; None maps it copy-on-write, as a read-only file."""
    if mode == "r+":
        raise RestoreError(
            f"{where}: mode='r+' would map shared a file that {links} names share (a leaf of "
            "an incremental step, hard-linked with other steps): writes would reach every one "
            "of them. Restore through CheckpointManager.restore / restore_into with "
            "mode='r+', which gives the step private copies first, or use mode='r'.",
            path=where,
        )


#: errnos of an O_RDWR open refused for want of write access (not for a missing file).
_NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ETXTBSY})


#: open() flags of a leaf mapped shared / copy-on-write.
_RDWR_FILE = os.O_RDWR | FILE_FLAGS
_RDONLY_FILE = os.O_RDONLY | FILE_FLAGS


@functools.cache
def _effective_uid() -> int:
    """The process's effective uid, asked once: it only steers a first guess (a shared map
    that the kernel then refuses falls back, checked with access())."""
    return os.geteuid() if hasattr(os, "geteuid") else -1


def _normalized(prefix: str | os.PathLike[str]) -> str:
    """``str(Path(prefix))`` without pathlib's cost when ``prefix`` is already normal."""
    text = os.fspath(prefix)
    if (
        not text
        or "//" in text
        or "/./" in text
        or text.endswith(("/", "/."))
        or text.startswith("./")
    ):
        return str(Path(text))
    return text


def _read_upto(fd: int, size: int) -> bytes:
    """Read up to ``size`` bytes of ``fd`` (fewer only at end of file)."""
    first = os.read(fd, size)
    if len(first) >= size - 1 or not first:
        # All that fstat promised (a regular file reads whole up to its end): done, without
        # a second read to see the end of file.
        return first
    chunks = [first]
    got = len(first)
    while got < size:
        chunk = os.read(fd, size - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
