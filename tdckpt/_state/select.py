"""Selective restore of a training state: ``keys=`` / ``exclude=`` name its entries.

A training state's step holds one entry per name given to ``save`` (``"model"``, ``"optim"``,
``"rng"``...), each encoded as a structure plus its tensors. A pattern names entries - one
name, shell wildcards allowed (``"model"``, ``"opt*"``); a pattern below an entry
(``"model.weight"``) is refused, since an entry is restored whole (its ``load_state_dict``
takes all of it).

:func:`restore_entries` is the in-place restore of a training state for both managers;
:func:`select_entries` decides, before anything is read, which entries a restore in place
concerns: the target's entries outside the selection stay as they are, and only the selected
entries the target has are read (their leaves alone are mapped).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tdckpt._restore.select import RestoreReport, Selection
from tdckpt._state.restore import restore_state
from tdckpt.errors import RestoreError
from tdckpt.schema import StateRecord

__all__ = ["EntrySelection", "check_entry_patterns", "restore_entries", "select_entries"]

Key = tuple[str, ...]


def check_entry_patterns(selection: Selection | None, where: str) -> None:
    """Refuse a pattern that names something inside an entry (before anything is read)."""
    if selection is None:
        return
    deep = [p for p in [*(selection.keys or []), *selection.exclude] if len(p) > 1]
    if deep:
        shown = ", ".join(repr(".".join(p)) for p in deep[:5])
        raise RestoreError(
            f"{where}: the step is a training state, whose keys= / exclude= name entries "
            f"(one name each, e.g. 'model', 'opt*'); {shown} name(s) something inside an "
            "entry, which is restored whole. Select the entry, then take what you need from it.",
            path=where,
        )


@dataclass
class EntrySelection:
    """What an in-place restore of a training state's selected entries does."""

    #: the target's entries the selection concerns (the others stay as they are)
    part: dict[str, Any]
    #: the state record reduced to the selected entries (what ``restore_state`` compares)
    record: StateRecord
    #: the selection the step is read with: the selected entries the target has
    read: Selection
    #: the patterns of ``keys`` that select no entry of the step
    missing: list[Key]
    #: the selected entries of the step that the target does not have
    unexpected: list[Key]

    def into(self, report: RestoreReport) -> None:
        """Complete ``report`` (its loaded / skipped leaves came from the read)."""
        report.missing = [*self.missing, *((n,) for n in self.part if n not in self.record.entries)]
        report.unexpected = list(self.unexpected)


def select_entries(
    state: Mapping[str, Any],
    record: StateRecord,
    selection: Selection,
    *,
    where: str,
    strict: bool,
) -> EntrySelection:
    """The entries of ``state`` and of the step that ``selection`` concerns.

    Raises:
        RestoreError: a pattern below an entry; ``strict`` and a pattern of ``keys`` that
            selects no entry of the step (every such pattern named, with the step's
            entries). Nothing has been read.
    """
    check_entry_patterns(selection, where)
    names = list(record.entries)
    chosen = [n for n in names if selection.selects((n,))]
    missing = []
    for pattern in selection.keys or []:
        one = Selection([pattern], selection.exclude)
        if not any(one.selects((n,)) for n in names):
            missing.append(pattern)
    if strict and missing:
        raise RestoreError(
            f"{where}: {len(missing)} pattern(s) of keys= select no entry of the step: "
            f"{', '.join('.'.join(p) for p in missing)}. The step's entries: "
            f"{', '.join(names[:20]) or '(none)'}. Fix the pattern, or pass strict=False to "
            "restore what the others select.",
            path=where,
        )
    part = {n: obj for n, obj in state.items() if isinstance(n, str) and selection.selects((n,))}
    reduced = record.model_copy(update={"entries": {n: record.entries[n] for n in chosen}})
    read = Selection([(n,) for n in chosen if n in part])
    unexpected: list[Key] = [(n,) for n in chosen if n not in part]
    return EntrySelection(part, reduced, read, missing, unexpected)


def restore_entries(
    state: Mapping[str, Any],
    read: Callable[[Selection | None], Any],
    record: StateRecord | None,
    selection: Selection | None,
    *,
    where: str,
    strict: bool,
    device: Any,
    report: RestoreReport,
) -> None:
    """:func:`~tdckpt._state.restore.restore_state` of the entries ``selection`` concerns.

    ``read(part)`` loads the step (only the keys of ``part`` when it is not None, recording
    the leaves loaded and skipped into ``report``); ``record`` is the step's state record
    (None: not a training state, refused by ``restore_state``). Without a selection every
    entry of ``state`` is restored, as before.
    """
    chosen = None
    if selection is not None and record is not None:
        chosen = select_entries(state, record, selection, where=where, strict=strict)
    loaded = read(chosen.read if chosen is not None else None)
    restore_state(
        chosen.part if chosen is not None else state,
        loaded,
        chosen.record if chosen is not None else record,
        where=where,
        strict=strict,
        device=device,
    )
    if chosen is not None:
        chosen.into(report)
