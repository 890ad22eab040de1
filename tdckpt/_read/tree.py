"""The metadata stage: a prefix read into a virtual tree of directories.

``read_tree(storage)`` reads every ``meta.json`` (and, for the oldest generation,
every ``meta.pt``) of a prefix, and lists every file with its size. No leaf byte is
read. The result is a tree of :class:`VDir` that mirrors the directory tree.

The same tree is what migrations rewrite (``migrate.py``): a migration edits
``VDir.meta``, renames entries of ``files``/``dirs``, or adds files with inline
``data``. A :class:`VFile` always remembers the physical file it came from
(``source``), so an in-memory migration never copies data, and an on-disk upgrade can
hard-link every unchanged leaf into the new layout.

Contract of the tree after migration (``current`` form = tensordict format v1):
every directory that is a collection has ``meta`` in the current form, its leaf files are
named ``<encode_key(key)>.memmap`` and its children ``<encode_key(key)>/``.
"""

from __future__ import annotations

import io
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from tdckpt._read.levels import TDLevel
from tdckpt._read.storage import MAX_JSON_BYTES, Listing, Storage, join
from tdckpt._report import Problem
from tdckpt.errors import CheckpointNotFoundError, MetadataError, TdckptError

__all__ = ["MAX_DEPTH", "MAX_ENTRIES", "MAX_METADATA_BYTES", "VDir", "VFile", "read_tree"]

#: Deeper trees are refused: no real tensordict nests this deep, and it bounds recursion.
MAX_DEPTH = 200
#: A prefix listing more entries (files, directories, links; all directories together)
#: is refused before more are read: it bounds the memory of the tree (about 1 kB an
#: entry). A 10,000-leaf tensordict lists about 10,000.
MAX_ENTRIES = 1_000_000
#: G1 metadata files are tiny; refuse anything larger before unpickling-free loading.
#: The same bound holds for what the file's zip entries inflate to (all together), and for
#: the values it loads, counted the way a copy would make them (a list referenced twice
#: counts twice, a string counts its length).
MAX_PT_BYTES = 1024 * 1024
#: All the metadata of one checkpoint together (meta.json bytes, meta.pt bytes once
#: inflated): one file hard-linked (or symlinked) into many directories is read once per
#: directory, so the per-file caps alone would let a few megabytes on disk cost terabytes.
MAX_METADATA_BYTES = 256 * 1024 * 1024
#: A meta.pt zip with more entries is refused (torch.save writes about seven).
MAX_PT_ENTRIES = 64
#: Values of a meta.pt nested deeper are refused (real ones nest three levels).
MAX_PT_DEPTH = 32


@dataclass(slots=True)
class VFile:
    """A file of the virtual tree.

    Attributes:
        source: path of the physical file in the storage, or None for new content.
        size: size in bytes.
        data: content created by a migration (then ``source`` is None).
    """

    source: str | None
    size: int
    data: bytes | None = None


@dataclass
class VDir:
    """A directory of the virtual tree.

    Attributes:
        source: the directory's physical path in the storage (``""`` = prefix root).
        meta: the parsed ``meta.json``, or None when the directory has none.
        files: file name -> file (``meta.json`` itself is not listed here).
        dirs: sub-directory name -> directory.
        pt: generation G1 only: ``meta.pt`` / ``<key>.meta.pt`` name -> loaded dict.
        unsafe: names that are never followed (symlinks out, special files) -> reason.
        problems: what went wrong reading this directory (bad JSON, ...).
        generation: the format generation that wrote it (set by detection).
    """

    source: str
    meta: dict[str, Any] | None = None
    files: dict[str, VFile] = field(default_factory=dict)
    dirs: dict[str, VDir] = field(default_factory=dict)
    pt: dict[str, dict[str, Any]] | None = None
    unsafe: dict[str, str] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    generation: str | None = None
    #: naming hints set by migrations for old generations: "robust", "legacy", or None
    #: (unknown: decided from what is on disk). Leaves and child directories can differ
    #: (tensordict 0.13 encoded leaf names but kept raw directory names).
    leaf_encoding: str | None = None
    dir_encoding: str | None = None
    #: ``meta`` as an exact-form TensorDict level, when a reader already parsed it so (the
    #: restore lane, ``lane.py``); validation then uses it instead of parsing ``meta`` again.
    #: Never set on a tree that migrations rewrite.
    exact_level: TDLevel | None = None

    def walk(self) -> Any:
        """Yield every directory of the tree, parents first."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(list(node.dirs.values())))


def read_tree(
    storage: Storage,
    *,
    max_depth: int = MAX_DEPTH,
    max_entries: int = MAX_ENTRIES,
    max_metadata_bytes: int = MAX_METADATA_BYTES,
) -> VDir:
    """Read the metadata of every directory under the prefix.

    Problems local to one directory (invalid JSON, an unreadable meta.pt) are recorded
    on that directory, so validation can report all of them. Only a prefix that is not
    a checkpoint at all raises, or one past a budget (``max_entries``,
    ``max_metadata_bytes``).

    Each directory is read once: one reached a second time (a symlink to a directory
    of the tree, a bind mount) is reported as unsafe and not read again, so links can
    never make the work grow beyond what is on disk (a chain of directories each
    holding two links to the next would otherwise be read 2**n times). Real paths are
    read before symlinked ones, so a link, not the directory it names, is the one
    refused.
    """
    walk = _Walk(storage, max_depth, max_entries, max_metadata_bytes)
    root = walk.read(VDir(source=""), depth=0)
    while walk.links:
        # Breadth of the links, in the order met: each names a directory already read
        # (its real path is inside the tree) unless that one was beyond max_depth.
        pending, walk.links = walk.links, []
        for parent, name, rel, depth in pending:
            walk.child(parent, name, rel, depth)
    return root


def _not_a_checkpoint(storage: Storage, root: VDir, listing: Listing) -> None:
    """Raise unless the top level holds metadata (checked before any sub-folder is read)."""
    if (
        root.meta is None
        and root.pt is None
        and not any(p.code == "bad-json" for p in root.problems)
    ):
        if "buffer_metadata.json" in root.files and "storage" in listing.dirs:
            # What torchrl's ReplayBuffer.dumps(path) writes: the tensordict is in storage/.
            raise CheckpointNotFoundError(
                f"{storage.display('')}: not a tensordict checkpoint but a TorchRL replay "
                "buffer (ReplayBuffer.dumps wrote buffer_metadata.json here): its tensordict "
                f"is the sub-directory 'storage'. Pass {storage.display('storage')!r} instead.",
                path=storage.location,
            )
        raise CheckpointNotFoundError(
            f"{storage.display('')}: not a tensordict checkpoint: no meta.json (or meta.pt) "
            "at its top level. Pass the directory (or .tdz) that `td.memmap(prefix)` or "
            "`td.save(prefix)` wrote.",
            path=storage.location,
        )


class _Walk:
    """One read of a prefix: the budget spent and the directories already read."""

    def __init__(
        self, storage: Storage, max_depth: int, max_entries: int, max_metadata_bytes: int
    ) -> None:
        self.storage = storage
        self.max_depth = max_depth
        self.max_entries = max_entries
        self.entries = 0
        self.max_metadata_bytes = max_metadata_bytes
        self.metadata_bytes = 0
        #: ``(st_dev, st_ino)`` -> the relative path it was first read as
        self.seen: dict[tuple[int, int], str] = {}
        #: symlinked sub-directories, read after every real one: (parent, name, rel, depth)
        self.links: list[tuple[VDir, str, str, int]] = []

    def read(self, node: VDir, *, depth: int) -> VDir:
        storage = self.storage
        rel = node.source
        # The prefix's own identity is asked only once it has sub-directories (below): only
        # they can lead back to it, and most small checkpoints have none.
        identity = storage.dir_identity(rel) if rel else None
        if identity is not None:
            first = self.seen.setdefault(identity, rel)
            if first != rel:
                # Not listed again; the parent reports it as it reports any unsafe entry.
                raise _SecondPath(first)
        listing = storage.listdir(rel)
        self.entries += len(listing.files) + len(listing.dirs) + len(listing.unsafe)
        if self.entries > self.max_entries:
            raise MetadataError(
                f"{storage.display(rel)}: the checkpoint lists more than {self.max_entries} "
                "files and directories, more than tdckpt reads for one checkpoint (a real "
                "tensordict of 10,000 leaves lists about 10,000). It is damaged or hostile; "
                "if it is genuine, save it in fewer, larger tensors.",
                path=storage.display(rel),
            )
        _fill(storage, node, listing, self.charge)
        if depth == 0:
            # Before descending: `tdckpt inspect /` must not walk the whole file system.
            _not_a_checkpoint(storage, node, listing)
        if listing.dirs and depth >= self.max_depth:
            node.problems.append(
                Problem(
                    "too-deep",
                    "error",
                    rel,
                    (),
                    f"directories nest more than {self.max_depth} levels deep; tdckpt stops "
                    "here. The checkpoint is damaged or hostile.",
                )
            )
            return node
        if not rel and listing.dirs:
            root = storage.dir_identity("")
            if root is not None:
                self.seen.setdefault(root, "")
        prefix = f"{rel}/" if rel else ""
        for name in sorted(listing.dirs):
            if name in listing.links:
                # A placeholder keeps the order of dirs; the walk fills it in later.
                node.dirs[name] = VDir(source=prefix + name)
                self.links.append((node, name, prefix + name, depth + 1))
                continue
            self.child(node, name, prefix + name, depth + 1)
        return node

    def charge(self, where: str, size: int) -> None:
        """Count ``size`` bytes of metadata about to be parsed from ``where``."""
        self.metadata_bytes += size
        if self.metadata_bytes > self.max_metadata_bytes:
            shown = self.storage.display(where)
            raise _OverBudget(
                f"{shown}: the checkpoint's metadata files hold more than "
                f"{self.max_metadata_bytes} bytes together, more than tdckpt reads for one "
                "checkpoint (a 10,000-leaf tensordict writes about 1 MB). It is damaged or "
                "hostile (one file linked into many directories is read in each).",
                path=shown,
            )

    def child(self, node: VDir, name: str, rel: str, depth: int) -> None:
        """Read the sub-directory ``name`` of ``node`` into ``node.dirs``."""
        try:
            node.dirs[name] = self.read(VDir(source=rel), depth=depth)
        except _SecondPath as again:
            node.dirs.pop(name, None)
            _unsafe(
                node,
                name,
                rel,
                f"a second path to the directory {again.first or '.'!r}, "
                "which tdckpt already read (a symlink or a mount inside the tree); every "
                "directory is read once",
            )


class _OverBudget(MetadataError):
    """A budget of the whole read is spent: it ends the read (not one file's problem)."""


class _SecondPath(Exception):
    def __init__(self, first: str) -> None:
        self.first = first


def _unsafe(node: VDir, name: str, rel: str, reason: str) -> None:
    node.unsafe[name] = reason
    node.problems.append(
        Problem(
            "unsafe-path",
            "error",
            rel,
            (),
            f"{reason}; tdckpt never follows it. Replace it with the real file or remove it.",
        )
    )


def _fill(
    storage: Storage, node: VDir, listing: Listing, charge: Callable[[str, int], None]
) -> None:
    """The files, unsafe entries and metadata of one listed directory."""
    rel = node.source
    for name, reason in listing.unsafe.items():
        _unsafe(node, name, join(rel, name), reason)
    files = node.files
    prefix = f"{rel}/" if rel else ""
    listed = listing.files
    # One VFile per file, built by C-level maps (a level of 10,000 leaves is the large one).
    names = list(listed)
    if "meta.json" in listed:
        names.remove("meta.json")
    sources = list(map(operator.add, repeat(prefix), names)) if prefix else names
    files.update(zip(names, map(VFile, sources, map(listed.__getitem__, names)), strict=True))
    if "meta.json" in listing.files:
        size = listing.files["meta.json"]
        # A file over the per-file cap is refused unread (its own problem): it costs nothing.
        charge(join(rel, "meta.json"), size if size <= MAX_JSON_BYTES else 0)
        try:
            meta = storage.read_json(join(rel, "meta.json"))
        except TdckptError as exc:
            node.problems.append(Problem("bad-json", "error", join(rel, "meta.json"), (), str(exc)))
        else:
            if isinstance(meta, dict):
                node.meta = meta
            else:
                node.problems.append(
                    Problem(
                        "bad-json",
                        "error",
                        join(rel, "meta.json"),
                        (),
                        f"expected a JSON object, found {type(meta).__name__}. The file is "
                        "damaged; restore it from a backup.",
                    )
                )
    elif "meta.pt" in listing.files or any(n.endswith(".meta.pt") for n in listing.files):
        node.pt = _read_pt_files(storage, rel, listing.files, node, charge)


def _read_pt_files(
    storage: Storage,
    rel: str,
    files: dict[str, int],
    node: VDir,
    charge: Callable[[str, int], None],
) -> dict[str, dict[str, Any]]:
    """Load G1 ``meta.pt`` files with ``torch.load(weights_only=True)`` only."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    for name in sorted(files):
        if name != "meta.pt" and not name.endswith(".meta.pt"):
            continue
        where = join(rel, name)
        charge(where, files[name] if files[name] <= MAX_PT_BYTES else 0)
        try:
            raw = storage.read_bytes(where, max_bytes=MAX_PT_BYTES)
            if raw[:4] == b"PK\x03\x04":
                raw = _bounded_zip(raw, storage.display(where))
                charge(where, max(len(raw) - files[name], 0))  # what it inflated to
            value = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
            _check_expanded(value, storage.display(where))
        except _OverBudget:
            raise
        except TdckptError as exc:
            node.problems.append(Problem("bad-meta-pt", "error", where, (), str(exc)))
            continue
        except Exception as exc:  # torch.load raises many types on hostile input
            node.problems.append(
                Problem(
                    "bad-meta-pt",
                    "error",
                    where,
                    (),
                    f"cannot be read with torch.load(weights_only=True) ({type(exc).__name__}: "
                    f"{exc}). tdckpt reads legacy metadata only when it holds plain sizes, "
                    "devices and dtypes; the file is damaged or holds other objects.",
                )
            )
            continue
        if not isinstance(value, dict):
            node.problems.append(
                Problem("bad-meta-pt", "error", where, (), "expected a dict of metadata.")
            )
            continue
        out[name] = value
        del node.files[name]
    return out


def _bounded_zip(raw: bytes, where: str) -> bytes:
    """The zip ``raw`` re-packed with stored entries, inflating at most ``MAX_PT_BYTES``.

    torch.load inflates a deflated entry whole, however large it declares or turns out to
    be: a 1 MiB meta.pt could inflate to 1 GiB. Here every entry's declared size is checked
    before anything is inflated, and each is inflated in bounded steps that never produce
    more than it declared. torch.load then reads only the checked bytes.
    """
    import zipfile

    def refuse(why: str) -> MetadataError:
        return MetadataError(
            f"{where}: {why}. A meta.pt that torch.save wrote is a small zip of stored "
            "entries; the file is damaged or hostile (a zip bomb). Restore it from a backup.",
            path=where,
        )

    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zin:
            infos = zin.infolist()
            if len(infos) > MAX_PT_ENTRIES:
                raise refuse(
                    f"{len(infos)} zip entries, more than the {MAX_PT_ENTRIES} tdckpt reads"
                )
            declared = sum(i.file_size for i in infos)
            if declared > MAX_PT_BYTES:
                raise refuse(
                    f"its zip entries declare {declared} bytes, more than the {MAX_PT_BYTES} "
                    "tdckpt inflates for a metadata file"
                )
            odd = [
                i.filename
                for i in infos
                if i.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
            ]
            if odd:
                raise refuse(
                    f"the zip entry {odd[0]!r} is compressed with a method torch.save never uses"
                )
            out = io.BytesIO()
            with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
                for info in infos:
                    # zipfile inflates at most what the entry declares (the rest is cut),
                    # asked for in steps: never more than ``declared`` bytes in all.
                    with zin.open(info) as fh:
                        data = fh.read(info.file_size)
                    zout.writestr(info.filename, data)
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        EOFError,
        OSError,
        ValueError,
        NotImplementedError,
    ) as exc:
        if isinstance(exc, MetadataError):
            raise
        raise refuse(f"not a readable zip ({type(exc).__name__}: {exc})") from exc
    return out.getvalue()


def _check_expanded(value: Any, where: str) -> None:
    """Refuse loaded metadata that a copy would make large (shared references) or deep.

    ``torch.load`` keeps pickle's shared references: a few kilobytes can hold a list of a
    thousand references to a list of a thousand references, and so on, which every
    conversion (a copy, ``str``, JSON) expands. Counted here as a copy would expand it,
    stopping as soon as the count passes ``MAX_PT_BYTES``.
    """
    budget = MAX_PT_BYTES
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        budget -= 1
        if isinstance(item, (str, bytes, bytearray)):
            budget -= len(item)
        elif isinstance(item, dict):
            # Charged when pushed, so the stack never holds more than the budget.
            budget -= 2 * len(item)
            if depth >= MAX_PT_DEPTH or budget < 0:
                break
            stack.extend((k, depth + 1) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            budget -= len(item)
            if depth >= MAX_PT_DEPTH or budget < 0:
                break
            stack.extend((v, depth + 1) for v in item)
        elif hasattr(item, "numel") and callable(item.numel):  # a tensor
            budget -= int(item.numel())
        if budget < 0:
            break
    else:
        return
    raise MetadataError(
        f"{where}: holds values nested more than {MAX_PT_DEPTH} levels deep or more than "
        f"{MAX_PT_BYTES} values once its shared references are expanded; a tensordict "
        "meta.pt holds a few sizes, dtypes and devices. The file is damaged or hostile.",
        path=where,
    )
