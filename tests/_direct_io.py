"""Test helper: whether a directory's file system takes O_DIRECT writes."""

from __future__ import annotations

import mmap
import os
from pathlib import Path


def o_direct_works(directory: Path) -> bool:
    """Whether files in ``directory`` take aligned O_DIRECT writes (the saver's fast path)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = directory / "o_direct_probe"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, memoryview(mmap.mmap(-1, 4096)), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()
