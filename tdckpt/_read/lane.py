"""The current-form lane: a restore's read of a tree exactly as tensordict 0.15.3 writes it.

Most checkpoints a restore meets are TensorDict levels that tensordict 0.15.3 (or tdckpt)
wrote and nobody touched: every ``meta.json`` in the exact current form (``_format_version``
1, plain ints and strings, see ``levels.py``), every key under its robust name, nothing else
in the directories. For those, the general read (``pipeline.open_checkpoint``) runs stages
that provably change nothing - generation detection (every level is marked current),
migration (none to run), name normalisation (every name already robust) - and on a small
checkpoint their bookkeeping, not the mapping, is much of the restore.

:func:`open_current` reads the tree with the general read's own walker (``tree.read_tree``:
the same race-free storage calls, identity checks, links and budgets), then checks each
directory with the rules those stages apply to such a tree - marked current
(``detect._marked_current``), a TensorDict level in exact form (``levels.exact_td_level``,
kept for validation), every key under its robust name (``names._already_robust``, which also
puts the entries in the general rule's order) - and validates with the standard
:func:`~tdckpt._read.validate.build_nodes`, every check included. It declines - returns None,
and the caller takes the general read - at anything else: another ``robust_key``, an archive,
a level that is not a TensorDict in exact form, a nested tensor, a key not under its robust
name, a file or directory no key names (strays, unsafe entries, links), a problem found while
reading or by validation. A restore that fails after the lane read the tree is read again by
the general path, so its error is the general read's, with every problem: the lane never
changes what a restore accepts, refuses or reports - with one exception, a selective restore.

A selective restore (``keys=`` / ``exclude=``) passes its selection: the tree is pruned to it
right after its metadata is read (``lane_prune.py``), before the checks above, so only the
selected part is checked, validated and mapped. Damage outside the selection (an entry of a
dtype tensordict does not know, a missing or short leaf file) then no longer refuses the
restore, as it does on the general read; everything restored is validated as before.
"""

from __future__ import annotations

import os

from tdckpt import schema
from tdckpt._read.detect import CURRENT_NAME, _marked_current, level_kind
from tdckpt._read.directory import DirectoryStorage
from tdckpt._read.lane_prune import Chooser, prune_tree
from tdckpt._read.levels import exact_td_level
from tdckpt._read.names import ROBUST, _already_robust
from tdckpt._read.pipeline import OpenedCheckpoint, _read_manifest_model
from tdckpt._read.tree import VDir, read_tree
from tdckpt._read.validate import build_nodes
from tdckpt.errors import TdckptError

__all__ = ["open_current"]


def open_current(
    prefix: str | os.PathLike[str],
    *,
    robust_key: bool | None,
    manifest_checked: bool = False,
    selection: Chooser | None = None,
) -> OpenedCheckpoint | None:
    """The checkpoint at ``prefix``, read and validated, if it is in the exact current form.

    Returns None where the general read (``open_checkpoint``) must decide. Arguments as
    :func:`~tdckpt._read.pipeline.open_checkpoint`; leaf files are listed without a stat
    (their sizes are checked when mapped), as every restore lists them.

    ``selection``: a selective restore's keys. What it leaves out is dropped right after the
    metadata is read (``lane_prune.prune_tree``), so only the selected part is checked and
    validated; ``pruned`` on the result says what was dropped.
    """
    if robust_key is not True:  # legacy or undecided names: the general rules decide
        return None
    storage = DirectoryStorage(prefix, defer_leaf_sizes=True)
    try:
        tree = read_tree(storage)
        pruned = None if selection is None else prune_tree(tree, selection)
        manifest = None
        if not _current_form(tree):
            raise TdckptError("not in the current form")  # declined, below
        if schema.MANIFEST_NAME in tree.files and not manifest_checked:
            manifest, problems = _read_manifest_model(storage, tree)
            if problems:
                raise TdckptError("manifest problems")
        root, problems = build_nodes(tree, storage)
        if problems or root is None:
            raise TdckptError("validation problems")
    except (TdckptError, OSError, ValueError):
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
        pruned=pruned,
    )


def _current_form(tree: VDir) -> bool:
    """Whether every directory of ``tree`` is a TensorDict level in the exact current form,
    its keys under their robust names and nothing else there; each is then left as the
    detection and names stages leave it (generation, entry order), its level kept."""
    levels = _marked_current(tree)  # every directory: meta.json, "_format_version" 1
    if levels is None:
        return False
    for node in levels:
        meta = node.meta
        assert meta is not None
        # Read problems and unsafe entries would be reported by validation too (a decline
        # then): seen here, they end the lane before any more work.
        if node.problems or node.unsafe or level_kind(meta) != "tensordict":
            return False
        level = exact_td_level(meta)
        if level is None or not _already_robust(node, meta):
            return False
        node.generation = CURRENT_NAME
        node.exact_level = level
    return True
