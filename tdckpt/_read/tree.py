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
from dataclasses import dataclass, field
from typing import Any

from tdckpt._read.storage import Storage, join
from tdckpt._report import Problem
from tdckpt.errors import CheckpointNotFoundError, MetadataError, TdckptError

__all__ = ["MAX_DEPTH", "VDir", "VFile", "read_tree"]

#: Deeper trees are refused: no real tensordict nests this deep, and it bounds recursion.
MAX_DEPTH = 200
#: G1 metadata files are tiny; refuse anything larger before unpickling-free loading.
MAX_PT_BYTES = 1024 * 1024


@dataclass
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

    def walk(self) -> Any:
        """Yield every directory of the tree, parents first."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(list(node.dirs.values())))


def read_tree(storage: Storage, *, max_depth: int = MAX_DEPTH) -> VDir:
    """Read the metadata of every directory under the prefix.

    Problems local to one directory (invalid JSON, an unreadable meta.pt) are recorded
    on that directory, so validation can report all of them. Only a prefix that is not
    a checkpoint at all raises.
    """
    return _read_dir(storage, "", depth=0, max_depth=max_depth)


def _not_a_checkpoint(storage: Storage, root: VDir) -> None:
    """Raise unless the top level holds metadata (checked before any sub-folder is read)."""
    if root.meta is None and root.pt is None and not any(
        p.code == "bad-json" for p in root.problems
    ):
        raise CheckpointNotFoundError(
            f"{storage.display('')}: not a tensordict checkpoint: no meta.json (or meta.pt) "
            "at its top level. Pass the directory (or .tdz) that `td.memmap(prefix)` or "
            "`td.save(prefix)` wrote.",
            path=storage.location,
        )


def _read_dir(storage: Storage, rel: str, *, depth: int, max_depth: int) -> VDir:
    node = VDir(source=rel)
    listing = storage.listdir(rel)
    node.unsafe = dict(listing.unsafe)
    for name, reason in listing.unsafe.items():
        node.problems.append(
            Problem(
                "unsafe-path",
                "error",
                join(rel, name),
                (),
                f"{reason}; tdckpt never follows it. Replace it with the real file or "
                "remove it.",
            )
        )
    files = node.files
    prefix = f"{rel}/" if rel else ""
    for name, size in listing.files.items():
        if name != "meta.json":
            files[name] = VFile(prefix + name, size)
    if "meta.json" in listing.files:
        try:
            meta = storage.read_json(join(rel, "meta.json"))
        except TdckptError as exc:
            node.problems.append(
                Problem("bad-json", "error", join(rel, "meta.json"), (), str(exc))
            )
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
        node.pt = _read_pt_files(storage, rel, listing.files, node)
    if depth == 0:
        # Before descending: `tdckpt inspect /` must not walk the whole file system.
        _not_a_checkpoint(storage, node)
    if listing.dirs and depth >= max_depth:
        node.problems.append(
            Problem(
                "too-deep",
                "error",
                rel,
                (),
                f"directories nest more than {max_depth} levels deep; tdckpt stops here. "
                "The checkpoint is damaged or hostile.",
            )
        )
        return node
    for name in sorted(listing.dirs):
        node.dirs[name] = _read_dir(storage, join(rel, name), depth=depth + 1, max_depth=max_depth)
    return node


def _read_pt_files(
    storage: Storage, rel: str, files: dict[str, int], node: VDir
) -> dict[str, dict[str, Any]]:
    """Load G1 ``meta.pt`` files with ``torch.load(weights_only=True)`` only."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    for name in sorted(files):
        if name != "meta.pt" and not name.endswith(".meta.pt"):
            continue
        where = join(rel, name)
        try:
            raw = storage.read_bytes(where, max_bytes=MAX_PT_BYTES)
            value = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
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


def missing_meta_error(storage: Storage, rel: str) -> MetadataError:
    """The error for a collection directory that has no metadata at all."""
    return MetadataError(
        f"{storage.display(join(rel, 'meta.json'))}: missing. Every saved collection "
        "has one; the checkpoint is incomplete.",
        path=storage.display(rel),
    )
