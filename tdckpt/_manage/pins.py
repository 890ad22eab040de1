"""The steps of a manager that are being read or overwritten, kept apart from retention.

A restore or a verify *pins* the committed step it picked (:meth:`StepPins.pinned`): until
its block ends, retention keeps the step (:meth:`StepPins.in_use`) and a save refuses to
overwrite it. A save that replaces a committed step marks it as *being overwritten*
(:meth:`StepPins.overwriting`): a restore or verify of that step waits for the swap to end
(:meth:`StepPins.settle`) rather than read a folder that is being replaced.

Every count and mark is guarded by the manager's state lock - the re-entrant lock its
:class:`~tdckpt._store.base.StepStore` shares, which retention holds while it retires steps
- so a restore cannot pick a step being deleted, nor retention delete a step a restore has
picked. The manager never touches these counts itself; it only asks.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from tdckpt._store.base import StepRecord, StepStore
from tdckpt.errors import CheckpointExistsError
from tdckpt.schema import Manifest

__all__ = ["StepPins"]


class StepPins:
    """Which steps of one root this manager is reading, and which it is overwriting.

    Args:
        store: the root's step store (it resolves the step a reader asks for).
        state: the manager's state lock (shared with the store and retention).
    """

    def __init__(self, store: StepStore, state: threading.RLock) -> None:
        self._store = store
        self._state = state
        # Signalled when an overwrite ends: a restore of that step waits for it rather than
        # read a folder that is being swapped.
        self._swapped = threading.Condition(state)
        self._overwriting: set[int] = set()
        self._in_use: Counter[int] = Counter()

    @contextlib.contextmanager
    def pinned(self, step: int | None) -> Iterator[StepRecord]:
        """Pick a committed step and protect it from retention until the block ends."""
        with self._state:
            record = self._store.resolve(step)
            while record.step in self._overwriting:
                self._swapped.wait()
                record = self._store.resolve(step)
            self._in_use[record.step] += 1
        try:
            yield record
        finally:
            with self._state:
                self._in_use[record.step] -= 1
                if self._in_use[record.step] <= 0:
                    del self._in_use[record.step]

    @contextlib.contextmanager
    def using(self, step: int | None) -> Iterator[tuple[int, Path, Manifest]]:
        """:meth:`pinned` as ``(step, path, manifest)``, for a local root's readers."""
        with self.pinned(step) as record:
            yield record.step, Path(record.where), record.manifest

    def settle(self, step: int) -> None:
        """Wait until ``step`` is not being overwritten (it may then be gone, or new)."""
        with self._state:
            while step in self._overwriting:
                self._swapped.wait()

    def in_use(self) -> set[int]:
        """The steps pinned right now (retention holds the state lock while it asks)."""
        with self._state:
            return set(self._in_use)

    @contextlib.contextmanager
    def overwriting(self, step: int) -> Iterator[None]:
        """Mark the committed ``step`` as being overwritten while the block runs (pins of it
        wait); refused if it is pinned - being restored or verified - right now."""
        with self._state:
            if self._in_use.get(step):
                raise CheckpointExistsError(
                    f"{self._store.root}: step {step} is being restored or verified right "
                    "now; it cannot be overwritten until that finishes. Save under "
                    "another step, or retry.",
                    path=str(self._store.root),
                    step=step,
                )
            self._overwriting.add(step)
        try:
            yield
        finally:
            with self._state:
                self._overwriting.discard(step)
                self._swapped.notify_all()
