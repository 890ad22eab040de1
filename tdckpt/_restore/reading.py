"""How a restore reads its prefix: opened and validated (the current-form lane first, else
the general read), pruned to a selection, the pickle policy applied - and read again when a
read fails only because of a shortcut or because the prefix was replaced while being read.

:class:`Reading` is that loop's state; :func:`admit` opens a prefix as a restore would,
mapping nothing (a collective restore checks every shard before any rank maps one).
Nothing here maps a leaf or touches a target: the engine (``engine.py``) does, once a read
succeeded.
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tdckpt._read.lane import open_current
from tdckpt._read.nodes import pickled_nodes
from tdckpt._read.pipeline import OpenedCheckpoint, open_checkpoint
from tdckpt._read.storage import Storage
from tdckpt._restore.policy import resolve_pickle_policy, user_stacklevel
from tdckpt._restore.select import RestoreReport, Selection, prune
from tdckpt.errors import ValidationError
from tdckpt.schema import MANIFEST_NAME
from tdckpt.warnings import TdckptWarning

__all__ = ["Admitted", "Reading", "admit", "gc_paused", "open_for_restore"]

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


def _format_errors(opened: OpenedCheckpoint, robust_key: bool | None = None) -> str:
    errs = opened.errors
    shown = "\n".join(f"  - {p}" for p in errs[:20])
    more = f"\n  ... and {len(errs) - 20} more" if len(errs) > 20 else ""
    # the report of the same read: validate with the key-encoding policy this read used
    flag = "" if robust_key is None else f" --robust-key {str(robust_key).lower()}"
    missing = any(p.code.startswith("missing") for p in errs)
    hint = (
        " This read took key names as percent-encoded (robust_key=True, tensordict's "
        "current names): a checkpoint written with raw key names (older releases) keeps "
        "its levels under those names, and reads with robust_key=None (detected) or False."
        if robust_key is True and missing
        else ""
    )
    return (
        f"{opened.prefix}: cannot restore, the checkpoint has {len(errs)} problem(s); nothing "
        f"was changed:\n{shown}{more}\nRun `tdckpt validate {opened.prefix}{flag}` for the "
        f"full report.{hint}"
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
    reading = Reading(prefix, robust_key, None, manifest_checked)
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
            _format_errors(opened, robust_key),
            report=opened.validation_report(),
            prefix=opened.prefix,
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


class Reading:
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


def _short_leaf(opened: OpenedCheckpoint) -> bool:
    """Whether a leaf listed without a stat was refused as too short when mapped."""
    return opened.storage.deferred_size_refused
