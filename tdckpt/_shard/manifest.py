"""Reading a step manifest that may be sharded, and building one from the shard records.

A step folder's ``tdckpt.manifest.json`` is either a plain :class:`~tdckpt.schema.Manifest`
(one prefix, one process) or a :class:`~tdckpt.schema.ShardedManifest` (one shard prefix per
rank inside an attempt folder). :func:`parse_step_manifest` tells them apart without
parsing a plain manifest twice; :func:`build_manifest` is rank 0's coverage check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pydantic_core import from_json

from tdckpt.errors import MetadataError
from tdckpt.schema import (
    FORMAT_VERSION,
    MANIFEST_SCHEMA_VERSION,
    FileRecord,
    Manifest,
    PickleRecord,
    ReplicatedRecord,
    ShardedManifest,
    ShardRecord,
    WriterVersions,
)

__all__ = ["ShardResult", "build_manifest", "parse_step_manifest"]


def parse_step_manifest(data: bytes) -> Manifest:
    """A step manifest from its bytes: a ShardedManifest when it says ``"sharded"``.

    Raises pydantic's ValidationError (a ValueError) on an invalid document.
    """
    if b'"sharded"' not in data:  # the fast path of every plain step
        return Manifest.model_validate_json(data)
    raw = from_json(data)
    if isinstance(raw, dict) and "sharded" in raw:
        return ShardedManifest.model_validate(raw)
    return Manifest.model_validate(raw)


@dataclass
class ShardResult:
    """What one rank reports to rank 0 after writing its shard (sent by gather_object).

    ``error`` is ``(class name, message)`` when the rank failed; everything else is then
    unset. ``leaves`` maps each leaf key to ``(kind, dtype, shape after the batch dims)``,
    which must agree on every rank.
    """

    rank: int
    error: tuple[str, str] | None = None
    rows: int = 0
    batch_tail: list[int] = field(default_factory=list)
    root_type: str = ""
    prefix: str = ""
    files: list[dict[str, Any]] = field(default_factory=list)
    pickles: list[dict[str, Any]] = field(default_factory=list)
    leaves: dict[tuple[str, ...], tuple[str, str, tuple[int, ...]]] = field(default_factory=dict)
    replicated: list[list[str]] = field(default_factory=list)
    replicated_prefix: str | None = None
    writer: dict[str, Any] = field(default_factory=dict)


class CoverageError(MetadataError):
    """The shards do not form one global TensorDict (rank 0's check before the commit)."""


def build_manifest(
    results: list[ShardResult],
    *,
    step: int,
    attempt: str,
    user_metadata: dict[str, Any],
) -> ShardedManifest:
    """Check that the shards cover the global rows once, with one structure; make the manifest.

    Raises:
        CoverageError: naming the rank and the key that disagree.
    """
    first = results[0]
    problems: list[str] = []
    for res in results[1:]:
        if res.root_type != first.root_type:
            problems.append(f"rank {res.rank} saved a {res.root_type}, rank 0 a {first.root_type}")
        if res.batch_tail != first.batch_tail:
            problems.append(
                f"rank {res.rank}'s batch size is [{res.rows}, "
                f"{', '.join(map(str, res.batch_tail))}] and rank 0's "
                f"[{first.rows}, {', '.join(map(str, first.batch_tail))}]: the dims after "
                "dim 0 must agree"
            )
        if res.replicated != first.replicated:
            problems.append(
                f"rank {res.rank} names replicated={res.replicated}, rank 0 {first.replicated}"
            )
        missing = sorted(set(first.leaves) - set(res.leaves))
        extra = sorted(set(res.leaves) - set(first.leaves))
        for key in missing:
            problems.append(
                f"the key {'.'.join(key)!r} is on rank 0 but not on rank {res.rank}: its rows "
                f"{_rows(results, res.rank)} would be missing"
            )
        for key in extra:
            problems.append(f"the key {'.'.join(key)!r} is on rank {res.rank} but not on rank 0")
        for key in sorted(set(first.leaves) & set(res.leaves)):
            if res.leaves[key] != first.leaves[key]:
                problems.append(
                    f"the key {'.'.join(key)!r} is {_leaf(res.leaves[key])} on rank {res.rank} "
                    f"and {_leaf(first.leaves[key])} on rank 0"
                )
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CoverageError(
            f"step {step}: the ranks' shards do not form one TensorDict split along dim 0, so "
            f"nothing was committed:\n  {shown}{more}\nEvery rank must save the same keys, "
            "dtypes and trailing shapes; only the number of rows may differ.",
            step=step,
            problems=problems,
        )
    files: list[FileRecord] = []
    pickles: list[PickleRecord] = []
    shards: list[ShardRecord] = []
    row = 0
    for res in results:
        files += [FileRecord.model_validate(f) for f in res.files]
        pickles += [PickleRecord.model_validate(p) for p in res.pickles]
        shards.append(
            ShardRecord(
                rank=res.rank,
                prefix=res.prefix,
                start=row,
                stop=row + res.rows,
                root_type=res.root_type,
            )
        )
        row += res.rows
    replicated = None
    if first.replicated_prefix is not None:
        replicated = ReplicatedRecord(prefix=first.replicated_prefix, keys=first.replicated)
    return ShardedManifest(
        schema_version=MANIFEST_SCHEMA_VERSION,
        format_version=FORMAT_VERSION,
        created=datetime.now(timezone.utc).isoformat(),
        writer=WriterVersions.model_validate(first.writer),
        key_encoding="robust",
        step=step,
        root_type=first.root_type,
        pickles=pickles,
        files=sorted(files, key=lambda r: r.path),
        user_metadata=user_metadata,
        sharded=1,
        world_size=len(results),
        attempt=attempt,
        batch_size=[row, *first.batch_tail],
        shards=shards,
        replicated=replicated,
    )


def _rows(results: list[ShardResult], rank: int) -> str:
    start = sum(r.rows for r in results[:rank])
    return f"{start}..{start + results[rank].rows}"


def _leaf(info: tuple[str, str, tuple[int, ...]]) -> str:
    kind, dtype, shape = info
    return f"a {kind} of {dtype} {list(shape)}" if kind == "tensor" else f"a {kind}"
