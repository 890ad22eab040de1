"""The current-form lane: a restore's read of a tree exactly as tensordict 0.15.3 writes it.

Most checkpoints a restore meets are TensorDict levels that tensordict 0.15.3 (or tdckpt)
wrote and nobody touched: every ``meta.json`` in the exact current form (``_format_version``
1, plain ints and strings, see ``levels.py``), every key under its robust name, nothing else
in the directories. For those, the general read (``pipeline.open_checkpoint``) runs stages
that provably change nothing - generation detection (every level is marked current),
migration (none to run), name normalisation (every name already robust) - and on a small
checkpoint those stages, not the mapping, are most of the restore.

:func:`open_current` reads such a tree with the storage's own listing and metadata reads
(the same race-free calls, the same budgets) and builds the virtual tree exactly as the
general read leaves it after those stages; validation is the standard one
(:func:`~tdckpt._read.validate.build_nodes`), every check included. It declines - returns
None, and the caller takes the general read - at anything else: another ``robust_key``, an
archive, a level that is not a TensorDict in exact form, a nested tensor, a key not under
its robust name, a file or directory no key names (strays, sidecars, unsafe entries,
links), a directory reached twice, a problem found by validation, a tree past the general
read's budgets (entries, metadata bytes) or wider than the lane's own. A restore that fails
after the lane read the tree is read again by the general path, so its error is the general
read's, with every problem: the lane never changes what a restore accepts, refuses or
reports.
"""

from __future__ import annotations

import os

from tdckpt import schema
from tdckpt._keys import LEAF_SUFFIX, encode_key
from tdckpt._read import tree as _tree
from tdckpt._read.detect import CURRENT_NAME, level_kind
from tdckpt._read.levels import exact_td_level
from tdckpt._read.names import ROBUST
from tdckpt._read.pipeline import OpenedCheckpoint, _read_manifest_model
from tdckpt._read.storage import MAX_JSON_BYTES, DirectoryStorage
from tdckpt._read.tree import VDir, VFile
from tdckpt._read.validate import build_nodes
from tdckpt.errors import TdckptError

__all__ = ["open_current"]

#: Directories the lane reads; larger trees take the general read.
MAX_LANE_DIRS = 64


class _Decline(Exception):
    """Not a tree the lane reads: the caller takes the general read."""


def open_current(
    prefix: str | os.PathLike[str], *, robust_key: bool | None, manifest_checked: bool = False
) -> OpenedCheckpoint | None:
    """The checkpoint at ``prefix``, read and validated, if it is in the exact current form.

    Returns None where the general read (``open_checkpoint``) must decide. Arguments as
    :func:`~tdckpt._read.pipeline.open_checkpoint`; leaf files are listed without a stat
    (their sizes are checked when mapped), as every restore lists them.
    """
    if robust_key is not True:  # legacy or undecided names: the general rules decide
        return None
    storage = DirectoryStorage(prefix, defer_leaf_sizes=True)
    try:
        tree = _Lane(storage).level("")
        manifest = None
        if schema.MANIFEST_NAME in tree.files and not manifest_checked:
            manifest, problems = _read_manifest_model(storage, tree)
            if problems:
                raise _Decline
        root, problems = build_nodes(tree, storage)
        if problems or root is None:
            raise _Decline
    except (_Decline, TdckptError, OSError, ValueError):
        # ValueError: a name a component check refused. The general read says what is wrong.
        storage.close()
        return None
    except BaseException:
        storage.close()
        raise
    return OpenedCheckpoint(
        prefix=os.fspath(prefix),
        storage=storage,
        tree=tree,
        root=root,
        generation=CURRENT_NAME,
        key_encoding=ROBUST,
        manifest_model=manifest,
    )


class _Lane:
    """One lane read: the directories read (by identity) and the metadata bytes read."""

    def __init__(self, storage: DirectoryStorage) -> None:
        self.storage = storage
        self.seen: set[tuple[int, int]] = set()
        self.dirs = 0
        self.entries = 0
        self.metadata_bytes = 0

    def level(self, rel: str) -> VDir:
        """Read the TensorDict level ``rel``: what the general read builds for it, after
        detection (current), migration (none) and names (already robust) - or decline."""
        storage = self.storage
        self.dirs += 1
        if self.dirs > MAX_LANE_DIRS:
            raise _Decline
        if rel:  # a directory reached twice (a bind mount): the general read refuses it
            seen = self.seen
            if not seen:  # the prefix itself, asked only once it has children
                root = os.fstat(storage._dir_fd(""))
                seen.add((root.st_dev, root.st_ino))
            identity = storage.dir_identity(rel)
            if identity is None or identity in seen:
                raise _Decline
            seen.add(identity)
        listing = storage.listdir(rel)  # leaves without a stat: checked when mapped
        files = listing.files
        if listing.unsafe or listing.links or "meta.json" not in files:
            raise _Decline  # the general read reports unsafe entries, follows safe links
        # The general read's budgets (tree.py), declined rather than reported: that read
        # refuses the checkpoint with its own message.
        self.entries += len(files) + len(listing.dirs)
        size = files["meta.json"]
        self.metadata_bytes += size
        if (
            self.entries > _tree.MAX_ENTRIES
            or size > MAX_JSON_BYTES
            or self.metadata_bytes > _tree.MAX_METADATA_BYTES
        ):
            raise _Decline
        where = f"{rel}/meta.json" if rel else "meta.json"
        meta = storage.read_json(where)
        if type(meta) is not dict or level_kind(meta) != "tensordict":
            raise _Decline
        level = exact_td_level(meta)  # also: "_format_version" 1, the current generation
        if level is None:
            raise _Decline
        node = VDir(source=rel, meta=meta, generation=CURRENT_NAME, exact_level=level)
        prefix = f"{rel}/" if rel else ""
        vfiles = node.files
        children: list[str] = []
        for name, entry in level.entries.items():
            if type(entry) is tuple:
                fname = encode_key(name) + LEAF_SUFFIX
                # Every key under its robust name (names.py's _already_robust): a missing
                # one (a zero-element leaf, raw names) is for the general rules to decide.
                if entry[3] or fname not in files:  # entry[3]: a nested tensor
                    raise _Decline
                vfiles[fname] = VFile(prefix + fname, files[fname])
            else:
                children.append(encode_key(name))
        if not rel and schema.MANIFEST_NAME in files:  # tdckpt's: validated as the read path does
            vfiles[schema.MANIFEST_NAME] = VFile(schema.MANIFEST_NAME, files[schema.MANIFEST_NAME])
        if len(vfiles) + 1 != len(files) or len(children) != len(listing.dirs):
            # Anything no key names (sidecars, strays, other directories): the general read
            # decides what it is.
            raise _Decline
        for name in children:
            if name not in listing.dirs:
                raise _Decline
            node.dirs[name] = self.level(prefix + name)
        return node
