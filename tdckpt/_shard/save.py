"""The collective save protocol of a sharded step.

Every rank of the manager's gloo group calls :func:`collective_save` with the same step::

    rank 0: take its turn (the root's writer lock, the step claimed), begin the step's
            attempt in the store - the staging folder <root>/<step>.tmp-<uuid>/ - and
            create a fresh attempt-<uuid>/ inside it
    bcast   rank 0 -> all: the attempt's path (or rank 0's refusal: every rank raises)
    all:    write this rank's shard as a plain tensordict prefix
            attempt-<uuid>/shard-<rank>/ (tdckpt._write.save.write_checkpoint: every file
            fsynced, checksummed while written; with layout="consolidated" one data file
            and the shard's manifest of per-leaf checksums, write_consolidated); rank 0
            also writes the replicated entries into attempt-<uuid>/replicated/
    gather  all -> rank 0: each shard's record (rows, files, sizes, checksums) or its error
    rank 0: check coverage (build_manifest), write ONE step manifest into the staging folder
            (tmp + fsync + os.replace + fsync), then commit the attempt in the store
            (one rename to <root>/<step>; an overwrite swaps it in atomically)
    bcast   rank 0 -> all: the outcome; no rank returns before it knows it
    (the manager, on rank 0: retention, only after the outcome is out)

A rank that fails (bad input, a full disk) still joins every collective and reports its
error, so every rank raises; a dead or hung rank makes the collectives fail within the
group's timeout (:class:`~tdckpt.errors.CollectiveError`). Either way nothing is committed
and earlier steps are untouched: what was written is a ``*.tmp-*`` staging folder that
``gc`` removes. The steps are driven through :class:`~tdckpt._shard.steps.ShardSteps` (the
store's begin / commit / abort and the manager's policy hooks): this module never imports
the manager.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tdckpt._shard.check import prefix_digest
from tdckpt._shard.group import ShardGroup, rank0_refusal
from tdckpt._shard.manifest import ShardResult, build_manifest, step_document
from tdckpt._shard.steps import ShardSteps
from tdckpt._write import atomic as _atomic
from tdckpt._write.incremental import IncrementalBase, IncrementalSave
from tdckpt._write.save import check_json_data, write_checkpoint, writer_versions
from tdckpt._write.writer import write_small
from tdckpt.errors import (
    CollectiveError,
    TdckptError,
    UnsupportedContentError,
)
from tdckpt.schema import MANIFEST_NAME, Manifest, ShardedManifest, manifest_bytes

__all__ = ["collective_save", "fault_point", "split_shard"]

Key = tuple[str, ...]


def _no_fault(phase: str) -> None:
    """Where a test's fault injector hooks in (tests/_shard_child.py); does nothing here."""


#: Called with the phase name at each protocol boundary ("before_write", "before_gather",
#: "after_records", "after_commit"); only tests replace it.
fault_point: Callable[[str], None] = _no_fault


def _fault(phase: str) -> None:
    fault_point(phase)


# -- the shard and its replicated entries --------------------------------------------------


def _norm_key(key: Any) -> Key:
    if isinstance(key, str):
        return (key,)
    if isinstance(key, tuple) and key and all(isinstance(k, str) for k in key):
        return key
    raise TypeError(f"a replicated entry is named by a str or a tuple of str, got {key!r}")


def _unbatched(value: Any, where: str) -> Any:
    """``value`` with no batch dims: non-tensor data (nested in TensorDicts) only."""
    from tensordict import NonTensorData, TensorDict, TensorDictBase

    if isinstance(value, NonTensorData):
        return NonTensorData(value.data, batch_size=[])
    if isinstance(value, TensorDictBase) and type(value) is TensorDict:
        return TensorDict(
            {k: _unbatched(v, f"{where}.{k}") for k, v in value.items()}, batch_size=[]
        )
    raise UnsupportedContentError(
        f"{where}: a replicated entry must carry no batch dimension of the shard (non-tensor "
        f"data, or TensorDicts of it); this one is a {type(value).__name__}. Save it as part "
        "of the shard instead (drop it from replicated=).",
        path=where,
        problems=[f"{where}: a {type(value).__name__} cannot be replicated"],
        keys=[tuple(where.split("."))],
    )


def split_shard(obj: Any, replicated: Iterable[Any]) -> tuple[Any, Any, list[list[str]]]:
    """``(shard, replicated TensorDict or None, replicated keys)`` for this rank's ``obj``.

    Raises:
        UnsupportedContentError: ``obj`` has no batch dimension to shard along, or a
            replicated entry is missing or carries the batch dimension.
    """
    from tensordict import TensorDict, TensorDictBase, is_tensor_collection

    if not is_tensor_collection(obj) or not obj.batch_size:
        shape = list(obj.batch_size) if is_tensor_collection(obj) else None
        raise UnsupportedContentError(
            f"a sharded save splits along dim 0 of the batch size; this rank's "
            f"{type(obj).__name__} has batch size {shape}. Give it a batch dimension "
            "(e.g. TensorDict(..., batch_size=[rows]))",
            path="<shard>",
            problems=[f"the shard has batch size {shape}"],
            keys=[()],
        )
    keys = [_norm_key(k) for k in replicated]
    if not keys:
        return obj, None, []
    if not isinstance(obj, TensorDictBase):
        raise UnsupportedContentError(
            f"replicated= names entries of a TensorDict; this rank saves a "
            f"{type(obj).__name__}. Drop replicated=.",
            path="<shard>",
            problems=["replicated entries of a non-TensorDict"],
            keys=[()],
        )
    rep = TensorDict(batch_size=[])
    for key in keys:
        where = ".".join(key)
        if key not in obj.keys(include_nested=True):
            raise UnsupportedContentError(
                f"{where}: named in replicated= but not in the TensorDict saved.",
                path=where,
                problems=[f"{where}: missing"],
                keys=[key],
            )
        rep.set(key, _unbatched(obj.get(key), where))
    return obj.exclude(*keys), rep, [list(k) for k in keys]


def _leaves(obj: Any) -> dict[Key, tuple[str, str, tuple[int, ...]]]:
    import torch
    from tensordict.base import _is_leaf_nontensor

    dims = len(obj.batch_size)
    out: dict[Key, tuple[str, str, tuple[int, ...]]] = {}
    for key, value in obj.items(True, True, is_leaf=_is_leaf_nontensor):
        k = key if isinstance(key, tuple) else (key,)
        if isinstance(value, torch.Tensor):
            out[k] = ("tensor", str(value.dtype), tuple(value.shape[dims:]))
        else:
            out[k] = (type(value).__name__, "", ())
    return out


# -- one rank's write ------------------------------------------------------------------------


def _file_record(path: Path, rel: str, algorithm: str) -> dict[str, Any]:
    from tdckpt._write.checksum import new_hasher

    data = path.read_bytes()
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return {"path": rel, "size": len(data), "checksum": f"{algorithm}:{hasher.hexdigest()}"}


def _write_prefix(
    obj: Any,
    staging: Path,
    rel: str,
    *,
    fsync: bool,
    checksum: str,
    incremental: IncrementalSave | None = None,
    layout: str = "memmap",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """Write ``obj`` at ``staging/rel``; its file and pickle records relative to staging,
    and the class it restores as (a top-level tensorclass in a consolidated file restores
    as its TensorDict, as ``TensorDict.from_consolidated`` gives it).

    ``layout="consolidated"``: ``staging/rel`` is a consolidated step of its own - one data
    file that ``TensorDict.from_consolidated`` loads, and its manifest of per-leaf offsets
    and checksums (:func:`~tdckpt._write.consolidated_write.write_consolidated`).
    """
    dest = staging / rel
    if layout == "consolidated":
        from tdckpt._write.consolidated_write import write_consolidated

        assert incremental is None  # refused by the manager (check_incremental)
        manifest = write_consolidated(obj, dest, fsync=fsync, checksum=checksum)
    else:
        manifest = write_checkpoint(
            obj, dest, fsync=fsync, checksum=checksum, incremental=incremental
        )
    if fsync:
        _atomic.fsync_dir(dest.parent)
    files = [{**f.model_dump(mode="json"), "path": f"{rel}/{f.path}"} for f in manifest.files]
    files.append(_file_record(dest / MANIFEST_NAME, f"{rel}/{MANIFEST_NAME}", checksum))
    pickles = [{**p.model_dump(mode="json"), "file": f"{rel}/{p.file}"} for p in manifest.pickles]
    return files, pickles, manifest.root_type


def _write_shard(
    group: ShardGroup,
    prepared: tuple[Any, Any, list[list[str]]] | BaseException,
    staging: Path,
    attempt: str,
    *,
    fsync: bool,
    checksum: str,
    incremental: dict[str, Any] | None = None,
    layout: str = "memmap",
) -> tuple[ShardResult, BaseException | None]:
    """Write this rank's shard (in ``layout``; rank 0's replicated entries always as a
    memmap folder: non-tensor data of any kind) and describe it for rank 0."""
    from tdckpt._write.save_plan import class_id

    result = ShardResult(rank=group.rank)
    try:
        if isinstance(prepared, BaseException):
            raise prepared
        shard, rep, rep_keys = prepared
        _fault("before_write")
        rel = f"{attempt}/shard-{group.rank}"
        shared = _shard_base(staging.parent, incremental, group.rank, checksum)
        files, pickles, root_type = _write_prefix(
            shard, staging, rel, fsync=fsync, checksum=checksum, incremental=shared, layout=layout
        )
        if group.rank == 0 and rep is not None:
            rep_rel = f"{attempt}/replicated"
            rfiles, rpickles, _ = _write_prefix(
                rep, staging, rep_rel, fsync=fsync, checksum=checksum
            )
            files += rfiles
            pickles += rpickles
            result.replicated_prefix = rep_rel
        result.rows = int(shard.batch_size[0])
        result.batch_tail = [int(d) for d in shard.batch_size[1:]]
        result.root_type = root_type if layout == "consolidated" else class_id(type(shard))
        result.prefix = rel
        result.files = files
        result.pickles = pickles
        result.leaves = _leaves(shard)
        result.replicated = rep_keys
        result.writer = writer_versions().model_dump(mode="json")
        result.structure = prefix_digest(staging / rel)  # as a restore will read it back
        return result, None
    except Exception as exc:  # reported to rank 0, so that every rank raises
        return ShardResult(rank=group.rank, error=(type(exc).__name__, str(exc))), exc


def _shard_base(
    root: Path, incremental: dict[str, Any] | None, rank: int, checksum: str
) -> IncrementalSave | None:
    """This rank's incremental save: against its shard of the latest step, when rank 0
    announced one (``{"step": N, "bases": {rank: shard folder relative to root}}``)."""
    if incremental is None:
        return None
    rel = incremental.get("bases", {}).get(str(rank))
    if rel is None:
        return IncrementalSave(base=None)
    path = root / rel
    try:
        manifest = Manifest.model_validate_json((path / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError):
        return IncrementalSave(base=None)  # unreadable: this shard is written in full
    return IncrementalSave(
        base=IncrementalBase.of_step(int(incremental["step"]), path, manifest, checksum)
    )


def shard_bases(steps: ShardSteps) -> dict[str, Any]:
    """Rank 0: the latest committed step's shard folders, for the ranks' incremental saves
    (a plain, not sharded, latest step is no base: every shard is written in full)."""
    records = steps.store.records()
    if not records:
        return {"step": None, "bases": {}}
    latest = records[max(records)]
    if not isinstance(latest.manifest, ShardedManifest):
        return {"step": latest.step, "bases": {}}
    name = Path(latest.where).name
    return {
        "step": latest.step,
        "bases": {str(shard.rank): f"{name}/{shard.prefix}" for shard in latest.manifest.shards},
    }


# -- the commit ------------------------------------------------------------------------------


def write_step_manifest(staging: Path, manifest: ShardedManifest, *, fsync: bool) -> None:
    """Write the step manifest into ``staging``: a temporary file, fsync, ``os.replace``."""
    data = manifest_bytes(step_document(manifest), str(staging / MANIFEST_NAME))
    tmp = staging / f".{MANIFEST_NAME}.{uuid.uuid4().hex}.tmp"
    write_small(tmp, data, fsync=fsync)
    os.replace(tmp, staging / MANIFEST_NAME)
    if fsync:
        _atomic.fsync_dir(staging)


# -- the protocol ----------------------------------------------------------------------------


def _refusal(results: list[ShardResult]) -> str | None:
    failed = [r for r in results if r.error is not None]
    if not failed:
        return None
    return "; ".join(f"rank {r.rank}: {r.error[0]}: {r.error[1]}" for r in failed if r.error)


def collective_save(
    steps: ShardSteps,
    step: int,
    obj: Any,
    *,
    metadata: dict[str, Any] | None,
    overwrite: bool,
    replicated: Iterable[Any],
    incremental: bool = False,
    refused: BaseException | None = None,
) -> Path:
    """Save this rank's shard ``obj`` as part of ``step`` (every rank calls it). See module.

    ``incremental``: rank 0 announces the latest step's shard folders with the attempt;
    each rank links its unchanged leaves from its own shard of that step. ``refused``:
    this rank's state or metadata was refused before the protocol (``save_async`` checks
    them on the caller's thread): the protocol runs, and every rank raises."""
    group = steps.group
    assert group is not None
    # Every rank saves the same step, or none writes anything (one all_gather).
    invalid: BaseException | None = None
    try:
        checked = _atomic.check_step(step)
    except (TypeError, ValueError) as exc:
        invalid = exc
    group.agree("save", step, invalid)
    step = checked
    prepared: tuple[Any, Any, list[list[str]]] | BaseException
    try:
        if refused is not None:
            raise refused
        if metadata is not None:
            check_json_data(metadata)
        prepared = split_shard(obj, replicated)
    except (TdckptError, TypeError, ValueError) as exc:
        prepared = exc
    if group.rank != 0:
        return _follow(steps, group, step, prepared)
    return _lead(steps, group, step, prepared, metadata or {}, overwrite, incremental)


def _follow(
    steps: ShardSteps,
    group: ShardGroup,
    step: int,
    prepared: tuple[Any, Any, list[list[str]]] | BaseException,
) -> Path:
    plan = group.broadcast(None, "announce the attempt")
    if "error" in plan:
        raise rank0_refusal(
            plan.get("kind", ""),
            f"rank 0 refused to save step {step}, so nothing was written: {plan['error']}",
            CollectiveError,
            rank=group.rank,
            phase="announce the attempt",
            step=step,
        )
    staging = steps.root / plan["staging"]
    result, own = _write_shard(
        group,
        prepared,
        staging,
        plan["attempt"],
        fsync=steps.fsync,
        checksum=steps.checksum,
        incremental=plan.get("incremental"),  # rank 0 decides, for every rank
        layout=steps.layout,
    )
    _fault("before_gather")
    group.gather(asdict(result), "gather shard records")
    outcome = group.broadcast(None, "broadcast the outcome")
    if outcome.get("error"):
        if own is not None:
            raise own
        raise CollectiveError(
            f"step {step} was not saved: {outcome['error']}",
            rank=group.rank,
            phase="commit",
            step=step,
        )
    return steps.root / _atomic.step_name(step)


def _lead(
    steps: ShardSteps,
    group: ShardGroup,
    step: int,
    prepared: tuple[Any, Any, list[list[str]]] | BaseException,
    metadata: dict[str, Any],
    overwrite: bool,
    incremental: bool = False,
) -> Path:
    announced = False
    own: BaseException | None = None
    try:
        with steps.turn(step, overwrite):
            begun = steps.store.begin(step, overwrite=overwrite)
            try:
                staging = Path(begun.where)
                attempt = f"attempt-{uuid.uuid4().hex}"
                (staging / attempt).mkdir()
                if steps.fsync:
                    _atomic.fsync_dir(staging)
                bases = shard_bases(steps) if incremental else None
                group.broadcast(
                    {"staging": staging.name, "attempt": attempt, "incremental": bases},
                    "announce the attempt",
                )
                announced = True
                result, own = _write_shard(
                    group,
                    prepared,
                    staging,
                    attempt,
                    fsync=steps.fsync,
                    checksum=steps.checksum,
                    incremental=bases,
                    layout=steps.layout,
                )
                _fault("before_gather")
                gathered = group.gather(asdict(result), "gather shard records")
                assert gathered is not None
                results = [_result(r) for r in gathered]
                refusal = _refusal(results)
                if refusal is not None:
                    if own is not None:
                        raise own
                    raise CollectiveError(
                        f"step {step} was not saved, nothing was committed: {refusal}",
                        rank=0,
                        phase="write shards",
                        step=step,
                    )
                manifest = build_manifest(
                    results,
                    step=step,
                    attempt=attempt,
                    user_metadata=metadata,
                    layout=steps.layout,
                )
                write_step_manifest(staging, manifest, fsync=steps.fsync)
                _fault("after_records")
            except BaseException:
                steps.store.abort(begun)
                raise
            # the warning of a stale form not removed <- commit <- _lead <- collective_save
            # <- the manager's save <- the user's line
            path = Path(steps.store.commit(begun, stacklevel=5))
    except BaseException as exc:
        if isinstance(exc, CollectiveError) and exc.facts.get("broken"):
            raise  # the group is broken: the others fail on their own collectives
        message = f"{type(exc).__name__}: {exc}"
        if not announced:  # rank 0's refusal: every rank raises its class
            group.broadcast({"error": message, "kind": type(exc).__name__}, "announce the attempt")
        else:
            group.broadcast({"error": f"rank 0: {message}"}, "broadcast the outcome")
        raise
    _fault("after_commit")
    group.broadcast({"error": None}, "broadcast the outcome")
    return path


def _result(raw: dict[str, Any]) -> ShardResult:
    raw = dict(raw)
    if raw.get("error") is not None:
        raw["error"] = tuple(raw["error"])
    return ShardResult(**raw)
