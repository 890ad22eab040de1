"""The restore engine: ``load_memmap`` (a new object) and ``load_memmap_`` (in place).

Everything that can fail runs first: read, migrate in memory, validate, apply the pickle
policy, map every leaf, unpickle, build every new object, and check that the target can
hold the result. Only then are references swapped into the target - plain dict and
attribute assignments that cannot fail halfway. Should anything fail anyway, the target
is put back exactly as it was (keys, values, batch size, lock and memmap state).

A restore never writes to the checkpoint: no meta.json is re-serialised to record the
memmap state (tensordict's ``memmap_()`` does that), no file is grown. Writes reach the
files only through tensors the caller writes into, with ``mode="r+"`` (or ``None`` on a
writable file, as tensordict does).
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch

from tdckpt._read.lane import open_current
from tdckpt._read.nodes import (
    pickled_nodes,
)
from tdckpt._read.object_storage import open_source
from tdckpt._read.pipeline import OpenedCheckpoint, open_checkpoint
from tdckpt._read.storage import MapMode, Storage
from tdckpt._remote.urls import is_url
from tdckpt._restore.apply import restore_into_target
from tdckpt._restore.budget import check_map_budget, leaf_sources, refuse_if_out_of_mappings
from tdckpt._restore.build import Builder
from tdckpt._restore.plan import (
    Mapper,
)
from tdckpt._restore.policy import check_allow_pickle, resolve_pickle_policy, user_stacklevel
from tdckpt._restore.select import RestoreReport, Selection, prune
from tdckpt._restore.transform import apply_transforms, check_device, check_transforms
from tdckpt.errors import TdckptError, ValidationError
from tdckpt.schema import MANIFEST_NAME
from tdckpt.warnings import TdckptWarning

__all__ = [
    "Admitted",
    "admit",
    "load_local",
    "load_memmap",
    "load_memmap_",
    "open_for_restore",
    "restore_in_place",
]

_MODES = (None, "r", "r+")


#: How often a restore reads a prefix again when it was replaced while being read.
_SWAP_RETRIES = 10

#: What names one committed tree at a prefix: the directory's ``(st_dev, st_ino)`` and its
#: manifest's generation (see :func:`_generation`).
_Identity = tuple[int, int, tuple[int, int, int, int] | None]


def _identity(prefix: str | os.PathLike[str] | Storage) -> _Identity | None:
    """What the prefix names now: its directory's (device, inode) and the generation of the
    tree committed there, or None if nothing (or not a path)."""
    if isinstance(prefix, Storage):
        return None
    try:
        st = os.stat(prefix)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino, _generation(prefix)


def _generation(prefix: str | os.PathLike[str]) -> tuple[int, int, int, int] | None:
    """One committed tree's token: its manifest's (inode, size, mtime_ns, ctime_ns).

    A directory's inode number alone does not name a tree: ``save(..., overwrite=True)``
    removes the old tree, and the next save's new folder may get the freed number, so a
    reader that opened the tree before last could not tell it was replaced. Every save
    writes a new manifest into its new folder; a leaf changed inside a committed tree leaves
    the manifest as it was (that change is refused, not read again). The directory's own
    ctime cannot serve: it changes with any entry renamed inside it. None where the prefix
    has no manifest (a plain ``td.memmap`` folder, which tdckpt never replaces without one).
    """
    try:
        st = os.lstat(f"{os.fspath(prefix)}/{MANIFEST_NAME}")  # never follows, never opens
    except (OSError, ValueError):
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _swapped(prefix: str | os.PathLike[str] | Storage, before: _Identity | None) -> bool:
    """Whether ``prefix`` now names another tree than when the failed read began.

    ``tdckpt.save(..., overwrite=True)`` swaps in the new tree atomically and then removes
    the old one: a read that had opened the old tree sees files vanish. That read failed
    only because of the swap; reading the new tree again is right. Another tree is another
    directory, or the same directory number (reused) holding another manifest.
    """
    now = _identity(prefix)
    return now is not None and now != before


def _check_args(robust_key: object, allow_pickle: object, mode: object) -> None:
    if robust_key is not None and not isinstance(robust_key, bool):
        raise TypeError(f"robust_key must be True, False or None, got {robust_key!r}.")
    check_allow_pickle(allow_pickle)
    if mode not in _MODES:
        raise ValueError(f"mode must be 'r', 'r+' or None, got {mode!r}.")


def _format_errors(opened: OpenedCheckpoint) -> str:
    errs = opened.errors
    shown = "\n".join(f"  - {p}" for p in errs[:20])
    more = f"\n  ... and {len(errs) - 20} more" if len(errs) > 20 else ""
    return (
        f"{opened.prefix}: cannot restore, the checkpoint has {len(errs)} problem(s); nothing "
        f"was changed:\n{shown}{more}\nRun `tdckpt validate {opened.prefix}` for the full report."
    )


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a restore builds its object tree.

    A 10,000-leaf restore allocates hundreds of thousands of small, acyclic objects;
    the collector's repeated full passes over them cost as much as the rest of the
    restore. Reference counting still frees everything; collection resumes afterwards.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class Admitted:
    """A prefix opened and validated as a restore reads it, nothing mapped yet.

    :func:`admit` makes one; :func:`load_local` (``opened=``) restores from it without
    reading the prefix again, and closes it. ``from_lane``: read by the current-form lane
    (its tree holds TensorDict levels and tensors only). ``identity``: what the prefix named
    when it was opened (a restore that fails because it was replaced reads it again).
    """

    opened: OpenedCheckpoint
    from_lane: bool
    identity: _Identity | None

    def close(self) -> None:
        self.opened.close()


def admit(
    prefix: str | os.PathLike[str] | Storage,
    *,
    robust_key: bool | None,
    manifest_checked: bool = False,
) -> Admitted:
    """Open and validate ``prefix`` as a restore does, mapping nothing.

    The current-form lane first (``robust_key=True`` on a directory), else the general read
    with leaf files listed without a stat (their sizes are checked when mapped). A
    checkpoint with problems is refused, every problem listed.

    Raises:
        ValidationError: the checkpoint has problems (all listed, as ``tdckpt validate``).
    """
    reading = _Reading(prefix, robust_key, None, manifest_checked)
    opened = reading.read()
    return Admitted(opened, reading.from_lane, reading.identity)


def _open_valid(
    prefix: str | os.PathLike[str] | Storage,
    *,
    robust_key: bool | None,
    defer_leaf_sizes: bool,
    manifest_checked: bool,
) -> OpenedCheckpoint:
    """The general read of ``prefix``, refused (every problem listed) unless it is valid."""
    opened = open_checkpoint(
        prefix,
        robust_key=robust_key,
        defer_leaf_sizes=defer_leaf_sizes,
        manifest_checked=manifest_checked,
    )
    if defer_leaf_sizes and (opened.root is None or (opened.problems and opened.errors)):
        # Refused: read it again with every size listed, so that the error lists short
        # leaves too (every problem at once, as `tdckpt validate` reports them).
        opened.close()
        opened = open_checkpoint(prefix, robust_key=robust_key, manifest_checked=manifest_checked)
    if opened.root is None or (opened.problems and opened.errors):
        opened.close()
        raise ValidationError(
            _format_errors(opened), report=opened.validation_report(), prefix=opened.prefix
        )
    return opened


def open_for_restore(
    prefix: str | os.PathLike[str] | Storage,
    *,
    robust_key: bool | None,
    allow_pickle: bool | None,
    defer_leaf_sizes: bool = False,
    manifest_checked: bool = False,
    selection: Selection | None = None,
    strict: bool = True,
    report: RestoreReport | None = None,
) -> tuple[OpenedCheckpoint, bool]:
    """Open and validate ``prefix``, apply the pickle policy: (opened, may_unpickle).

    ``defer_leaf_sizes``, ``manifest_checked``: see :func:`open_checkpoint`. ``selection``:
    the keys to keep (:func:`~tdckpt._restore.select.prune`, before the pickle policy; what
    it did goes into ``report``). The caller closes ``opened``; on any error it is closed
    here.
    """
    opened = _open_valid(
        prefix,
        robust_key=robust_key,
        defer_leaf_sizes=defer_leaf_sizes,
        manifest_checked=manifest_checked,
    )
    return opened, _policy(opened, allow_pickle, selection, strict, report)


def _policy(
    opened: OpenedCheckpoint,
    allow_pickle: bool | None,
    selection: Selection | None,
    strict: bool,
    report: RestoreReport | None,
) -> bool:
    """Prune ``opened`` to ``selection`` and apply the pickle policy: whether to unpickle.
    On any error ``opened`` is closed."""
    try:
        _select(opened, selection, strict, report)
        assert opened.root is not None
        pickled = [
            (n.key, n.pickle.source or n.path) for n in pickled_nodes(opened.root) if n.pickle
        ]
        resolve_pickle_policy(allow_pickle, pickled, prefix=opened.prefix)
        if opened.lost:
            warnings.warn(
                TdckptWarning(
                    f"{opened.prefix}: restored what the checkpoint holds, but the tensordict "
                    "release that wrote it had already lost some content: "
                    + "; ".join(opened.lost[:10])
                    + (f"; and {len(opened.lost) - 10} more" if len(opened.lost) > 10 else "")
                ),
                stacklevel=user_stacklevel(),
            )
    except BaseException:
        opened.close()
        raise
    return bool(pickled)


def _select(
    opened: OpenedCheckpoint,
    selection: Selection | None,
    strict: bool,
    report: RestoreReport | None,
) -> None:
    """Prune ``opened.root`` to ``selection`` (in place), recording what was kept."""
    if selection is None or opened.root is None:
        return
    pruned = opened.pruned  # the lane left out the rest before validating
    opened.root, done = prune(
        opened.root,
        selection,
        where=opened.prefix,
        strict=strict,
        skipped=None if pruned is None else pruned.skipped,
        top=None if pruned is None else pruned.top,
    )
    if report is not None:
        report.loaded, report.skipped, report.missing = done.loaded, done.skipped, done.missing


def load_memmap(
    prefix: str | os.PathLike[str],
    *,
    robust_key: bool | None = True,
    allow_pickle: bool | None = None,
    mode: str | None = None,
    device: torch.device | str | None = None,
    storage_options: dict[str, Any] | None = None,
    keys: Any = None,
    exclude: Any = None,
    strict: bool = True,
    report: bool = False,
    rename: Any = None,
    dtype: Any = None,
) -> Any:
    """Load a saved tensordict of any tensordict release into a new object.

    Args:
        prefix: the checkpoint directory, or its ``.tdz`` archive.
        robust_key: the key encoding: True (percent-encoded names, with tensordict's
            fallback to safe raw names), False (raw names), None (decide per directory
            from what is on disk; refuse ambiguity).
        allow_pickle: True loads pickled non-tensor data, False refuses it, None (the
            default) loads it with a FutureWarning until tensordict 0.16.
        mode: ``"r"`` maps files copy-on-write, ``"r+"`` shared and writable, None as
            tensordict (shared when the file is writable).
        device: move leaves there (``"cpu"`` keeps them memory-mapped; ``"meta"`` reads
            no file, as tensordict). A device this process does not have is refused
            (RestoreError) before anything is read.
        storage_options: for a ``prefix`` that is an fsspec URL (``s3://...``): the
            filesystem's options. A URL prefix is read into a private local copy first
            (``mode="r"``; see the remote guide).
        keys: restore only these keys (and what is below them): a nested key as a tuple,
            or a string split on ``.``, each name possibly with shell wildcards
            (``"model"``, ``"layers.*.weight"``), or a list of them. Only the selected
            leaves are mapped, and a pickled value left out needs no ``allow_pickle``.
        exclude: leave these keys out (same patterns), even where ``keys`` selects them.
        strict: a pattern of ``keys`` that selects nothing is an error (False: reported
            as ``missing``).
        report: also return a :class:`~tdckpt.RestoreReport` (loaded, skipped, missing,
            unexpected; keys as saved, before ``rename``).
        rename: move keys: a mapping of nested keys (``{"encoder": "model.encoder"}``), or
            a list of ``(regex, replacement)`` pairs applied to each leaf's dotted name.
        dtype: cast every floating-point leaf to this dtype, or a mapping of source dtypes
            to target dtypes (any kind). Cast leaves are copies; the others stay mapped.

    Returns:
        The saved object - TensorDict, LazyStackedTensorDict, tensorclass instance - with
        tensordict installed; nested dicts and lists of tensors and values without it.
        With ``report=True``: ``(object, report)``.

    Raises:
        tdckpt.errors.ValidationError: the checkpoint has problems (all listed).
        tdckpt.errors.PickleNotAllowedError: pickled data under allow_pickle=False.

    Example:
        >>> import tdckpt, tempfile, torch
        >>> from tensordict import TensorDict
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = TensorDict(a=torch.arange(3)).memmap(d)
        ...     tdckpt.load_memmap(d)["a"].tolist()
        [0, 1, 2]
    """
    _check_args(robust_key, allow_pickle, mode)
    check_transforms(rename, dtype)
    check_device(device, str(prefix))
    selection = Selection.of_report(keys, exclude, report)
    if is_url(prefix):  # read into memory (object_storage.py): never mode="r+"
        mode = _url_mode(mode)
    source = open_source(prefix, storage_options)
    done = RestoreReport()
    obj = load_local(
        source,
        robust_key=robust_key,
        allow_pickle=allow_pickle,
        mode=mode,
        device=device,
        selection=selection,
        strict=strict,
        report=done,
    )
    where = source.location if isinstance(source, Storage) else os.fspath(source)
    obj = apply_transforms(obj, rename=rename, dtype=dtype, where=where)
    return (obj, done) if report else obj


def load_local(
    prefix: str | os.PathLike[str] | Storage,
    *,
    robust_key: bool | None,
    allow_pickle: bool | None,
    mode: str | None,
    device: torch.device | str | None = None,
    manifest_checked: bool = False,
    selection: Selection | None = None,
    strict: bool = True,
    report: RestoreReport | None = None,
    opened: Admitted | None = None,
) -> Any:
    """:func:`load_memmap` of a local prefix (arguments already checked).

    ``manifest_checked``: the caller validated the prefix's manifest (see
    :func:`open_checkpoint`). ``selection``: the keys to restore; what it kept and left out
    is recorded into ``report``. ``opened``: ``prefix`` already opened and validated by
    :func:`admit` (with the same ``robust_key`` and ``manifest_checked``): restored from as
    it is, not read again (only a read that fails reads ``prefix`` again, as any restore
    does); closed here.
    """
    dev = torch.device(device) if device is not None else None
    reading = _Reading(prefix, robust_key, allow_pickle, manifest_checked, selection, strict)
    reading.given = opened
    if report is not None:
        reading.report = report
    with gc_paused():
        while True:  # inline: warnings keep their stack level
            try:
                current, unpickle = reading.open()
                try:
                    assert current.root is not None
                    check_map_budget(current, dev)
                    if dev is None or dev.type != "meta":
                        _read_ahead(current)
                    mapper = Mapper(current.storage, mode, dev)  # type: ignore[arg-type]
                    builder = Builder(current, mapper, unpickle)
                    try:
                        return builder.build(current.root)
                    except (TdckptError, MemoryError) as exc:
                        del builder, mapper  # what was mapped so far is freed before it is counted
                        refuse_if_out_of_mappings(current, dev, exc)
                        raise
                finally:
                    current.close()
            except TdckptError:
                if not reading.again():
                    raise


class _Reading:
    """How one restore reads its prefix, read after read, until one succeeds or fails for good.

    1. The current-form lane (``lane.open_current``), for what tensordict >= 0.15 (or
       tdckpt) wrote untouched: no detection, migration or name stage, leaf sizes checked
       when mapped. A selection is applied there before validation (only the selected
       part is checked: damage outside it does not refuse the restore on this path).
    2. Otherwise the general read, leaf files listed without a stat (their sizes checked
       when mapped).
    3. When a restore from a shortcut fails (the lane's, or a leaf too short for its listed
       size), the general read with everything listed: its error lists every problem, as
       ``tdckpt validate`` would. Nothing was changed: the target is touched only after
       every leaf is mapped.
    4. When a read failed because the prefix was replaced while being read (``tdckpt.save(...,
       overwrite=True)`` swaps the new tree in, then removes the old one), the new tree is
       read, up to ``_SWAP_RETRIES`` times.
    """

    def __init__(
        self,
        prefix: str | os.PathLike[str] | Storage,
        robust_key: bool | None,
        allow_pickle: bool | None,
        manifest_checked: bool,
        selection: Selection | None = None,
        strict: bool = True,
    ) -> None:
        self.prefix = prefix
        self.robust_key = robust_key
        self.allow_pickle = allow_pickle
        self.manifest_checked = manifest_checked
        self.selection = selection
        self.strict = strict
        self.report = RestoreReport()
        # listing leaves without a stat is a directory's shortcut; an opened storage is read
        # once, as it is (reading it again after closing it could not work)
        self.defer = not isinstance(prefix, Storage)
        # the lane reads a local directory; an opened storage is read as it is
        self.lane = robust_key is True and self.defer
        self.swaps = 0
        self.identity: _Identity | None = None
        self.opened: OpenedCheckpoint | None = None
        self.from_lane = False
        #: the prefix as :func:`admit` opened it, taken by the first read
        self.given: Admitted | None = None

    def read(self) -> OpenedCheckpoint:
        """The prefix opened and validated, not yet pruned: by the lane where it takes it
        (``from_lane``), else by the general read (refused, every problem listed)."""
        given, self.given = self.given, None
        if given is not None:
            self.identity, self.from_lane = given.identity, given.from_lane
            return given.opened
        self.identity = _identity(self.prefix)
        self.from_lane = False
        if self.lane:
            assert not isinstance(self.prefix, Storage)
            opened = open_current(
                self.prefix,
                robust_key=self.robust_key,
                manifest_checked=self.manifest_checked,
                selection=self.selection if _narrows(self.selection) else None,
            )
            if opened is not None:  # TensorDict levels and tensors only
                self.from_lane = True
                return opened
        return _open_valid(
            self.prefix,
            robust_key=self.robust_key,
            defer_leaf_sizes=self.defer,
            manifest_checked=self.manifest_checked,
        )

    def open(self) -> tuple[OpenedCheckpoint, bool]:
        """Read and validate the prefix: (opened, may_unpickle). The caller closes it."""
        self.opened = None  # until this read succeeds (again() looks at it)
        opened = self.opened = self.read()
        if not self.from_lane:
            unpickle = _policy(opened, self.allow_pickle, self.selection, self.strict, self.report)
            return opened, unpickle
        try:
            _select(opened, self.selection, self.strict, self.report)
        except BaseException:
            opened.close()
            # A pattern that selects nothing is decided by the keys, which the lane reads as
            # the general read does: final, not read again (the general read could only add
            # problems outside the selection).
            self.from_lane = False
            raise
        return opened, False  # nothing pickled

    def again(self) -> bool:
        """After a TdckptError: whether to read again (else the caller raises it)."""
        opened = self.opened
        if self.from_lane or (opened is not None and _short_leaf(opened)):
            self.lane = self.defer = False
            return True
        if self.swaps < _SWAP_RETRIES and _swapped(self.prefix, self.identity):
            self.swaps += 1
            return True
        return False


def _narrows(selection: Selection | None) -> bool:
    """Whether ``selection`` leaves anything out (not only a report of everything)."""
    return selection is not None and (selection.keys is not None or bool(selection.exclude))


def _read_ahead(opened: OpenedCheckpoint) -> None:
    """Ask a storage with ranged reads for every leaf the restore maps, all at once (after
    ``keys=`` / ``exclude=`` pruned the tree: only those leaves' bytes are fetched)."""
    if opened.storage.ranged_reads and opened.root is not None:
        opened.storage.prefetch(leaf_sources(opened.root))


def _short_leaf(opened: OpenedCheckpoint) -> bool:
    """Whether a leaf listed without a stat was refused as too short when mapped."""
    return opened.storage.deferred_size_refused


def load_memmap_(
    target: Any,
    prefix: str | os.PathLike[str],
    robust_key: bool | None = True,
    *,
    allow_pickle: bool | None = None,
    mode: str | None = None,
    storage_options: dict[str, Any] | None = None,
    keys: Any = None,
    exclude: Any = None,
    strict: bool = True,
    report: bool = False,
) -> Any:
    """Load a saved tensordict into ``target`` in place, all or nothing, and return it.

    The semantics of tensordict's ``TensorDictBase.load_memmap_``, made safe: the target
    and its nested tensordicts are reused (the same Python objects), every leaf is
    replaced by the loaded tensor (its old storage is not written to), keys absent from
    the checkpoint are removed at every level. A memory-mapped target ends memory-mapped
    on the loaded directory and locked; after an archive or ``mode="r"`` it ends unlocked
    and no longer memory-mapped. On any error the target is unchanged, and the checkpoint
    is never written to.

    ``target`` is a TensorDict (any nesting), a tensorclass instance, a
    LazyStackedTensorDict with the saved member count, a plain nested ``dict``, or a view
    of a TensorDict - a sub-tensordict (``td._get_sub_tensordict(idx)``) or a lazy view -
    which is loaded through into its parent as tensordict 0.15.3 does: a saved
    sub-tensordict's source replaces the parent's data, a saved TensorDict is set through
    a lazy view's inverse operation, or written into the rows of a sub-tensordict (new keys
    only, as tensordict). A saved lazy view loads its saved source into the target. On any
    error the parent is unchanged too. ``prefix`` may be an fsspec URL
    (``s3://bucket/ckpt``, with ``storage_options``). Other arguments as :func:`load_memmap`.

    ``keys`` / ``exclude`` restore a part: the selected keys are replaced (and, within the
    selection, keys the checkpoint lacks are removed); every entry of the target outside
    the selection stays as it is. ``report=True`` returns ``(target, report)``.

    Example:
        >>> import tdckpt, tempfile, torch
        >>> from tensordict import TensorDict
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = TensorDict(a=torch.ones(3)).memmap(d)
        ...     td = TensorDict(a=torch.zeros(3), stale=torch.zeros(3))
        ...     out = tdckpt.load_memmap_(td, d)
        ...     (out is td, sorted(td.keys()), td["a"].tolist())
        (True, ['a'], [1.0, 1.0, 1.0])
    """
    _check_args(robust_key, allow_pickle, mode)
    selection = Selection.of_report(keys, exclude, report, in_place=True)
    done = RestoreReport()
    if is_url(prefix):  # read into memory (object_storage.py): never mode="r+"
        mode = _url_mode(mode)
    source = open_source(prefix, storage_options)
    out = restore_in_place(
        target,
        source,
        robust_key,
        allow_pickle=allow_pickle,
        mode=mode,
        selection=selection,
        strict=strict,
        report=done if report else None,  # a report only when asked for
    )
    return (out, done) if report else out


def _url_mode(mode: str | None) -> str:
    if mode == "r+":
        raise ValueError(
            "mode='r+' makes writes reach the checkpoint's files; a checkpoint at a URL is read "
            "into memory, so they never could. Use mode='r' or None."
        )
    return "r"


def restore_in_place(
    target: Any,
    prefix: str | os.PathLike[str] | Storage,
    robust_key: bool | None,
    *,
    allow_pickle: bool | None,
    mode: str | None,
    check: Callable[[OpenedCheckpoint], None] | None = None,
    manifest_checked: bool = False,
    selection: Selection | None = None,
    strict: bool = True,
    report: RestoreReport | None = None,
) -> Any:
    """:func:`load_memmap_` (arguments already checked), with ``check(opened)`` run on the
    validated checkpoint after the pickle policy and before any leaf is mapped or value
    unpickled: whatever it raises leaves the target untouched. ``manifest_checked``: the
    caller validated the prefix's manifest (see :func:`open_checkpoint`). ``selection``
    (made with ``in_place=True``): the part restored, recorded into ``report``."""
    # Plain try/finally rather than context managers: this is the hot path of small restores.
    gc_enabled = gc.isenabled()
    gc.disable()  # as gc_paused()
    reading = _Reading(prefix, robust_key, allow_pickle, manifest_checked, selection, strict)
    if report is not None:
        reading.report = report
    try:
        while True:  # inline: warnings keep their stack level
            try:
                opened, unpickle = reading.open()
                try:
                    if check is not None:
                        check(opened)
                    if selection is not None and report is not None:
                        from tdckpt._restore.keys import report_difference

                        report_difference(opened, target, report, selection)
                    _read_ahead(opened)
                    restore_into_target(
                        target,
                        opened,
                        mode=cast("MapMode", mode),  # _check_args allowed only these
                        unpickle=unpickle,
                        builder_factory=Builder,
                    )
                finally:
                    opened.close()
                break
            except TdckptError:
                # The target is unchanged on any error, so reading again is safe.
                if not reading.again():
                    raise
    finally:
        if gc_enabled:
            gc.enable()
    return target
