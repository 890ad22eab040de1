"""Give a new file its final size before it is written.

A writer that knows how many bytes a file will hold (a safetensors export: the header and
every tensor's size are known before the first byte) sets that size first. Where the file
system can, ``posix_fallocate`` reserves the blocks: a full disk is then reported before
anything is written rather than half-way through, and the file gets its blocks in few
extents rather than one allocation per write. Where it cannot (``EOPNOTSUPP``, or
``EINVAL`` from a file system that has no such call), ``ftruncate`` sets the size alone:
the file is sparse until written, exactly as without this call. Either way, every byte the
writer then writes lands inside the file's size, and a file whose write fails is removed by
its writer (this module never decides whether a file is complete).
"""

from __future__ import annotations

import errno
import os

__all__ = ["preallocate"]

#: What ``posix_fallocate`` answers on a file system that cannot reserve blocks.
_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS})


def preallocate(fd: int, size: int) -> bool:
    """Set the file ``fd`` (opened for writing, empty) to ``size`` bytes, reserving its blocks
    where the file system can.

    Returns:
        True when the blocks were reserved (``posix_fallocate``); False when only the size
        was set (``ftruncate``: no such call here, or the file system does not take it).

    Raises:
        OSError: the disk is full (``ENOSPC``), or another error of the file or the disk.
    """
    if size < 0:
        raise ValueError(f"a file size is >= 0, not {size}")
    if size == 0:
        return False
    fallocate = getattr(os, "posix_fallocate", None)  # not on macOS or Windows
    if fallocate is not None:
        try:
            fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
        else:
            return True
    os.ftruncate(fd, size)
    return False
