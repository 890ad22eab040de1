"""Memory maps of open files, made through libc so that a mapping holds no descriptor.

``map_fd`` maps exactly the descriptor a caller opened and checked (a leaf of a directory,
see ``directory.py``); ``mapped_buffer_type`` and ``libc_mmap_fast`` are the lean parts of
the same for a 10,000-leaf restore; ``map_reopened_writable`` maps a single validated file
(an archive, a consolidated file) shared and writable. A mapping lives as long as the last
tensor that views it.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from collections.abc import Callable

import torch

from tdckpt.errors import MetadataError

__all__ = [
    "MAP_FAILED",
    "MAP_PRIVATE",
    "MAP_SHARED",
    "PROT_RW",
    "libc_mmap",
    "libc_mmap_fast",
    "map_fd",
    "map_reopened_writable",
    "mapped_buffer_type",
]


class _Unmap:
    """Owns one mapping made through libc: unmapped when the buffer that holds it dies."""

    __slots__ = ("addr", "munmap", "size")

    def __init__(self, addr: int, size: int, munmap: Callable[[int, int], int]) -> None:
        self.addr = addr
        self.size = size
        self.munmap = munmap

    def __del__(self) -> None:
        self.munmap(self.addr, self.size)


@functools.cache
def libc_mmap() -> tuple[Callable[..., int | None], Callable[[int, int], int]] | None:
    """libc's mmap and munmap through ctypes, or None where that is not possible.

    Python's ``mmap.mmap`` keeps a duplicate of the descriptor open for as long as the
    mapping lives (until Python 3.13's ``trackfd=False``): one per leaf would exhaust the
    descriptor limit on a 10,000-leaf checkpoint. A mapping made here holds no descriptor,
    like ``torch.from_file``'s.
    """
    if sys.platform == "win32" or ctypes.sizeof(ctypes.c_void_p) != 8:  # pragma: no cover
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        do_mmap, do_munmap = libc.mmap, libc.munmap
    except (OSError, AttributeError):  # pragma: no cover - no libc symbols to use
        return None
    do_mmap.restype = ctypes.c_void_p
    c_int = ctypes.c_int
    do_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, c_int, c_int, c_int, ctypes.c_int64]
    do_munmap.restype = ctypes.c_int
    do_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return do_mmap, do_munmap


MAP_FAILED = ctypes.c_void_p(-1).value
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
MAP_SHARED, MAP_PRIVATE = mmap.MAP_SHARED, mmap.MAP_PRIVATE


@functools.lru_cache(maxsize=256)
def mapped_buffer_type(nbytes: int) -> type[ctypes.Array[ctypes.c_ubyte]] | None:
    """A ``c_ubyte * nbytes`` array class whose instances own the mapping at their address.

    The instance is the buffer ``torch.frombuffer`` keeps alive for as long as a tensor
    views it; its ``__del__`` unmaps. One class per leaf size (a checkpoint repeats a few
    sizes; the cache is bounded, an evicted class lives on in its instances) instead of
    an array, its ``__dict__`` and an ``_Unmap`` per leaf.
    """
    libc = libc_mmap()
    if libc is None:  # pragma: no cover - every POSIX platform tdckpt runs on has libc
        return None
    do_munmap = libc[1]
    addressof = ctypes.addressof

    class _Mapped(ctypes.c_ubyte * nbytes):  # type: ignore[misc]
        __slots__ = ()

        def __del__(self) -> None:
            do_munmap(addressof(self), nbytes)

    return _Mapped


@functools.cache
def libc_mmap_fast() -> Callable[..., int | None] | None:
    """libc's mmap without ctypes' errno bookkeeping (the general path reports errors)."""
    if libc_mmap() is None:  # pragma: no cover
        return None
    do_mmap = ctypes.CDLL(None).mmap
    do_mmap.restype = ctypes.c_void_p
    c_int = ctypes.c_int
    do_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, c_int, c_int, c_int, ctypes.c_int64]
    return do_mmap


def map_fd(fd: int, nbytes: int, dtype: torch.dtype, *, shared: bool) -> torch.Tensor:
    """Map the first ``nbytes`` of the open regular file ``fd`` as a 1-D ``dtype`` tensor.

    ``shared``: writes reach the file (MAP_SHARED, ``fd`` opened for writing); otherwise
    copy-on-write (MAP_PRIVATE), as ``torch.from_file(shared=False)``. The caller checked
    that the file holds ``nbytes``; mapping never changes its size. The mapping outlives
    ``fd`` and is unmapped when the last tensor viewing it is freed.
    """
    libc = libc_mmap()
    if libc is None:  # pragma: no cover - every POSIX platform tdckpt runs on has libc
        fallback = mmap.mmap(fd, nbytes, access=mmap.ACCESS_WRITE if shared else mmap.ACCESS_COPY)
        return torch.frombuffer(fallback, dtype=dtype)
    do_mmap, do_munmap = libc
    addr = do_mmap(None, nbytes, PROT_RW, mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE, fd, 0)
    if addr is None or addr == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {nbytes} bytes failed: {os.strerror(err)}")
    buffer = (ctypes.c_ubyte * nbytes).from_address(addr)
    # The buffer's lifetime is the mapping's: torch.frombuffer keeps the buffer alive.
    vars(buffer)["unmap"] = _Unmap(addr, nbytes, do_munmap)
    return torch.frombuffer(buffer, dtype=dtype)


def map_reopened_writable(
    fd: int, location: str, identity: tuple[int, int, int], size: int
) -> mmap.mmap:
    """A shared, writable mapping of the single file open read-only at ``fd`` (an archive, a
    consolidated file), which was validated as ``identity`` ``(device, inode, size)``.

    The read-only descriptor cannot be made writable, so the file is opened again for
    writing: through ``/proc/self/fd`` where there is one (that names the open file itself,
    whatever its path names now), else by its path; either way the new descriptor must be
    the same file of the same size.

    Raises:
        PermissionError: the file is not writable (with the fix: another mode).
        MetadataError: the path now names another file, or the file was resized.
    """
    proc = f"/proc/self/fd/{fd}"
    again = proc if os.path.exists(proc) else location
    flags = os.O_RDWR | sum(getattr(os, f, 0) for f in ("O_CLOEXEC", "O_NONBLOCK", "O_NOCTTY"))
    try:
        writable = os.open(again, flags)
    except PermissionError as exc:
        raise PermissionError(
            exc.errno,
            f"{location}: mode='r+' needs a writable file; use mode='r' or mode=None, or make "
            "the file writable",
        ) from exc
    try:
        st = os.fstat(writable)
        if (st.st_dev, st.st_ino, st.st_size) != identity:
            raise MetadataError(
                f"{location}: the file was replaced or resized since it was checked; restore "
                "it again.",
                path=location,
            )
        return mmap.mmap(writable, size, access=mmap.ACCESS_WRITE)
    finally:
        os.close(writable)  # mmap holds its own duplicate
