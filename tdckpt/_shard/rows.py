"""Row planning and resharded reads of a sharded step.

The global TensorDict of a sharded step is its shards concatenated along dim 0 in rank
order; shard ``i`` holds the global rows ``shards[i].start .. shards[i].stop``. A rank that
wants rows ``a .. b`` (its part of ``torch.tensor_split`` of the global rows, or a slice it
names) intersects them with the shards, loads only the shards that overlap - each through
tdckpt's validated restore engine, whose leaves are race-free memory maps
(:mod:`tdckpt._read.storage`) - and slices the rows it needs out of each mapped leaf. Only
those rows' pages are ever touched, so only their bytes are read; where the rows lie in one
shard the result is a zero-copy view of the mapping, else one ``torch.cat`` copies exactly
the wanted rows.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tdckpt.errors import MetadataError, RestoreError, TdckptError, UnsafePathError
from tdckpt.schema import ShardedManifest, ShardRecord

if TYPE_CHECKING:
    from tdckpt._restore.reading import Admitted
    from tdckpt._restore.select import RestoreReport, Selection
    from tdckpt._shard.check import SplitCheck

__all__ = [
    "ReadStats",
    "check_every_shard",
    "even_part",
    "load_selected",
    "merge_reports",
    "plan_rows",
    "read_rows",
    "row_range",
]


@dataclass
class ReadStats:
    """What a resharded read asked of the files (for benchmarks and tests).

    Attributes:
        bytes_requested: tensor bytes of the rows sliced out of the mapped shards - the
            only bytes whose pages the read touches (a copy, or the caller's later use
            of a zero-copy view).
        shards_opened: shards whose prefix was opened.
    """

    bytes_requested: int = 0
    shards_opened: int = 0


def even_part(total: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``(start, stop)`` of part ``rank`` of ``torch.tensor_split(range(total), world)``.

    >>> [even_part(10, r, 3) for r in range(3)]
    [(0, 4), (4, 7), (7, 10)]
    """
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def row_range(rows: Any, total: int) -> tuple[int, int]:
    """``(start, stop)`` of a ``slice`` (step 1) or ``range`` of rows, clipped like a slice."""
    if isinstance(rows, range):
        rows = slice(rows.start, rows.stop, rows.step)
    if not isinstance(rows, slice):
        raise TypeError(
            f"rows must be a slice (e.g. slice(0, 100)) of the global rows, got {rows!r}"
        )
    start, stop, step = rows.indices(total)
    if step != 1:
        raise ValueError(f"rows must be a contiguous slice (step 1), got step {step}")
    return start, max(start, stop)


def plan_rows(
    shards: list[ShardRecord], start: int, stop: int
) -> list[tuple[ShardRecord, int, int]]:
    """The shards overlapping ``start .. stop``, each with its local rows ``(lo, hi)``.

    >>> from tdckpt.schema import ShardRecord
    >>> s = [ShardRecord(rank=i, prefix=f"a/{i}", start=4 * i, stop=4 * i + 4, root_type="t")
    ...      for i in range(2)]
    >>> [(p.rank, lo, hi) for p, lo, hi in plan_rows(s, 3, 6)]
    [(0, 3, 4), (1, 0, 2)]
    """
    out = []
    for shard in shards:
        lo, hi = max(start, shard.start), min(stop, shard.stop)
        if lo < hi:
            out.append((shard, lo - shard.start, hi - shard.start))
    return out


def _shard_path(step_path: Path, prefix: str) -> Path:
    """``step_path / prefix``, refusing a component that is a link or not a folder."""
    path = step_path
    for part in prefix.split("/"):
        path = path / part
        try:
            st = os.lstat(path)
        except FileNotFoundError as exc:
            raise RestoreError(
                f"{path}: missing; the step manifest names it as a shard. The step is "
                "damaged; restore another step (see steps()).",
                path=str(path),
            ) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(
                f"{path}: not a plain folder (a symlink?); a shard lives inside its step.",
                path=str(path),
            )
    return path


def _leaf_bytes(obj: Any) -> int:
    import torch
    from tensordict import is_tensor_collection

    total = 0
    values = obj.values(True, True) if is_tensor_collection(obj) else [obj]
    for value in values:
        if isinstance(value, torch.Tensor) and not value.is_nested:
            total += value.numel() * value.element_size()
    return total


def load_selected(
    path: Path,
    selection: Selection | None,
    *,
    allow_pickle: bool | None,
    mode: str | None,
    opened: Admitted | None = None,
) -> tuple[Any, RestoreReport | None]:
    """One prefix (a shard, the replicated entries, a plain step) restored whole or in part.

    With a ``selection`` only its leaves are mapped; a pattern that selects nothing here is
    not an error yet (it may select the replicated entries): see :func:`merge_reports`.
    ``opened``: ``path`` as :func:`~tdckpt._shard.check.open_checked` opened and checked it
    (restored from as it is, and closed).
    """
    from tdckpt._restore.engine import load_local
    from tdckpt._restore.select import RestoreReport, Selection

    if selection is None:
        loaded = load_local(
            path, robust_key=True, allow_pickle=allow_pickle, mode=mode, opened=opened
        )
        return loaded, None
    report = RestoreReport()
    loaded = load_local(
        path,
        robust_key=True,
        allow_pickle=allow_pickle,
        mode=mode,
        selection=Selection.of_report(selection.keys, selection.exclude, True),
        strict=False,
        report=report,
        opened=opened,
    )
    return loaded, report


def merge_reports(
    parts: list[RestoreReport | None],
    into: RestoreReport | None,
    *,
    where: Path,
    strict: bool,
) -> None:
    """Combine the reports of the prefixes a selective restore read (one shard's is enough:
    every shard holds the same keys); a pattern is missing when no part holds it.

    Raises:
        RestoreError: ``strict`` and a pattern of ``keys`` selects nothing in any part.
    """
    done = [p for p in parts if p is not None]
    if not done:
        return
    missing = [p for p in done[0].missing if all(p in other.missing for other in done[1:])]
    if strict and missing:
        raise RestoreError(
            f"{where}: {len(missing)} pattern(s) of keys= select nothing: "
            f"{', '.join('.'.join(p) for p in missing)}. Fix the pattern, or pass "
            "strict=False to restore what the others select.",
            path=str(where),
        )
    if into is not None:
        into.loaded = list(dict.fromkeys(k for p in done for k in p.loaded))
        into.skipped = list(dict.fromkeys(k for p in done for k in p.skipped))
        into.missing = missing


def _check_loaded_rows(loaded: Any, shard: ShardRecord, step_path: Path) -> None:
    """Refuse a shard whose rows, as mapped, are not those checked (its files replaced
    between :func:`~tdckpt._shard.check.check_shards` and the load): slicing it would
    give fewer or other rows silently."""
    batch = list(getattr(loaded, "batch_size", []))
    if batch and batch[0] == shard.stop - shard.start:
        return
    where = step_path / shard.prefix
    raise MetadataError(
        f"{where}: shard {shard.rank} holds batch size {batch} as it was loaded, but the "
        f"step manifest gives it rows {shard.start}..{shard.stop}: its files changed while "
        "the step was being restored; nothing was restored. Restore again, or another step.",
        path=str(where),
    )


def read_rows(
    step_path: Path,
    manifest: ShardedManifest,
    start: int,
    stop: int,
    *,
    allow_pickle: bool | None,
    mode: str | None,
    stats: ReadStats | None = None,
    selection: Selection | None = None,
    strict: bool = True,
    report: RestoreReport | None = None,
    split: SplitCheck | None = None,
) -> Any:
    """The global rows ``start .. stop`` of a sharded step (replicated entries put back).

    ``selection``: only these keys (each shard and the replicated entries read in part,
    only the selected leaves mapped); what was loaded and skipped goes into ``report``.
    ``split``: in a group, this rank's share of the shard check (the caller compares the
    ranks' digests, :func:`tdckpt._shard.restore.restore_rows`).

    Raises:
        MetadataError: the step manifest and its shards disagree (see
            :mod:`tdckpt._shard.check`), naming the shard's file and the key.
        RestoreError: ``strict`` and a pattern of ``keys`` selects nothing.
    """
    import torch

    from tdckpt._restore.reading import gc_paused
    from tdckpt._shard.check import open_checked

    plan = plan_rows(manifest.shards, start, stop)
    if not plan:  # no rows: the structure, from the first shard
        plan = [(manifest.shards[0], 0, 0)]
    # The manifest's rows, keys and dtypes are checked against every shard first (in a
    # group, this rank's share of them: SplitCheck); the shards read here stay open, and
    # are mapped as they were checked. The collector is paused throughout (its full passes
    # over every shard's metadata cost more than the check).
    with gc_paused():
        try:
            checked = open_checked(
                step_path,
                manifest,
                lambda prefix: _shard_path(step_path, prefix),
                keep={shard.rank for shard, _, _ in plan},
                keep_replicated=True,
                split=split,
            )
        except TdckptError:
            if split is not None:  # every rank then checks every shard (see SplitCheck)
                split.refused = True
            raise
        with checked:
            pieces = []
            reports: list[RestoreReport | None] = []
            for shard, lo, hi in plan:
                loaded, done = load_selected(
                    _shard_path(step_path, shard.prefix),
                    selection,
                    allow_pickle=allow_pickle,
                    mode=mode,
                    opened=checked.take(shard.rank),
                )
                if not reports:  # every shard holds the same keys: one's report says it
                    reports.append(done)
                _check_loaded_rows(loaded, shard, step_path)
                whole = lo == 0 and hi == shard.stop - shard.start
                pieces.append(loaded if whole else loaded[lo:hi])
                if stats is not None:
                    stats.shards_opened += 1
                    stats.bytes_requested += _leaf_bytes(pieces[-1])
            out: Any = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
            if manifest.replicated is not None:
                rep, done = load_selected(
                    _shard_path(step_path, manifest.replicated.prefix),
                    selection,
                    allow_pickle=allow_pickle,
                    mode=mode,
                    opened=checked.take_replicated(),
                )
                reports.append(done)
                present = {(k,) if isinstance(k, str) else k for k in rep.keys(True)}
                for key in manifest.replicated.keys:
                    if tuple(key) in present:  # a selective restore may have left it out
                        out.set(tuple(key), rep.get(tuple(key)))
    merge_reports(reports, report, where=step_path, strict=strict)
    return out


def check_every_shard(step_path: Path, manifest: ShardedManifest) -> None:
    """Check every shard of a step here (after the ranks of a group found that theirs
    differ): raises the MetadataError naming the shard and key that disagree."""
    from tdckpt._shard.check import check_shards

    check_shards(step_path, manifest, lambda prefix: _shard_path(step_path, prefix))
