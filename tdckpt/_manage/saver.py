"""The save half of :class:`tdckpt.CheckpointManager`: write, commit, then retention.

:class:`StepSaver` runs the body of every save once the manager has checked its arguments,
taken its in-process write lock (``_writing``) and the root's writer lock:

* it claims the step (:meth:`StepSaver.claimed`): refused if it exists without
  ``overwrite``; an existing one is marked as being overwritten, and refused while it is
  restored or verified (:class:`~tdckpt._manage.pins.StepPins`);
* it begins an attempt in the store, writes the object into it, and commits it - or
  aborts it on any error, so nothing half-written is ever listed
  (:meth:`StepSaver.save_locked`); a collective save runs the shard layer's protocol
  instead (:meth:`StepSaver.save_collective`, :mod:`tdckpt._shard.save`);
* once the step is committed it applies the retention policy
  (:meth:`StepSaver.apply_retention`): never the newest step, the one just saved, or a
  pinned one; a failure then is a warning (:meth:`StepSaver.retain`), never a failed save.

The background thread of ``save_async`` (:mod:`tdckpt._manage.background`) runs the same
body (:meth:`StepSaver.save_in_background`). Lock order, as everywhere in the manager:
``_writing`` before the state lock, never the reverse.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tdckpt._manage import background as _background
from tdckpt._manage.pins import StepPins
from tdckpt._progress import ProgressArg, progress_bar
from tdckpt._state import is_state_mapping, to_tensordict
from tdckpt._store.base import StepRecord, StepStore
from tdckpt.errors import RemoteError, TdckptError
from tdckpt.retention import KeepAll, RetentionPolicy, StepInfo
from tdckpt.schema import StateRecord
from tdckpt.warnings import TdckptWarning

if TYPE_CHECKING:
    from tdckpt._shard.steps import ShardSteps

__all__ = ["StepSaver", "saveable", "step_info", "why"]


class StepSaver:
    """Write, commit and retain the steps of one root (see the module).

    It holds no reference to the manager (a manager nobody holds is freed at once, and
    its writer lock with it): the retention policy - the manager's public attribute, which
    may be replaced between saves - comes with each call, and so does the shard layer's
    view of the root.

    Args:
        store: the root's step store.
        pins: the manager's pins (a pinned step is neither overwritten nor deleted).
        writing: the manager's in-process write lock (one save, retention or gc at a time).
        state: the manager's state lock (held while retention retires steps).
    """

    def __init__(
        self, store: StepStore, pins: StepPins, *, writing: threading.Lock, state: threading.RLock
    ) -> None:
        self._store = store
        self._pins = pins
        self._writing = writing
        self._state = state

    def lock_root(self) -> None:
        """Take the root's writer lock (held until the manager closes), under ``_writing``."""
        self._store.lock()

    @contextlib.contextmanager
    def claimed(self, step: int, overwrite: bool) -> Iterator[None]:
        """Under ``_writing`` and the writer lock: ``step`` claimed while the block runs -
        refused if it exists without ``overwrite``, or is being restored or verified; an
        existing one is marked as being overwritten (restores of it wait)."""
        if not self._store.existing(step):
            yield
            return
        if not overwrite:
            raise self._store.exists_error(step)
        with self._pins.overwriting(step):
            yield

    def save_locked(
        self,
        step: int,
        obj: Any,
        metadata: dict[str, Any] | None,
        retention: RetentionPolicy,
        *,
        overwrite: bool,
        progress: ProgressArg = None,
        state: StateRecord | None = None,
        incremental: bool = False,
    ) -> Path | str:
        """The body of a save, under ``_writing`` and the writer lock: begin, write,
        commit, then retention.

        ``obj`` is what to write: an object, or a staged snapshot of one (the background
        thread of ``save_async``); ``retention``: the policy applied after the commit.
        """
        with self.claimed(step, overwrite):
            attempt = self._store.begin(step, overwrite=overwrite)
            try:
                with progress_bar(progress, "save") as report:
                    self._store.write(
                        attempt,
                        obj,
                        metadata=metadata,
                        state=state,
                        progress=report,
                        incremental=incremental,
                    )
            except BaseException:
                self._store.abort(attempt)
                raise
            # _warn_not_removed <- remove <- commit <- save_locked <- save <- caller
            path = self._store.commit(attempt, stacklevel=4)
        self.retain(step, retention, stacklevel=4)  # retain <- save_locked <- save <- caller
        return path

    def save_in_background(
        self,
        step: int,
        snapshot: Any,
        metadata: dict[str, Any] | None,
        state: StateRecord | None,
        retention: RetentionPolicy,
        incremental: bool = False,
    ) -> Path | str:
        """:meth:`save_locked` of a staged snapshot, on ``save_async``'s background thread."""
        with self._writing:
            self.lock_root()
            return self.save_locked(
                step,
                snapshot,
                metadata,
                retention,
                overwrite=False,
                state=state,
                incremental=incremental,
            )

    def save_collective(
        self,
        steps: ShardSteps,
        retention: RetentionPolicy,
        step: int,
        obj: Any,
        metadata: dict[str, Any] | None,
        overwrite: bool,
        replicated: Any,
        *,
        incremental: bool = False,
        refused: BaseException | None = None,
    ) -> Path:
        """The sharded save protocol over ``steps`` (every rank), then retention on rank 0;
        ``refused``: this rank's state or metadata was refused before (every rank raises)."""
        from tdckpt._shard.save import collective_save

        path = collective_save(
            steps,
            step,
            obj,
            metadata=metadata,
            overwrite=overwrite,
            replicated=replicated,
            incremental=incremental,
            refused=refused,
        )
        if steps.group is not None and steps.group.rank == 0:
            with self._writing:
                # <- save_collective <- save <- caller
                self.retain(step, retention, stacklevel=4)
        return path

    @contextlib.contextmanager
    def turn(self, step: int, overwrite: bool) -> Iterator[None]:
        """This process's exclusive turn to write ``step`` (see :meth:`claimed`)."""
        with self._writing:
            self.lock_root()
            with self.claimed(step, overwrite):
                yield

    def retain(self, step: int, retention: RetentionPolicy, *, stacklevel: int) -> None:
        """Retention after ``step`` committed: from here on nothing may make the save look
        failed, so a failure is a warning (``stacklevel`` counted from this method; on
        save_async's thread it is kept and issued on the caller's)."""
        try:
            self.apply_retention(retention, just_saved=step, stacklevel=stacklevel + 1)
        except (OSError, TdckptError) as exc:
            _background.warn(
                f"{self._store.commit_point(step)}: step {step} is committed, but applying "
                "the retention policy after "
                f"it failed ({why(exc)}); older steps it would have deleted may still be "
                "listed, and data of a deleted step may be left for gc. Run prune() and gc() "
                "(or `tdckpt gc`) again once the root answers.",
                TdckptWarning,
                stacklevel=stacklevel,
            )

    def apply_retention(
        self, retention: RetentionPolicy, *, just_saved: int | None, stacklevel: int
    ) -> list[Path | str]:
        """Retire the steps ``retention`` does not keep, then remove them. ``stacklevel``: of
        a warning about a step that could not be removed, counted from this method."""
        if type(retention) is KeepAll:
            return []  # keeps everything: no listing needed
        with self._state:
            records = self._store.records()
            infos = [step_info(record) for _, record in sorted(records.items())]
            if not infos:
                return []
            keep = set(retention.select_to_keep(infos))
            # Never: the newest committed step, the one just saved, one in use.
            keep.add(infos[-1].step)
            if just_saved is not None:
                keep.add(just_saved)
            keep.update(self._pins.in_use())
            retired = self._store.retire([records[i.step] for i in infos if i.step not in keep])
        # The (slow) removal runs without _state: restores of other steps need not wait.
        return self._store.remove(retired, stacklevel=stacklevel + 1)


def saveable(obj: Any) -> tuple[Any, StateRecord | None]:
    """What ``save``/``save_async`` write for ``obj``, and the training-state record.

    A training state (a mapping holding modules, optimizers, ...) becomes one
    TensorDict of every entry's state (:func:`tdckpt._state.to_tensordict`); anything
    else is written as it is. Runs on the caller's thread, before any snapshot.
    """
    if is_state_mapping(obj):
        return to_tensordict(obj)
    return obj, None


def step_info(record: StepRecord) -> StepInfo:
    """What a retention policy sees of a committed step (a copy of its metadata)."""
    return StepInfo(
        step=record.step,
        path=record.where,
        metadata=copy.deepcopy(record.manifest.user_metadata),
        created=record.manifest.created,
    )


def why(exc: BaseException) -> str:
    """What went wrong, for a warning issued after a commit: a store failure's operation,
    object and cause (not its "Nothing was committed" advice, which is for failed saves)."""
    from tdckpt._remote.store import shorten

    if isinstance(exc, RemoteError) and "operation" in exc.facts:
        cause = exc.__cause__
        shown = repr(cause) if cause is not None else exc.message
        return f"{exc.facts['operation']} of {exc.facts.get('path')}: {shorten(shown, 300)}"
    return shorten(str(exc), 400)
