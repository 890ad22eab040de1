"""Selective restore: keep the part of a validated node tree that ``keys`` / ``exclude`` name.

A pattern is a nested key - a tuple of names, or a string split on ``.`` - whose names may
hold shell wildcards (``*``, ``?``, ``[...]``, matched per name with ``fnmatch``). A pattern
selects the key it names and everything below it: ``"model"`` selects every leaf of the
``model`` sub-tree, ``"*.weight"`` every ``weight`` one level down. A key is restored when
``keys`` is None or a pattern of ``keys`` selects it, and no pattern of ``exclude`` does.

Pruning runs on the node tree after validation and before the pickle policy and any
mapping, so only the selected leaves' bytes are mapped, and a pickled value left out does
not need ``allow_pickle``. The members of a lazy stack share their keys (a pattern applies
to each member alike). A tensorclass, a lazy view, a sub-tensordict and a non-tensor value
are kept or left out whole.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tdckpt._read.nodes import (
    LazyStackNode,
    LazyViewNode,
    Node,
    SubTensorDictNode,
    TensorClassNode,
    TensorDictNode,
)
from tdckpt.errors import RestoreError

__all__ = [
    "BELOW",
    "DROP",
    "KEEP",
    "Keeper",
    "RestoreReport",
    "Selection",
    "parse_patterns",
    "prune",
]

Key = tuple[str, ...]
#: Nodes with keys below them that are kept or left out whole.
_WHOLE = (TensorClassNode, SubTensorDictNode, LazyViewNode)


@dataclass
class RestoreReport:
    """What a selective restore did, key by key.

    The fields follow ``torch.nn.Module.load_state_dict``'s result (``missing``: asked for,
    not in the checkpoint; ``unexpected``: in the checkpoint, not in the target) and TorchRL's
    ``CheckpointLoadResult`` (``skipped``: not requested). Keys are as saved (before any
    ``rename``); a container's keys are listed by its leaves.

    Attributes:
        loaded: the keys restored (leaves, and values kept whole).
        skipped: the keys of the checkpoint left out (not selected, or excluded). Never an
            error.
        missing: what the restore asked for and the checkpoint lacks: the patterns of
            ``keys`` that select nothing, and, in place, the target's keys within the
            selection that the checkpoint does not hold (a restore removes them there).
        unexpected: in place, the keys of the selected part of the checkpoint that the
            target does not have (a restore adds them); always empty for a new object.

    Which of them is an error (raised before anything is changed):

    * ``strict=True`` (the default): a pattern of ``keys`` that selects nothing, always;
      and for :meth:`CheckpointManager.restore_into <tdckpt.CheckpointManager.restore_into>`
      any ``missing`` or ``unexpected`` key. :func:`tdckpt.load_memmap_` keeps
      tensordict's ``load_memmap_`` rule - the target takes the checkpoint's structure - and
      only reports those keys.
    * ``strict=False``: none of them; a pattern that selects nothing restores nothing.
    """

    loaded: list[Key] = field(default_factory=list)
    skipped: list[Key] = field(default_factory=list)
    missing: list[Key] = field(default_factory=list)
    unexpected: list[Key] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {name: [list(k) for k in getattr(self, name)] for name in _FIELDS}


_FIELDS = ("loaded", "skipped", "missing", "unexpected")


def parse_patterns(arg: Any, what: str) -> list[Key] | None:
    """``keys`` / ``exclude`` as a list of patterns (None stays None)."""
    if arg is None:
        return None
    items: Iterable[Any] = arg if isinstance(arg, (list, set, frozenset)) else [arg]
    out: list[Key] = []
    for item in items:
        if isinstance(item, str) and item:
            out.append(tuple(item.split(".")))
        elif (
            isinstance(item, tuple)
            and item
            and all(isinstance(part, str) and part for part in item)
        ):
            out.append(item)
        else:
            raise TypeError(
                f"{what}: each pattern is a non-empty str ('model.encoder', 'layers.*') or a "
                f"tuple of non-empty str ('a.b', 'c') for names holding a dot; got {item!r}"
            )
    return out


@dataclass(frozen=True)
class Selection:
    """Which keys a restore keeps."""

    keys: list[Key] | None = None
    exclude: list[Key] = dataclasses.field(default_factory=list)
    #: for a restore in place: the target's entries outside the selection stay as they are
    in_place: bool = False

    @classmethod
    def of(cls, keys: Any, exclude: Any) -> Selection | None:
        """The selection of ``keys`` / ``exclude`` (None when both are None: keep all)."""
        parsed_keys = parse_patterns(keys, "keys")
        parsed_exclude = parse_patterns(exclude, "exclude") or []
        if parsed_keys is None and not parsed_exclude:
            return None
        return cls(parsed_keys, parsed_exclude)

    @classmethod
    def of_report(
        cls, keys: Any, exclude: Any, report: bool, *, in_place: bool = False
    ) -> Selection | None:
        """As :meth:`of`; a selection of everything when only a report is asked for."""
        if keys is None and exclude is None and not report:
            return None  # a whole restore, no report: every restore's first question
        selection = cls.of(keys, exclude)
        if selection is None:
            return cls(in_place=in_place) if report else None
        return dataclasses.replace(selection, in_place=in_place)

    def selects(self, key: Key) -> bool:
        """Whether ``key`` (and everything below it) is restored."""
        if self.exclude and self._excluded.cover(key):
            return False
        return self.keys is None or self._selected.cover(key)

    def touches(self, key: Key) -> bool:
        """Whether a restore of this selection concerns ``key`` (selects it or below it)."""
        return self.selects(key) or self.reaches_below(key)

    def reaches_below(self, key: Key) -> bool:
        """Whether a pattern of ``keys`` names something below ``key`` (not excluded itself)."""
        if self.keys is None or (self.exclude and self._excluded.cover(key)):
            return False
        return self._selected.below(key)

    def names_below(self, key: Key) -> frozenset[str] | None:
        """The names of ``key``'s children that a pattern of ``keys`` can select or reach
        below, for a ``key`` not selected itself; None when any name may be (no ``keys``, a
        wildcard, or ``exclude``). A child of another name is neither selected nor reached."""
        if self.keys is None or self.exclude or self._selected.wild:
            return None
        return self._selected.children.get(key, frozenset())

    @functools.cached_property
    def _selected(self) -> _Patterns:
        return _Patterns(tuple(self.keys or ()))

    @functools.cached_property
    def _excluded(self) -> _Patterns:
        return _Patterns(tuple(self.exclude))


class _Patterns:
    """Patterns, the literal ones (no wildcard) in sets: a key of a 10,000-leaf checkpoint
    is then checked with one set lookup per level, not one fnmatch per pattern and name."""

    __slots__ = ("children", "literal", "prefixes", "wild")

    def __init__(self, patterns: tuple[Key, ...]) -> None:
        self.literal = frozenset(p for p in patterns if _literal(p))
        #: the keys strictly above a literal pattern
        self.prefixes = frozenset(p[:i] for p in self.literal for i in range(1, len(p)))
        self.wild = [p for p in patterns if p not in self.literal]
        #: a key strictly above a literal pattern -> the names one level down toward one
        children: dict[Key, set[str]] = {}
        for p in self.literal:
            for i in range(len(p)):
                children.setdefault(p[:i], set()).add(p[i])
        self.children = {k: frozenset(v) for k, v in children.items()}

    @classmethod
    def of(cls, patterns: list[Key]) -> _Patterns:
        return cls(tuple(patterns))

    def cover(self, key: Key) -> bool:
        """Whether a pattern names ``key`` or a key above it."""
        literal = self.literal
        if literal and any(key[:i] in literal for i in range(1, len(key) + 1)):
            return True
        return any(_covers(p, key) for p in self.wild)

    def below(self, key: Key) -> bool:
        """Whether a pattern names something strictly below ``key``."""
        if key in self.prefixes:
            return True
        size = len(key)
        return any(len(p) > size and _covers(p[:size], key) for p in self.wild)


def _covers(pattern: Key, key: Key) -> bool:
    """Whether ``pattern`` names ``key`` or a key above it."""
    size = len(pattern)
    if size > len(key):
        return False
    if _literal(pattern):  # most patterns: a tuple compare, not one fnmatch per name
        return key[:size] == pattern
    return all(fnmatch.fnmatchcase(name, part) for name, part in zip(key, pattern, strict=False))


@functools.lru_cache(maxsize=1024)
def _literal(pattern: Key) -> bool:
    """Whether no name of ``pattern`` holds a wildcard (``*``, ``?``, ``[``)."""
    return not any(ch in part for part in pattern for ch in "*?[")


def prune(
    root: Node,
    selection: Selection,
    *,
    where: str,
    strict: bool,
    in_place: bool = False,
    skipped: list[Key] | None = None,
    top: list[str] | None = None,
) -> tuple[Node, RestoreReport]:
    """The part of ``root`` that ``selection`` keeps, and the report.

    ``skipped`` / ``top``: for a ``root`` the read already pruned to ``selection`` (the
    lane, ``_read/lane_prune.py``): the keys it left out (reported first) and the
    checkpoint's top-level keys before pruning (for the error below).

    Raises:
        RestoreError: ``strict`` and a pattern of ``keys`` selects nothing (every such
            pattern named, with the checkpoint's top-level keys).
    """
    report = RestoreReport()
    if skipped:
        report.skipped.extend(skipped)
    used: set[Key] = set()
    in_place = in_place or selection.in_place
    pruned = _prune(root, (), selection, report, used, in_place)
    # lazy-stack members record their (shared) keys once each: keep each key once
    report.loaded = list(dict.fromkeys(report.loaded))
    report.skipped = list(dict.fromkeys(report.skipped))
    if selection.keys is not None:
        report.missing = [p for p in selection.keys if p not in used]
    if strict and report.missing:
        if top is None:
            top = list(root.entries) if isinstance(root, TensorDictNode) else []
        top = sorted(top)
        raise RestoreError(
            f"{where}: {len(report.missing)} pattern(s) of keys= select nothing: "
            f"{', '.join('.'.join(p) for p in report.missing)}. The checkpoint's top-level "
            f"keys: {', '.join(top[:20]) or '(none)'}. Fix the pattern, or pass strict=False "
            "to restore what the others select.",
            path=where,
        )
    if pruned is None:  # nothing selected: an empty level of the same kind
        pruned = _emptied(root)
        if in_place and isinstance(pruned, TensorDictNode):
            pruned = dataclasses.replace(pruned, keep=Keeper(selection, ()))
    return pruned, report


def _prune(
    node: Node,
    key: Key,
    selection: Selection,
    report: RestoreReport,
    used: set[Key],
    in_place: bool,
) -> Node | None:
    if selection.selects(key):
        _mark(key, selection, used)
        if not selection.exclude:
            start = len(report.loaded)
            _leaves(node, key, report.loaded)
            # a longer pattern (keys=["m", "m.x"]) selects something inside this whole level
            _mark_inside(key, report.loaded[start:], selection, used)
            return node
    if isinstance(node, TensorDictNode):
        entries = {}
        # Children no pattern can select or reach (literal keys, no exclude): skipped whole,
        # without asking the selection about each of their keys.
        candidates = selection.names_below(key)
        for name, child in node.entries.items():
            if candidates is not None and name not in candidates:
                _leaves(child, (*key, name), report.skipped)
                continue
            kept = _prune(child, (*key, name), selection, report, used, in_place)
            if kept is not None:
                entries[name] = kept
        if not entries and not selection.selects(key) and key:
            return None
        keep = Keeper(selection, key) if in_place else None
        return dataclasses.replace(node, entries=entries, keep=keep)
    if isinstance(node, LazyStackNode):
        kept_members = [_prune(m, key, selection, report, used, in_place) for m in node.members]
        if key and not selection.selects(key) and all(_is_empty(m) for m in kept_members):
            return None
        members = [
            m if m is not None else _emptied(o)
            for m, o in zip(kept_members, node.members, strict=True)
        ]
        return dataclasses.replace(node, members=members)
    # A leaf, a non-tensor value, a tensorclass, a view: kept or left out whole (a pattern
    # that names a field of a tensorclass, or a key of a view's source, keeps all of it).
    below = isinstance(node, _WHOLE) and selection.reaches_below(key)
    if selection.selects(key) or below:
        if below:
            _mark_below(key, selection, used)
        _leaves(node, key, report.loaded)
        return node
    _leaves(node, key, report.skipped)
    return None


#: What an in-place selective restore does with a target's entry the checkpoint's selected
#: part does not hold: keep it, drop it (it is selected: the checkpoint lacks it), or keep
#: it with the selected keys below it dropped (a pattern reaches below it).
KEEP, DROP, BELOW = "keep", "drop", "below"


@dataclass(frozen=True)
class Keeper:
    """For a level at ``key`` of an in-place selective restore: the verdict on each target
    entry the checkpoint's selected part does not hold (:data:`KEEP`, :data:`DROP`,
    :data:`BELOW`), and the keeper of a level below it."""

    selection: Selection
    key: Key

    def __call__(self, name: str) -> str:
        full = (*self.key, name)
        if self.selection.selects(full):
            return DROP
        if self.selection.reaches_below(full):
            return BELOW
        return KEEP

    def child(self, name: str) -> Keeper:
        return Keeper(self.selection, (*self.key, name))


def _mark(key: Key, selection: Selection, used: set[Key]) -> None:
    for pattern in selection.keys or []:
        if _covers(pattern, key):
            used.add(pattern)


def _mark_inside(key: Key, inside: list[Key], selection: Selection, used: set[Key]) -> None:
    """Mark the patterns longer than ``key`` that name one of the keys ``inside`` it (or a
    level above one of them): the level at ``key`` is restored whole, so they select."""
    for pattern in selection.keys or []:
        if pattern in used or len(pattern) <= len(key) or not _covers(pattern[: len(key)], key):
            continue
        if any(_covers(pattern, k) for k in inside):
            used.add(pattern)


def _mark_below(key: Key, selection: Selection, used: set[Key]) -> None:
    for pattern in selection.keys or []:
        if len(pattern) > len(key) and _covers(pattern[: len(key)], key):
            used.add(pattern)


def _leaves(node: Node, key: Key, out: list[Key]) -> None:
    """Record ``node``'s leaf keys (a container's leaves; other nodes as one key)."""
    if isinstance(node, TensorDictNode):
        for name, child in node.entries.items():
            _leaves(child, (*key, name), out)
    elif isinstance(node, LazyStackNode):
        seen: list[Key] = []
        for member in node.members:
            _leaves(member, key, seen)
        out.extend(dict.fromkeys(seen))  # each key once, whatever the number of members
    else:
        out.append(key)


def _emptied(node: Node) -> Node:
    if isinstance(node, TensorDictNode):
        return dataclasses.replace(node, entries={})
    if isinstance(node, LazyStackNode):
        return dataclasses.replace(node, members=[_emptied(m) for m in node.members])
    return node


def _is_empty(node: Node | None) -> bool:
    if node is None:
        return True
    if isinstance(node, TensorDictNode):
        return not node.entries
    if isinstance(node, LazyStackNode):
        return all(_is_empty(m) for m in node.members)
    return False
