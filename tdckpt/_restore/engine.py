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
from collections.abc import Callable
from typing import Any, cast

import torch

from tdckpt._read.object_open import open_source
from tdckpt._read.pipeline import OpenedCheckpoint
from tdckpt._read.storage import MapMode, Storage
from tdckpt._remote.urls import is_url
from tdckpt._restore.budget import check_map_budget, leaf_sources, refuse_if_out_of_mappings
from tdckpt._restore.build import Builder
from tdckpt._restore.commit import restore_into_target
from tdckpt._restore.plan import Mapper
from tdckpt._restore.policy import check_allow_pickle
from tdckpt._restore.reading import Admitted, Reading, gc_paused
from tdckpt._restore.select import RestoreReport, Selection
from tdckpt._restore.transform import apply_transforms, check_device, check_transforms
from tdckpt.errors import TdckptError

__all__ = ["load_local", "load_memmap", "load_memmap_", "restore_in_place"]

_MODES = (None, "r", "r+")


def _check_args(robust_key: object, allow_pickle: object, mode: object) -> None:
    if robust_key is not None and not isinstance(robust_key, bool):
        raise TypeError(f"robust_key must be True, False or None, got {robust_key!r}.")
    check_allow_pickle(allow_pickle)
    if mode not in _MODES:
        raise ValueError(f"mode must be 'r', 'r+' or None, got {mode!r}.")


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
    :func:`~tdckpt._restore.reading.admit` (with the same ``robust_key`` and
    ``manifest_checked``): restored from as it is, not read again (only a read that fails
    reads ``prefix`` again, as any restore does); closed here.
    """
    dev = torch.device(device) if device is not None else None
    reading = Reading(prefix, robust_key, allow_pickle, manifest_checked, selection, strict)
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


def _read_ahead(opened: OpenedCheckpoint) -> None:
    """Ask a storage with ranged reads for every leaf the restore maps, all at once (after
    ``keys=`` / ``exclude=`` pruned the tree: only those leaves' bytes are fetched)."""
    if opened.storage.ranged_reads and opened.root is not None:
        opened.storage.prefetch(leaf_sources(opened.root))


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
    reading = Reading(prefix, robust_key, allow_pickle, manifest_checked, selection, strict)
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
