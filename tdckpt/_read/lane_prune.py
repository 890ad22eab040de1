"""The current-form lane's selective read: leave out the unselected keys before validation.

A selective restore (``keys=`` / ``exclude=``) keeps a part of a checkpoint. The general read
validates every leaf and then prunes the node tree (``_restore/select.py``). On the lane
(``lane.py``: TensorDict levels in the exact current form) the tree is pruned earlier: right
after its metadata is read, each level's ``meta.json`` entries, leaf files and child
directories that the selection leaves out are dropped from the virtual tree, so the current-
form checks, validation and mapping see only the selected part. A 1% restore of a 10,000-leaf
step then checks, opens and maps 1% of its leaves, not all of them.

What is dropped is never checked: a damaged entry outside the selection (a dtype tensordict
does not know, a shape that does not fit its level) does not refuse the restore on this path.
Everything kept is checked exactly as before; a level that is not a plain TensorDict level
stops the pruning there (it is kept, and the lane's checks decide).

The rule is the general one (``select.prune``), decided per entry from the selection's own
``selects`` / ``reaches_below``: an entry the selection selects is kept whole (or, with
``exclude``, entered and pruned in turn); a child level that a pattern reaches below is entered
and dropped if nothing in it is kept; anything else is dropped, its leaves recorded as skipped
in the order the general rule records them. A child level of another kind (a non-tensor
value, a tensorclass) is dropped whole, as one key; one holding a lazy stack, or whose
metadata could not be read, is kept, and the lane declines it as before. This module does
not import the selection (a layer above); it takes any object with those methods
(:class:`Chooser`).
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Any, Protocol

from tdckpt._keys import LEAF_SUFFIX, encode_key
from tdckpt._read.detect import level_kind
from tdckpt._read.tree import VDir

__all__ = ["Chooser", "Pruned", "prune_tree"]

Key = tuple[str, ...]


class Chooser(Protocol):
    """What the lane asks of a selection (``tdckpt._restore.select.Selection`` is one)."""

    @property
    def exclude(self) -> Any:
        """The exclude patterns (truthy when there are any)."""
        ...

    def selects(self, key: Key) -> bool:
        """Whether ``key`` (and everything below it) is restored."""
        ...

    def reaches_below(self, key: Key) -> bool:
        """Whether a pattern names something strictly below ``key``."""
        ...

    def names_below(self, key: Key) -> Set[str] | None:
        """The names of ``key``'s children that any pattern can select or reach below,
        or None when any name may be (wildcards, ``exclude``, no ``keys``)."""
        ...


@dataclass
class Pruned:
    """What a read left out of a checkpoint before validating it (``OpenedCheckpoint.pruned``).

    Attributes:
        skipped: the leaf keys dropped, in the order the general rule reports them.
        top: the checkpoint's top-level keys before pruning (an error names them).
    """

    skipped: list[Key]
    top: list[str]


def prune_tree(tree: VDir, chooser: Chooser) -> Pruned:
    """Drop from ``tree`` (in place) what ``chooser`` leaves out; say what was dropped.

    Only levels whose ``meta.json`` is a TensorDict level are entered; a level kept whole is
    left as read. The skipped keys are leaves (the leaves of a dropped level, found in its
    metadata), as ``select.prune`` reports them.
    """
    meta = tree.meta or {}
    top = [name for name, entry in meta.items() if type(entry) is dict]
    skipped: list[Key] = []
    _level(tree, (), chooser, skipped)
    return Pruned(skipped, top)


def _is_child(entry: dict[str, Any]) -> bool:
    """A nested collection's entry (the rule of ``names.entries_of``), else a leaf's."""
    return "type" in entry and "dtype" not in entry


def _level(vdir: VDir, key: Key, chooser: Chooser, skipped: list[Key]) -> bool:
    """Prune the level ``vdir`` at ``key`` (entered: not kept whole); whether anything of it
    is kept. A level that is not a TensorDict level is kept as it is."""
    meta = vdir.meta
    if meta is None or level_kind(meta) != "tensordict":
        return True
    candidates = chooser.names_below(key)
    exclude = bool(chooser.exclude)
    kept_meta: dict[str, Any] = {}
    dropped_files: list[str] = []
    dropped_dirs: list[str] = []
    kept_any = False
    for name, entry in meta.items():
        if type(entry) is not dict:  # a field of the level itself
            kept_meta[name] = entry
            continue
        sub = (*key, name)
        child = _is_child(entry)
        keep = False
        if candidates is None or name in candidates:
            selected = chooser.selects(sub)
            if selected and not exclude:
                keep = True  # kept whole, as read
            elif child and (selected or chooser.reaches_below(sub)):
                vchild = vdir.dirs.get(encode_key(name))
                # a missing directory is kept: validation reports it
                keep = vchild is None or _level(vchild, sub, chooser, skipped) or selected
            else:
                keep = selected
        if not keep and child:
            leaves: list[Key] = []
            if _leaves(vdir.dirs.get(encode_key(name)), sub, leaves):
                dropped_dirs.append(encode_key(name))
                skipped.extend(leaves)
                continue
            keep = True  # not all TensorDict levels: kept, and the lane's checks decide
        if keep:
            kept_meta[name] = entry
            kept_any = True
        else:
            dropped_files.append(encode_key(name) + LEAF_SUFFIX)
            skipped.append(sub)
    if dropped_files or dropped_dirs:
        vdir.meta = kept_meta
        for file_name in dropped_files:
            vdir.files.pop(file_name, None)
        for dir_name in dropped_dirs:
            vdir.dirs.pop(dir_name, None)
    return kept_any


def _leaves(vdir: VDir | None, key: Key, out: list[Key]) -> bool:
    """Record the keys of a level to drop, from its metadata (nothing else is checked), as
    the general rule reports them: a TensorDict level's leaves, a level of another kind (a
    non-tensor value, a tensorclass, a view) as its own key. Whether it can be dropped: not
    when a lazy stack is in it (reported by its members' keys, which only the validated
    tree has) or a level's metadata could not be read; it is then kept, and the lane
    declines it as before."""
    meta = vdir.meta if vdir is not None else None
    if vdir is None or meta is None:
        return False
    kind = level_kind(meta)
    if kind == "lazy-stack":
        return False
    if kind != "tensordict":
        out.append(key)
        return True
    for name, entry in meta.items():
        if type(entry) is not dict:
            continue
        if _is_child(entry):
            if not _leaves(vdir.dirs.get(encode_key(name)), (*key, name), out):
                return False
        else:
            out.append((*key, name))
    return True
