"""Storage: one read-only interface over a directory prefix, a ``.tdz`` archive and a
consolidated file.

Everything above this layer names files by *relative POSIX paths* inside the prefix
(``"nested/a%20b.memmap"``; ``""`` is the prefix itself). This layer is the only one that
touches the file system for reading, and it guarantees:

* no name ever resolves outside the prefix: empty, ``.``, ``..`` and absolute components
  are refused, and a symlink is followed only when its target stays inside the prefix and
  is not the directory that holds it or one of its ancestors (no cycles);
* nothing is ever written: files are mapped, never grown, never created;
* what is checked is what is used: a leaf is opened once, without following links, relative
  to directory descriptors opened the same way, and exactly the descriptor that was checked
  (a regular file, large enough) is mapped. A leaf truncated, or swapped for a symlink, a
  FIFO or a directory, between validation and mapping is refused, never regrown or followed.

``opener.open_storage(path)`` picks the implementation: a directory (``directory.py``, on
the memory maps of ``mapping.py``), an archive (``archive.py``), a consolidated file
(``td.consolidate(filename=...)``, or a step folder saved with ``layout="consolidated"``:
``consolidated.py``) or object storage (``object_storage.py``). This module holds what they
share: the interface, the bounded JSON parse and the checks of a relative path.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic_core import from_json

from tdckpt.errors import MetadataError, UnsafePathError

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_CONTAINERS",
    "UNKNOWN_SIZE",
    "Listing",
    "MapMode",
    "Storage",
    "check_component",
    "join",
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


#: The size of a leaf file listed without a stat (a restore's listing, see
#: ``defer_leaf_sizes``): the mapping checks the size on the descriptor it maps instead.
UNKNOWN_SIZE = -1


@dataclass
class Listing:
    """What one directory of the prefix holds.

    ``files`` maps file names to sizes in bytes (:data:`UNKNOWN_SIZE` for a leaf file a
    restore's listing did not stat), ``dirs`` lists sub-directory names, ``unsafe`` maps
    names that must not be followed (symlinks out of the prefix, special files) to the
    reason.
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
        return from_json(data, cache_strings=False)  # faster; interning buys nothing here
    except Exception:
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

    #: "directory", "archive" or "consolidated"
    kind: str
    #: the path the user gave, for messages
    location: str
    #: Set when a leaf listed without a stat (``defer_leaf_sizes``) turned out too short to
    #: map: the restore then reads the checkpoint again with every size listed, for the full
    #: report. Archives list every size, so theirs stays False.
    deferred_size_refused: bool = False
    #: Keys are recorded verbatim, not as file names (a consolidated file): the key encoding
    #: is not the caller's to choose, every (virtual) name is the robust one.
    verbatim_keys: bool = False
    #: Capabilities a caller asks instead of testing the type. ``file_backed``: leaves are
    #: files a tensor can map (and a directory level can name); ``ranged_reads``: leaf bytes
    #: come from ranged reads, best asked all at once (:meth:`prefetch`);
    #: ``writable_in_place``: ``mode="r+"`` can make writes reach the checkpoint.
    file_backed: bool = True
    ranged_reads: bool = False
    writable_in_place: bool = True

    @abstractmethod
    def listdir(self, rel: str) -> Listing:
        """List the directory ``rel`` (``""`` is the prefix)."""

    @abstractmethod
    def read_bytes(self, rel: str, *, max_bytes: int = MAX_JSON_BYTES) -> bytes:
        """Read a whole (small) file; refuse files larger than ``max_bytes``."""

    @abstractmethod
    def map(self, rel: str, dtype: torch.dtype, numel: int, *, mode: MapMode) -> torch.Tensor:
        """Map the first ``numel`` elements of ``rel`` as a 1-D tensor, without copying.

        The caller has checked the file is large enough, and the file is checked again on
        the very descriptor that is mapped (it may have changed since); this never grows or
        creates a file. A file truncated after it was mapped raises SIGBUS on access.
        """

    def physical_path(self, rel: str) -> Path | None:
        """The real file behind ``rel`` when there is one (directories), else None."""
        return None

    def validated_root(self) -> Any:
        """The validated node tree (``validate.build_nodes``'s result, no problems), when the
        storage built it while reading its own metadata; None: read and validate as usual."""
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

    def prefetch(self, rels: Iterable[str]) -> None:  # noqa: B027 - optional hook
        """Read the leaf files ``rels`` ahead, together (a storage with ``ranged_reads``):
        what a restore maps next. Local storages map on demand and ignore it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (archives unmap their file)."""

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
