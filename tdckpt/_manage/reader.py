"""The restore half of :class:`tdckpt.CheckpointManager`: a committed step read back.

:class:`StepReader` does what :meth:`~tdckpt.CheckpointManager.restore_into` and
:meth:`~tdckpt.CheckpointManager.restore` promise, once the manager has handed it the call:

* it picks the step and pins it against retention and overwrites for as long as it reads
  (:class:`~tdckpt._manage.pins.StepPins`), re-reads it against its manifest first under
  ``verify=True`` (unless the store verifies every read anyway), and opens it through the
  store: a local folder or archive, or the store's own reader for object storage;
* it checks every file the restore reads whole (``meta.json``, ...) against the manifest
  (:func:`metadata_checked`), and under ``strict=True`` the target's keys against the
  step's, before anything is mapped or unpickled (:func:`same_keys`);
* it sends a collective restore, a sharded step or a ``rows=`` request to the shard layer
  (:mod:`tdckpt._shard.restore`), after the save in flight of ``save_async``;
* it hands the rest to the restore engine (:mod:`tdckpt._restore`) - a TensorDict-like in
  place, a training state entry by entry (:mod:`tdckpt._state.select`), or a new object.

It never writes to a step and never takes the writer lock.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tdckpt._manage.background import BackgroundSaver
from tdckpt._manage.pins import StepPins
from tdckpt._state import holds_live_objects
from tdckpt._store.base import StepRecord, StepStore
from tdckpt._write.incremental import writes_reach_files
from tdckpt.errors import IntegrityError, RestoreError, TdckptError
from tdckpt.schema import Manifest, ShardedManifest

if TYPE_CHECKING:
    from tdckpt._read.pipeline import OpenedCheckpoint
    from tdckpt._read.storage import Storage
    from tdckpt._shard.group import ShardGroup
    from tdckpt._shard.steps import ShardSteps

__all__ = ["StepReader", "metadata_checked", "same_keys"]


class StepReader:
    """Restore the committed steps of one root (see the module).

    Args:
        store: the root's step store.
        pins: the manager's pins (a step read is pinned until the read ends).
        shard: the manager's group (None: one process).
        background: the manager's background saver (a collective restore waits for it).

    It holds no reference to the manager (a manager nobody holds is freed at once): the
    shard layer's view of the root (a :class:`~tdckpt._shard.steps.ShardSteps`, made by
    the manager) comes with each call, as ``shard_steps``, made only when the restore is
    sharded.
    """

    def __init__(
        self,
        store: StepStore,
        pins: StepPins,
        *,
        shard: ShardGroup | None,
        background: BackgroundSaver,
    ) -> None:
        self._store = store
        self._pins = pins
        self._shard = shard
        self._background = background

    @property
    def root(self) -> Path | str:
        """The root the steps live in."""
        return self._store.root

    def restore_into(
        self,
        td: Any,
        step: int | None,
        *,
        allow_pickle: bool | None,
        mode: Literal["r", "r+"] | None,
        verify: bool,
        strict: bool,
        device: str | Any | None,
        keys: Any,
        exclude: Any,
        report: bool,
        shard_steps: Callable[[], ShardSteps],
    ) -> Any:
        """:meth:`tdckpt.CheckpointManager.restore_into` (the arguments are its own)."""
        from tdckpt._restore.engine import _check_args, load_local, restore_in_place
        from tdckpt._restore.select import RestoreReport, Selection

        _check_args(True, allow_pickle, mode)
        mode = self.mode(mode)
        selection = Selection.of_report(keys, exclude, report, in_place=True)
        if holds_live_objects(td):  # a training state (a dict of tensors is a nested-dict target)
            from tdckpt._restore.transform import check_device
            from tdckpt._state.select import restore_entries

            check_device(device, str(self.root))
            done = RestoreReport()
            with self.reading(step, verify, writes_reach_files(mode)) as (record, path):

                def read(part: Selection | None) -> Any:
                    with metadata_checked(path, record):
                        return load_local(
                            path,
                            robust_key=True,
                            allow_pickle=allow_pickle,
                            mode=mode,
                            manifest_checked=True,
                            selection=part,
                            report=done,
                        )

                restore_entries(
                    td,
                    read,
                    record.manifest.state,
                    selection,
                    where=f"{record.where}: step {record.step}",
                    strict=strict,
                    device=device,
                    report=done,
                )
            return (td, done) if report else td
        if device is not None:
            raise ValueError(
                "device= applies to a training state (a mapping of names to modules, ...); "
                "a TensorDict is restored memory-mapped on the CPU: move it afterwards."
            )
        # the kept warnings' stacklevel: 1 sharded, 2 here, 3 the manager, 4 its caller, 5...
        if self.sharded(step, None, stacklevel=5):
            from tdckpt._shard.restore import restore_into_rows

            done = RestoreReport()
            restore_into_rows(
                shard_steps(),
                td,
                step,
                allow_pickle=allow_pickle,
                mode=mode,
                verify=verify,
                strict=strict,
                selection=selection,
                report=done,
            )
            return (td, done) if report else td
        done = RestoreReport()
        with self.reading(step, verify, writes_reach_files(mode)) as (record, path):
            check = same_keys(td, str(record.where), record.step, selection)
            with metadata_checked(path, record):
                restore_in_place(
                    td,
                    path,
                    True,
                    allow_pickle=allow_pickle,
                    mode=mode,
                    check=check if strict else None,
                    manifest_checked=True,  # the store validated it
                    selection=selection,
                    strict=strict,
                    report=done if report else None,  # a report only when asked for
                )
        return (td, done) if report else td

    def restore(
        self,
        step: int | None,
        *,
        allow_pickle: bool | None,
        mode: Literal["r", "r+"] | None,
        verify: bool,
        rows: slice | None,
        keys: Any,
        exclude: Any,
        strict: bool,
        report: bool,
        rename: Any,
        dtype: Any,
        device: str | Any | None,
        shard_steps: Callable[[], ShardSteps],
    ) -> Any:
        """:meth:`tdckpt.CheckpointManager.restore` (the arguments are its own)."""
        from tdckpt._restore.engine import _check_args, load_local
        from tdckpt._restore.select import RestoreReport, Selection
        from tdckpt._restore.transform import apply_transforms, check_device, check_transforms

        check_transforms(rename, dtype)
        check_device(device, str(self.root))
        selection = Selection.of_report(keys, exclude, report)
        if rows is not None and not self._store.capabilities.collective:
            raise ValueError(
                f"{self.root}: rows= selects rows of a sharded step; sharded steps are saved "
                "to local roots. Restore the whole step and slice it."
            )
        # the kept warnings' stacklevel: 1 sharded, 2 here, 3 the manager, 4 its caller, 5...
        if self.sharded(step, rows, stacklevel=5):
            from tdckpt._shard.restore import restore_rows

            def transform(obj: Any) -> Any:
                obj = apply_transforms(obj, rename=rename, dtype=dtype, where=str(self.root))
                return obj if device is None else obj.to(device)

            done = RestoreReport()
            part = restore_rows(
                shard_steps(),
                step,
                rows,
                allow_pickle=allow_pickle,
                mode=mode,
                verify=verify,
                selection=selection,
                strict=strict,
                report=done,
                transform=transform if (rename, dtype, device) != (None, None, None) else None,
            )
            return (part, done) if report else part
        _check_args(True, allow_pickle, mode)
        mode = self.mode(mode)
        done = RestoreReport()
        with self.reading(step, verify, writes_reach_files(mode)) as (record, path):
            if record.manifest.state is not None:  # a training state: patterns name its entries
                from tdckpt._state.select import check_entry_patterns

                check_entry_patterns(selection, f"{record.where}: step {record.step}")
            with metadata_checked(path, record):
                obj = load_local(
                    path,
                    robust_key=True,
                    allow_pickle=allow_pickle,
                    mode=mode,
                    device=device,
                    manifest_checked=True,  # the store validated it
                    selection=selection,
                    strict=strict,
                    report=done,
                )
            obj = apply_transforms(
                obj, rename=rename, dtype=dtype, where=f"{self.root}: step {record.step}"
            )
        return (obj, done) if report else obj

    def verified(self, step: int, path: Path | str, manifest: Manifest) -> None:
        """Raise :class:`~tdckpt.errors.IntegrityError` unless the step passes verification."""
        report = self._store.verify(StepRecord(step, path, manifest), None)
        if not report.ok and step not in self._store.records():
            # deleted meanwhile (by another process's retention): not damage - say so
            self._store.resolve(step)  # CheckpointNotFoundError
        if not report.ok:
            raise IntegrityError(
                f"{path}: step {step} failed verification, so nothing was restored and the "
                f"target is unchanged.\n{report.summary()}\nRestore another step (see "
                "steps()), or re-save this one.",
                path=str(path),
                step=step,
                report=report,
                problems=list(report.problems),
            )

    @contextlib.contextmanager
    def reading(
        self, step: int | None, verify: bool, writes: bool = False
    ) -> Iterator[tuple[StepRecord, Path | Storage]]:
        """A committed step, pinned against retention and opened by the store (a local
        folder or archive, or the store's own reader), verified first when asked and the
        store's reads are not verified anyway. ``writes``: the restore maps files shared and
        writable (the store first gives this step private copies of the files it shares)."""
        with self._pins.pinned(step) as record:
            if verify and not self._store.capabilities.verifies_reads:
                self.verified(record.step, record.where, record.manifest)
            if writes and self._store.capabilities.file_backed:
                # validated before the store gives the step's shared files private copies:
                # a step refused (every problem listed) is left exactly as it was
                from tdckpt._restore.reading import admit

                admit(record.where, robust_key=True, manifest_checked=True).close()
            with self._store.open(record, writes=writes) as path:
                yield record, path

    def mode(self, mode: Literal["r", "r+"] | None) -> Literal["r", "r+"] | None:
        """``mode`` as the store can honour it: a step not read in place is read into a
        private copy, where ``"r+"`` would promise writes that never reach the step."""
        if self._store.capabilities.file_backed:
            return mode
        if mode == "r+":
            raise ValueError(
                "mode='r+' maps the checkpoint's files shared so writes reach them; a step in "
                "object storage is read into memory, so writes could never reach it. "
                "Use mode='r' (default)."
            )
        return "r"

    def sharded(self, step: int | None, rows: Any, *, stacklevel: int) -> bool:
        """Whether a restore is collective, of a sharded step, or of some rows.

        ``stacklevel``: where the warnings a finished background save kept are issued
        (1: this method, 2: its caller, ...).
        """
        if self._shard is not None or rows is not None:
            # One user of tdckpt's group at a time: a save in flight finishes first.
            self._background.drain(before="this restore started", stacklevel=stacklevel)
            return True
        if not self._store.capabilities.collective:
            return False  # no sharded step there: no listing to find out
        try:
            return isinstance(self._store.resolve(step).manifest, ShardedManifest)
        except TdckptError:
            return False  # the plain path raises the error


def metadata_checked(path: Path | Storage, record: StepRecord) -> Any:
    """Every file the restore reads whole (``meta.json``, ...) checked against the manifest.

    Always, not only under ``verify=True``: those files are read anyway (see
    :mod:`tdckpt._read.expected`). A mismatch raises an IntegrityError, target untouched.
    A store's own reader (object storage) checks every file it reads itself.
    """
    from tdckpt._read.expected import expecting

    if not isinstance(path, (str, os.PathLike)):
        return contextlib.nullcontext()
    return expecting(path, record.manifest, where=f"{record.where}: step {record.step}")


def same_keys(
    td: Any, where: str, step: int, selection: Any = None
) -> Callable[[OpenedCheckpoint], None]:
    """The ``strict=True`` check of :meth:`tdckpt.CheckpointManager.restore_into`.

    Runs on the validated node tree, before any leaf is mapped or value unpickled, and
    raises a RestoreError listing the keys that differ (``where``: the step's path or URL).
    With a ``selection`` (a selective restore), only the target's keys it concerns count.
    """
    from tdckpt._restore.keys import selected_difference, show_keys, structures_match

    def check(opened: OpenedCheckpoint) -> None:
        if opened.root is not None and structures_match(opened.root, td):
            return  # the same keys, level by level: nothing to list
        missing, unexpected = selected_difference(opened, td, selection)
        if missing or unexpected:
            raise RestoreError(
                f"{where}: step {step} does not have the target's keys (strict=True); "
                f"nothing was changed. In the target but not the checkpoint: "
                f"{show_keys(missing)}. In the checkpoint but not the target: "
                f"{show_keys(unexpected)}. Pass strict=False to give the target the "
                "checkpoint's structure, or use restore() for a new object.",
                path=where,
                step=step,
                missing=missing,
                unexpected=unexpected,
            )

    return check
