"""Restoring in a group of ranks, and restoring a sharded step anywhere.

* In a group of M ranks (every rank calls): rank 0 picks the step (the latest when none is
  given) and broadcasts it; each rank then reads the step manifest itself and takes its
  part - ``torch.tensor_split`` of the global rows into M, or the ``rows`` it asks for -
  reading only those rows (:mod:`tdckpt._shard.rows`). ``restore_into(td)`` gathers every
  rank's ``td.batch_size[0]`` so that the offsets follow rank order.
* Outside a group, a sharded step restores as the whole global TensorDict.

A plain (one-process) step restores the same way in a group: it is one shard holding
every row.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tdckpt._shard.check import SplitCheck
from tdckpt._shard.group import rank0_refusal
from tdckpt._shard.rows import (
    ReadStats,
    check_every_shard,
    even_part,
    load_selected,
    merge_reports,
    read_rows,
    row_range,
)
from tdckpt._shard.steps import ShardSteps
from tdckpt._write.atomic import check_step
from tdckpt.errors import MetadataError, RestoreError
from tdckpt.schema import Manifest, ShardedManifest

if TYPE_CHECKING:
    from tdckpt._restore.select import RestoreReport, Selection

__all__ = ["restore_into_rows", "restore_rows"]


def _pick(mgr: ShardSteps, step: int | None) -> int | str | None:
    """Rank 0's pick of the step to restore (the latest when ``step`` is None), or the error
    that refused it as ``"Class: message"``; None on the other ranks and outside a group.
    Exchanged in the :meth:`~tdckpt._shard.group.ShardGroup.agree` that opens the restore
    (no collective of its own)."""
    group = mgr.group
    if group is None or group.rank != 0:
        return None
    try:
        return mgr.resolve(step)[0]
    except Exception as exc:  # every rank raises the same error in _agreed_step
        return f"{type(exc).__name__}: {exc}"


def _agreed_step(mgr: ShardSteps, step: int | None, agreed: int | str | None) -> int | None:
    """The step every rank restores: rank 0's pick ``agreed`` (see :func:`_pick`)."""
    group = mgr.group
    if group is None:
        return step
    if step is not None:
        # every rank refuses a bad step argument alike, with the class a single process
        # raises (ValueError); after the agreement, so no rank is left waiting
        check_step(step)
    if isinstance(agreed, str):
        if group.rank == 0:
            mgr.resolve(step)  # raise the real error here
        raise rank0_refusal(  # the class rank 0 raised (no such step, ...)
            agreed.split(":", 1)[0],
            f"rank 0 could not pick the step to restore: {agreed}",
            RestoreError,
            step=step,
        )
    if step is not None and agreed != step:  # pragma: no cover - ranks passed other steps
        raise RestoreError(
            f"rank {group.rank} asked for step {step} but rank 0 for {agreed}; every rank "
            "must restore the same step.",
            step=step,
        )
    return None if agreed is None else int(agreed)


def _read(
    path: Path,
    manifest: Manifest,
    rows: Any,
    counts: list[int] | None,
    rank: int,
    world: int,
    *,
    allow_pickle: bool | None,
    mode: str | None,
    stats: ReadStats | None,
    selection: Selection | None = None,
    strict: bool = True,
    report: RestoreReport | None = None,
    split: SplitCheck | None = None,
) -> Any:
    if isinstance(manifest, ShardedManifest):
        total = manifest.batch_size[0]
        loaded = None
    else:
        from tdckpt._read.expected import expecting

        # a plain step's metadata checked against its manifest, as CheckpointManager.restore
        with expecting(path, manifest, where=f"{path}: step {manifest.step}"):
            loaded, done = load_selected(path, selection, allow_pickle=allow_pickle, mode=mode)
        merge_reports([done], report, where=path, strict=strict)
        if not getattr(loaded, "batch_size", None):
            raise RestoreError(
                f"{path}: this step has batch size {list(getattr(loaded, 'batch_size', []))}, "
                "so it has no rows to select or split across ranks. Restore it whole, without "
                "rows= and with a manager outside the group (group=None).",
                path=str(path),
            )
        total = int(loaded.batch_size[0])
    if counts is not None:
        start = sum(counts[:rank])
        stop = start + counts[rank]
        if sum(counts) > total:
            raise RestoreError(
                f"{path}: the ranks' targets take {sum(counts)} rows ({counts}, in rank "
                f"order) but the step holds {total}; nothing was changed. Size the targets' "
                "dim 0 to add up to at most the saved rows.",
                path=str(path),
                counts=counts,
            )
    elif rows is not None:
        start, stop = row_range(rows, total)
    else:
        start, stop = even_part(total, rank, world)
    if not isinstance(manifest, ShardedManifest):
        assert loaded is not None
        return loaded if (start, stop) == (0, total) else loaded[start:stop]
    return read_rows(
        path,
        manifest,
        start,
        stop,
        allow_pickle=allow_pickle,
        mode=mode,
        stats=stats,
        selection=selection,
        strict=strict,
        report=report,
        split=split,
    )


def _settle(
    mgr: ShardSteps,
    operation: str,
    step: int | None,
    error: BaseException | None,
    split: SplitCheck,
) -> None:
    """Agree on the outcome of a collective restore, before any target is changed.

    A rank whose share of the shard check refused a shard, or ranks whose shards differ
    (:class:`~tdckpt._shard.check.SplitCheck`): every rank checks every shard and raises
    the same error, naming the shard and key. Any other failure: that rank's error there,
    a CollectiveError naming it elsewhere.
    """
    assert mgr.group is not None
    own = None if split.refused else error  # a refused shard is every rank's error
    outcomes = mgr.group.settle(operation, step, own, payload=split.outcome())
    if split.settled(outcomes):
        return
    with mgr.using(step) as (_resolved, path, manifest):
        assert isinstance(manifest, ShardedManifest)
        check_every_shard(path, manifest)
    if error is not None:  # pragma: no cover - the shard changed back since it was refused
        raise error
    raise MetadataError(  # pragma: no cover - the shards changed while they were checked
        f"{path}: the ranks found shards that disagree, but every shard agrees when read "
        "again: the step was changed while it was restored. Nothing was restored; restore "
        "it again when nothing is writing it.",
        path=str(path),
    )


def restore_rows(
    mgr: ShardSteps,
    step: int | None,
    rows: Any,
    *,
    allow_pickle: bool | None,
    mode: str | None,
    verify: bool,
    stats: ReadStats | None = None,
    selection: Selection | None = None,
    strict: bool = True,
    report: RestoreReport | None = None,
    transform: Callable[[Any], Any] | None = None,
) -> Any:
    """``CheckpointManager.restore`` of a part of the global rows (see the module).

    In a group every rank first agrees on the operation and the step, and after reading
    on the outcome: a rank that fails makes every rank raise. ``selection``: only these
    keys are read (each rank maps only its rows of the selected leaves), recorded into
    ``report``. ``transform``: applied to this rank's part before the outcome is agreed
    (renames, casts, a device move: one rank that cannot makes every rank raise).
    """
    group = mgr.group
    if group is not None:
        (picked, *_) = group.agree("restore", step, payload=_pick(mgr, step))
        step = _agreed_step(mgr, step, picked)
    rank, world = (group.rank, group.size) if group is not None else (0, 1)
    split = SplitCheck(rank, world) if group is not None else None
    part: Any = None
    error: BaseException | None = None
    try:
        with mgr.using(step) as (resolved, path, manifest):
            if verify:
                mgr.verified(resolved, path, manifest)
            if group is None and rows is None:
                rank, world = 0, 1
            part = _read(
                path,
                manifest,
                rows,
                None,
                rank,
                world,
                allow_pickle=allow_pickle,
                mode=mode,
                stats=stats,
                selection=selection,
                strict=strict,
                report=report,
                split=split,
            )
            if transform is not None:
                part = transform(part)
    except Exception as exc:
        if group is None:
            raise
        error = exc
    if split is not None:
        _settle(mgr, "restore", step, error, split)
    return part


def restore_into_rows(
    mgr: ShardSteps,
    td: Any,
    step: int | None,
    *,
    allow_pickle: bool | None,
    mode: str | None,
    verify: bool,
    strict: bool,
    selection: Selection | None = None,
    report: RestoreReport | None = None,
) -> Any:
    """``CheckpointManager.restore_into``: ``td.batch_size[0]`` rows, offsets in rank order.

    ``selection`` (made with ``in_place=True``): only the selected keys are read and
    replaced; the target's entries outside it stay as they are (``strict`` compares the
    selected part only).
    """
    from tensordict import is_tensor_collection

    group = mgr.group
    refused: RestoreError | None = None
    if not is_tensor_collection(td) or not td.batch_size:
        refused = RestoreError(
            f"restore_into of a sharded or collective restore takes td.batch_size[0] rows; "
            f"the target is a {type(td).__name__} without a batch dimension.",
        )
    mine = int(td.batch_size[0]) if refused is None else 0
    counts = [mine]
    if group is not None:  # every rank restores the same step, or no target is touched
        # the targets' rows and rank 0's pick of the step travel with the agreement
        everyone = group.agree("restore_into", step, refused, payload=(mine, _pick(mgr, step)))
        counts = [rows for rows, _ in everyone]
        step = _agreed_step(mgr, step, everyone[0][1])
    elif refused is not None:
        raise refused
    rank, world = (group.rank, group.size) if group is not None else (0, 1)
    split = SplitCheck(rank, world) if group is not None else None
    error: BaseException | None = None
    try:
        with mgr.using(step) as (resolved, path, manifest):
            if verify:
                mgr.verified(resolved, path, manifest)
            part = _read(
                path,
                manifest,
                None,
                counts,
                rank,
                world,
                allow_pickle=allow_pickle,
                mode=mode,
                stats=None,
                selection=selection,
                strict=strict,
                report=report,
                split=split,
            )
            missing = _check_target(
                td, part, path, resolved, strict=strict, selection=selection, report=report
            )
    except Exception as exc:
        if group is None:
            raise
        error = exc
    if split is not None:  # a rank that refused leaves every rank's target untouched
        _settle(mgr, "restore_into", step, error, split)
    if selection is not None:  # within the selection the step decides; outside, the target
        from tensordict import is_tensorclass

        # TensorDict.update merges nested levels: the entries outside the selection stay
        into = td._tensordict if is_tensorclass(td) else td
        for key in missing if not strict else []:
            if key in into.keys(True):
                del into[key]
        into.update(part._tensordict if is_tensorclass(part) else part)
        return td
    target = td._tensordict if hasattr(td, "_tensordict") else td
    source = part._tensordict if hasattr(part, "_tensordict") else part
    if strict:
        target.update(source)
    else:
        for key in list(target.keys()):
            if key not in source:
                del target[key]
        target.update(source)
    return td


def _keys(obj: Any) -> set[tuple[str, ...]]:
    from tensordict.base import _is_leaf_nontensor

    out = set()
    for key in obj.keys(True, True, is_leaf=_is_leaf_nontensor):
        out.add(key if isinstance(key, tuple) else (key,))
    return out


def _check_target(
    td: Any,
    part: Any,
    path: Path,
    step: int,
    *,
    strict: bool,
    selection: Selection | None = None,
    report: RestoreReport | None = None,
) -> list[tuple[str, ...]]:
    """Refuse a target the rows cannot go into; the target's keys (within ``selection``)
    that the step lacks, which a ``strict=False`` restore removes."""
    if list(td.batch_size[1:]) != list(part.batch_size[1:]):
        raise RestoreError(
            f"{path}: step {step} has batch size [rows, {list(part.batch_size[1:])}] but the "
            f"target {list(td.batch_size)}; nothing was changed. The dims after dim 0 must "
            "agree.",
            path=str(path),
            step=step,
        )
    if type(td) is not type(part) and (hasattr(td, "_tensordict") or hasattr(part, "_tensordict")):
        raise RestoreError(
            f"{path}: step {step} holds a {type(part).__name__}, the target is a "
            f"{type(td).__name__}; nothing was changed.",
            path=str(path),
            step=step,
        )
    if not strict and selection is None:
        return []  # the target takes the step's structure: nothing to compare
    have, saved = _keys(td), _keys(part)
    missing, unexpected = sorted(have - saved), sorted(saved - have)
    if selection is not None:
        missing = [k for k in missing if selection.selects(k)]  # (as keys.selected_difference)
        if report is not None:
            report.missing = [*report.missing, *missing]
            report.unexpected = unexpected
    if strict and (missing or unexpected):
        from tdckpt._restore.keys import show_keys as _show_keys

        raise RestoreError(
            f"{path}: step {step} does not have the target's keys (strict=True); "
            f"nothing was changed. In the target but not the checkpoint: "
            f"{_show_keys(missing)}. In the checkpoint but not the target: "
            f"{_show_keys(unexpected)}. Pass strict=False to give the target the "
            "checkpoint's structure.",
            path=str(path),
            step=step,
            missing=missing,
            unexpected=unexpected,
        )
    return missing
