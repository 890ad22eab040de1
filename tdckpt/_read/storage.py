"""Storage: one read-only interface over a directory prefix and a ``.tdz`` archive.

Everything above this layer names files by *relative POSIX paths* inside the prefix
(``"nested/a%20b.memmap"``; ``""`` is the prefix itself). This layer is the only one that
touches the file system for reading, and it guarantees:

* no name ever resolves outside the prefix: empty, ``.``, ``..`` and absolute components
  are refused, and a symlink is followed only when its target stays inside the prefix and
  is not the directory that holds it or one of its ancestors (no cycles);
* nothing is ever written: files are mapped, never grown, never created.

``open_storage(path)`` picks the implementation. Archives live in ``archive.py``.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic_core import from_json

from tdckpt.errors import CheckpointNotFoundError, MetadataError, UnsafePathError

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_CONTAINERS",
    "DirectoryStorage",
    "Listing",
    "Storage",
    "check_component",
    "join",
    "open_storage",
    "parse_json",
]

#: meta.json files larger than this are refused (a bounded header, as safetensors does).
#: A 10,000-leaf tensordict writes about 1 MB; parsed JSON takes up to ~20 times its size
#: in memory, so this also bounds what one file can cost.
MAX_JSON_BYTES = 64 * 1024 * 1024
#: JSON documents with more arrays and objects than this are refused before parsing:
#: ``[[],[],...]`` costs 64 bytes of memory per 3 bytes of file. Counted over the raw bytes
#: (brackets inside strings count too), only for documents large enough to exceed it.
MAX_JSON_CONTAINERS = 2_000_000

MapMode = Literal["r", "r+"] | None


def check_component(name: str, *, where: str) -> None:
    """Refuse a path component that does not name a child of its directory."""
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise UnsafePathError(
            f"{where}: the entry name {name!r} does not name a file inside the checkpoint "
            "(empty, '.', '..', or containing '/' or NUL). tdckpt never follows such names; "
            "the checkpoint is damaged or hostile.",
            path=where,
            name=name,
        )


def join(base: str, name: str) -> str:
    """Join a relative path and one component."""
    return f"{base}/{name}" if base else name


@dataclass
class Listing:
    """What one directory of the prefix holds.

    ``files`` maps file names to sizes in bytes, ``dirs`` lists sub-directory names,
    ``unsafe`` maps names that must not be followed (symlinks out of the prefix, special
    files) to the reason.
    """

    files: dict[str, int] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)
    unsafe: dict[str, str] = field(default_factory=dict)
    #: the sub-directories of ``dirs`` reached through a (safe) symlink
    links: set[str] = field(default_factory=set)


def parse_json(data: bytes, *, where: str | Callable[[], str]) -> Any:
    """Parse JSON bytes; every failure (bad UTF-8, syntax, depth, huge ints) -> MetadataError.

    ``where`` names the file in messages; a callable is only called on failure.

    The standard library's ``json.loads`` (what tensordict reads meta.json with) is the
    authority. pydantic-core's parser (already installed with pydantic) reads the same
    documents three times faster; whatever it refuses - lone surrogates, a BOM, UTF-16,
    deep nesting, syntax errors - is handed to ``json.loads``, which accepts it or says
    why not. A property test holds the two to the same result.
    """
    if len(data) > MAX_JSON_CONTAINERS:
        containers = data.count(b"[") + data.count(b"{")
        if containers > MAX_JSON_CONTAINERS:
            where = where() if callable(where) else where
            raise MetadataError(
                f"{where}: about {containers} JSON arrays and objects, more than the "
                f"{MAX_JSON_CONTAINERS} tdckpt parses in one metadata file (a real one holds "
                "two per leaf). The file is damaged or hostile; restore it from a backup.",
                path=where,
            )
    try:
        return from_json(data)
    except Exception:  # noqa: BLE001 - any refusal: the stdlib parser decides
        pass
    if callable(where):
        try:
            return json.loads(data)
        except (RecursionError, ValueError, UnicodeDecodeError):
            where = where()
    try:
        return json.loads(data)
    except RecursionError as exc:
        raise MetadataError(
            f"{where}: the JSON is nested too deeply to be checkpoint metadata. "
            "The file is damaged or hostile; restore it from a backup.",
            path=where,
        ) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise MetadataError(
            f"{where}: not valid JSON ({exc}). Expected a JSON object written by "
            "tensordict. The file is truncated or damaged; restore it from a backup.",
            path=where,
        ) from exc


class Storage(ABC):
    """Read-only access to the entries of one checkpoint prefix."""

    #: "directory" or "archive"
    kind: str
    #: the path the user gave, for messages
    location: str

    @abstractmethod
    def listdir(self, rel: str) -> Listing:
        """List the directory ``rel`` (``""`` is the prefix)."""

    @abstractmethod
    def read_bytes(self, rel: str, *, max_bytes: int = MAX_JSON_BYTES) -> bytes:
        """Read a whole (small) file; refuse files larger than ``max_bytes``."""

    @abstractmethod
    def map(self, rel: str, dtype: torch.dtype, numel: int, *, mode: MapMode) -> torch.Tensor:
        """Map the first ``numel`` elements of ``rel`` as a 1-D tensor, without copying.

        The caller has checked the file is large enough; this never grows a file.
        """

    def physical_path(self, rel: str) -> Path | None:
        """The real file behind ``rel`` when there is one (directories), else None."""
        return None

    def dir_identity(self, rel: str) -> tuple[int, int] | None:
        """``(st_dev, st_ino)`` of the directory ``rel`` where the storage is a file system.

        It lets a reader read each directory once, however many links or mounts lead to
        it. None where no directory can be reached twice (archives) or when it cannot be
        asked (then ``listdir`` says why).
        """
        return None

    def display(self, rel: str) -> str:
        """``rel`` as a user-readable location."""
        return str(Path(self.location) / rel) if rel else str(self.location)

    def read_json(self, rel: str) -> Any:
        """Read and parse a JSON file (bounded size and depth)."""
        return parse_json(self.read_bytes(rel), where=lambda: self.display(rel))

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (archives unmap their file)."""

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DirectoryStorage(Storage):
    """A checkpoint saved as a directory tree."""

    kind = "directory"

    def __init__(
        self, prefix: str | os.PathLike[str], *, _scan: os._ScandirIterator[str] | None = None
    ) -> None:
        #: open_storage's scandir of the prefix (it tells a directory from an archive);
        #: the first listdir("") reads it instead of opening the directory again.
        self._scan = _scan
        self.location = _normalized(prefix)
        self._root_str = self.location
        if isinstance(prefix, Path):  # immutable: reused rather than parsed again
            self.__dict__["root"] = prefix
        root = self._root_str
        # An absolute prefix without "." or ".." components is its own absolute path.
        self._abs_root = root if root.startswith("/") and "/." not in root else os.path.abspath(root)
        # Files seen as regular (not symlinks) by listdir, with their path and stat: mapping
        # them needs no new symlink check, no second stat for the size check and (usually)
        # no access() call, which keeps a 10,000-leaf restore free of 20,000 syscalls.
        self._regular: dict[str, tuple[str, os.stat_result]] = {}
        self._euid = _effective_uid()
        # Paths whose every component was checked (no symlink out of the tree, no cycle).
        self._safe_dirs: set[str] = set()

    @functools.cached_property
    def root(self) -> Path:
        """The prefix as a Path."""
        return Path(self._root_str)

    @functools.cached_property
    def _real_root(self) -> str:
        # Resolved on first use: only symlinks need it, and most checkpoints have none.
        return os.path.realpath(self._root_str)

    def close(self) -> None:
        if self._scan is not None:
            self._scan.close()
            self._scan = None

    # -- path resolution -------------------------------------------------------------
    def _resolve(self, rel: str) -> str:
        if not rel:
            return self._root_str
        for part in rel.split("/"):
            if part in ("", ".", "..") or "\0" in part:
                check_component(part, where=self.display(rel))
        return os.path.join(self._root_str, rel)

    def _check_link(self, path: Path, rel: str) -> str | None:
        """Why the symlink ``path`` must not be followed, or None if it is safe."""
        target = os.path.realpath(path)
        root = self._real_root
        if target != root and not target.startswith(root + os.sep):
            return f"a symlink to {target}, outside the checkpoint"
        holder = os.path.realpath(path.parent)
        if holder == target or holder.startswith(target + os.sep):
            return "a symlink to its own directory or an ancestor (a cycle)"
        return None

    def _check_chain(self, rel: str) -> None:
        """Refuse ``rel`` if any component (not only the last) is an unsafe symlink.

        ``out/passwd`` with ``out`` a link out of the prefix must not be read although
        ``passwd`` itself is a regular file.
        """
        if not rel:
            return
        parts = rel.split("/")
        parent = rel.rpartition("/")[0]
        # The usual case: the parent was checked (listed) first, one component is left.
        first = len(parts) - 1 if not parent or parent in self._safe_dirs else 0
        for i in range(first, len(parts)):
            sub = "/".join(parts[: i + 1])
            if sub in self._safe_dirs:
                continue
            cur = os.path.join(self._root_str, sub)
            if os.path.islink(cur):
                reason = self._check_link(Path(cur), sub)
                if reason is not None:
                    raise UnsafePathError(
                        f"{self.display(sub)}: {reason}; tdckpt never follows it. Replace "
                        "the link with the real file or directory.",
                        path=self.display(rel),
                    )
            self._safe_dirs.add(sub)

    def listdir(self, rel: str) -> Listing:
        if rel:
            path = self._resolve(rel)
            self._check_chain(rel)
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
        with it:
            for entry in it:
                name = entry.name
                try:
                    is_link = entry.is_symlink()
                    if is_link:
                        reason = self._check_link(Path(entry.path), join(rel, name))
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
                        self._regular[f"{rel}/{name}" if rel else name] = (entry.path, st)
                else:
                    listing.unsafe[name] = "not a regular file or directory"
        return listing

    def dir_identity(self, rel: str) -> tuple[int, int] | None:
        # One stat per directory (not per leaf), before it is listed.
        path = self._resolve(rel)
        if rel:
            self._check_chain(rel)
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def _open_checked(self, rel: str) -> str:
        known = self._regular.get(rel)
        if known is not None:
            return known[0]
        path = self._resolve(rel)
        self._check_chain(rel)
        return path

    def read_bytes(self, rel: str, *, max_bytes: int = MAX_JSON_BYTES) -> bytes:
        known = self._regular.get(rel)
        path = known[0] if known is not None else self._open_checked(rel)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                # A listed regular file's size is known; anything else is asked of the fd.
                st = known[1] if known is not None else os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
                if st.st_size > max_bytes:
                    raise MetadataError(
                        f"{self.display(rel)}: {st.st_size} bytes, more than the {max_bytes} "
                        "bytes tdckpt reads for a metadata file. The file is damaged or hostile.",
                        path=self.display(rel),
                    )
                # Read what fstat promised (plus one byte, to notice a file growing under
                # us); never ask for max_bytes, which would allocate that much up front.
                return _read_upto(fd, st.st_size + 1)
            finally:
                os.close(fd)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.display(rel)}: no such file.", path=self.display(rel)
            ) from exc
        except IsADirectoryError as exc:
            raise MetadataError(
                f"{self.display(rel)}: expected a file, found a directory.",
                path=self.display(rel),
            ) from exc

    def map(self, rel: str, dtype: torch.dtype, numel: int, *, mode: MapMode) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        known = self._regular.get(rel)
        if known is not None:
            path, st = known
        else:
            path = self._open_checked(rel)
            try:
                st = os.stat(path)
            except FileNotFoundError as exc:
                raise CheckpointNotFoundError(
                    f"{self.display(rel)}: no such file.", path=self.display(rel)
                ) from exc
        need = numel * dtype.itemsize
        if st.st_size < need:
            # A shared torch.from_file would grow the file with zeros (format-notes §4.3).
            raise MetadataError(
                f"{self.display(rel)}: {st.st_size} bytes, but {numel} elements of {dtype} "
                f"need {need}. The file is truncated; tdckpt never grows a file to fit a "
                "mapping. Restore it from a backup.",
                path=self.display(rel),
            )
        if mode == "r":
            return torch.from_file(path, shared=False, size=numel, dtype=dtype)
        # Shared when the file is writable (mode None, as tensordict); "r+" requires it.
        # The mode bits answer for root and for the owner without a syscall; access()
        # decides the rest (group, other, ACLs). A shared open refused anyway (a read-only
        # mount, an immutable file) is checked with access() before falling back to
        # copy-on-write.
        euid = self._euid
        if euid == 0 or (st.st_uid == euid and st.st_mode & stat.S_IWUSR) or os.access(path, os.W_OK):
            try:
                return torch.from_file(path, shared=True, size=numel, dtype=dtype)
            except RuntimeError:
                if os.access(path, os.W_OK):
                    raise
        if mode == "r+":
            raise PermissionError(
                errno.EACCES,
                f"{self.display(rel)}: mode='r+' needs a writable file; use mode='r' or "
                "mode=None",
            )
        return torch.from_file(path, shared=False, size=numel, dtype=dtype)

    def physical_path(self, rel: str) -> Path | None:
        return Path(self._open_checked(rel)) if rel else self.root

    def absolute_str(self, rel: str) -> str:
        """The absolute path of ``rel`` (checked as ``physical_path``), as a string."""
        if rel not in self._regular:
            self._open_checked(rel)
        # ``rel`` is a checked, normalised relative POSIX path: no os.path.join needed.
        return f"{self._abs_root}/{rel}" if rel else self._abs_root

    def physical_str(self, rel: str) -> str:
        """``physical_path`` as a plain string (no pathlib cost on hot paths)."""
        return self._open_checked(rel)


@functools.cache
def _effective_uid() -> int:
    """The process's effective uid, asked once: it only steers a first guess (a shared map
    that the kernel then refuses falls back, checked with access())."""
    return os.geteuid() if hasattr(os, "geteuid") else -1


def _normalized(prefix: str | os.PathLike[str]) -> str:
    """``str(Path(prefix))`` without pathlib's cost when ``prefix`` is already normal."""
    text = os.fspath(prefix)
    if not text or "//" in text or "/./" in text or text.endswith(("/", "/.")) or text.startswith("./"):
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


def open_storage(prefix: str | os.PathLike[str]) -> Storage:
    """Open a checkpoint prefix: a directory, or a ``.tdz`` zip archive."""
    try:
        # Listing the prefix is the first thing a read does: opening it here tells a
        # directory from an archive without a separate stat.
        scan = os.scandir(prefix)
    except OSError:
        pass  # not a directory (or not listable: the reader says so when it lists it)
    else:
        return DirectoryStorage(prefix, _scan=scan)
    if os.path.isdir(prefix):
        return DirectoryStorage(prefix)
    path = Path(prefix)
    if path.is_file():
        from tdckpt._read.archive import ArchiveStorage

        return ArchiveStorage(path)
    raise CheckpointNotFoundError(
        f"{path}: no checkpoint here (neither a directory nor a .tdz archive). Check the "
        "path; a checkpoint is the directory that holds meta.json, or a .tdz file.",
        path=str(path),
    )
