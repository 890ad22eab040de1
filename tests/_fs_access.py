"""What a restore touches on disk, counted by the kernel: files opened and bytes mapped.

:class:`Access` watches every directory of a checkpoint with Linux inotify (``IN_OPEN``:
each ``open`` of a file there, by any code path, C or Python) and reads ``/proc/self/maps``
for the file-backed mappings of this process that lie under it. Nothing is patched: the
restore runs as in production, and the counts are the kernel's.

inotify sees every process's opens; where several processes read the same folder at once
(the ranks of a sharded restore), :class:`OpenLog` records this process's own ``os.open``
calls instead (the call itself runs unchanged; a name relative to a directory descriptor
is resolved through ``/proc/self/fd``).

Typical use::

    with Access(prefix) as seen:
        out = tdckpt.load_memmap(prefix, keys="model")
    seen.opened        # {relative path: times opened}
    mapped_bytes(prefix)  # while ``out`` is alive: bytes of prefix's files mapped
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from collections import Counter
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

_IN_OPEN = 0x00000020
_IN_ISDIR = 0x40000000
_EVENT = struct.Struct("iIII")

needs_linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="inotify and /proc/self/maps are Linux's"
)


class Access:
    """The files opened under ``root`` while the ``with`` block runs (directories apart)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.opened: Counter[str] = Counter()
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = -1
        self._dirs: dict[int, Path] = {}

    def __enter__(self) -> Access:
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        for here, _, _ in os.walk(self.root):
            wd = self._libc.inotify_add_watch(self._fd, os.fsencode(here), _IN_OPEN)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {here}")
            self._dirs[wd] = Path(here)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            while True:
                try:
                    data = os.read(self._fd, 1 << 16)
                except BlockingIOError:
                    break
                at = 0
                while at < len(data):
                    wd, mask, _, length = _EVENT.unpack_from(data, at)
                    name = data[at + _EVENT.size : at + _EVENT.size + length].rstrip(b"\0")
                    at += _EVENT.size + length
                    if mask & _IN_OPEN and not mask & _IN_ISDIR and name and wd in self._dirs:
                        path = self._dirs[wd] / os.fsdecode(name)
                        self.opened[path.relative_to(self.root).as_posix()] += 1
        finally:
            os.close(self._fd)

    def leaves_opened(self) -> set[str]:
        """The leaf data files opened (``*.memmap``)."""
        return {name for name in self.opened if name.endswith(".memmap")}


def mapped_bytes(root: Path) -> dict[str, int]:
    """Bytes of this process's address space mapped from each file under ``root`` (now)."""
    base = os.path.realpath(root) + os.sep
    out: Counter[str] = Counter()
    with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith(base):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out[parts[5].rstrip("\n")[len(base) :]] += end - start
    return dict(out)


class OpenLog:
    """The files under ``root`` that this process opened with ``os.open`` in the block."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root) + os.sep
        self.opened: Counter[str] = Counter()
        self._real = os.open

    def __enter__(self) -> OpenLog:
        real = self._real

        def logged(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            fd = real(path, flags, mode, dir_fd=dir_fd)
            full = os.readlink(f"/proc/self/fd/{fd}")
            if full.startswith(self.root) and not os.path.isdir(full):
                self.opened[full[len(self.root) :]] += 1
            return fd

        os.open = logged  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        os.open = self._real

    def leaves_opened(self) -> set[str]:
        """The leaf data files opened (``*.memmap``)."""
        return {name for name in self.opened if name.endswith(".memmap")}
