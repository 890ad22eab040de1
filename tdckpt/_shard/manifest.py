"""Reading a step manifest that may be sharded, and building one from the shard records.

A step folder's ``tdckpt.manifest.json`` is either a plain :class:`~tdckpt.schema.Manifest`
(one prefix, one process) or a :class:`~tdckpt.schema.ShardedManifest` (one shard prefix per
rank inside an attempt folder). :func:`parse_step_manifest` tells them apart without
parsing a plain manifest twice; :func:`build_manifest` is rank 0's coverage check.
"""

from __future__ import annotations

import json
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

__all__ = [
    "MANIFEST_CHECKSUM",
    "ShardResult",
    "build_manifest",
    "manifest_digest",
    "parse_step_manifest",
    "seal",
    "step_document",
]

#: The algorithm of a sharded step manifest's own checksum (``manifest_checksum``).
MANIFEST_CHECKSUM = "sha256"
_FIELD = "manifest_checksum"


def manifest_digest(doc: dict[str, Any], algorithm: str = MANIFEST_CHECKSUM) -> str:
    """``"<algorithm>:<hex>"`` of the JSON document ``doc`` without its ``manifest_checksum``.

    Computed over canonical JSON (keys sorted, no spaces, ASCII), so it covers what the
    document says, not how it is spaced: the writer's dict and the reader's parsed bytes
    give the same digest.

    >>> manifest_digest({"a": 1, "manifest_checksum": "x"}) == manifest_digest({"a": 1})
    True
    """
    from tdckpt._write.checksum import new_hasher

    body = {k: v for k, v in doc.items() if k != _FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    hasher = new_hasher(algorithm)
    hasher.update(text.encode("ascii"))
    return f"{algorithm}:{hasher.hexdigest()}"


def step_document(manifest: ShardedManifest) -> dict[str, Any]:
    """The JSON document of ``manifest`` as it is written (and sealed).

    ``layout`` is written only when it is not the default ``"memmap"``: a memmap step's
    manifest stays the document that tdckpt releases before the field could read.
    """
    doc = manifest.model_dump(mode="json")
    if doc.get("layout") == "memmap":
        del doc["layout"]
    return doc


def seal(manifest: ShardedManifest) -> ShardedManifest:
    """``manifest`` with its ``manifest_checksum`` recorded (what the writer commits)."""
    return manifest.model_copy(update={_FIELD: manifest_digest(step_document(manifest))})


def parse_step_manifest(data: bytes) -> Manifest:
    """A step manifest from its bytes: a ShardedManifest when it says ``"sharded"``.

    A sharded manifest's ``manifest_checksum``, when recorded, must match the document
    (an edited or damaged step manifest is invalid, as a changed file fails ``verify``);
    one written before the checksum was recorded is read unchecked, and its restore
    still checks it against its shards (:mod:`tdckpt._shard.check`).

    Raises pydantic's ValidationError (a ValueError) on an invalid document, ValueError on
    a checksum that does not match.
    """
    if b'"sharded"' not in data:  # the fast path of every plain step
        return Manifest.model_validate_json(data)
    raw = from_json(data)
    if isinstance(raw, dict) and "sharded" in raw:
        manifest = ShardedManifest.model_validate(raw)
        recorded = raw.get(_FIELD)
        if recorded is not None:
            algorithm = str(recorded).split(":", 1)[0]
            found = manifest_digest(raw, algorithm)
            if found != recorded:
                raise ValueError(
                    f"its manifest_checksum is {recorded} but the document's is {found}: the "
                    "step manifest was changed after it was written"
                )
        return manifest
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
    #: the digest of the shard's structure as a restore reads it back (all but its rows)
    structure: str = ""


class CoverageError(MetadataError):
    """The shards do not form one global TensorDict (rank 0's check before the commit)."""


def build_manifest(
    results: list[ShardResult],
    *,
    step: int,
    attempt: str,
    user_metadata: dict[str, Any],
    layout: str = "memmap",
) -> ShardedManifest:
    """Check that the shards cover the global rows once, with one structure; make the manifest
    (``layout``: how the shards were saved, recorded in it).

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
    if not problems:
        for res in results[1:]:
            if res.structure != first.structure:
                problems.append(
                    f"rank {res.rank}'s shard reads back with other keys than rank 0's (a "
                    "lazy stack along dim 0 saves its members by index: every rank must then "
                    "hold as many of its rows)"
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
    manifest = ShardedManifest(
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
        layout=layout,
    )
    return seal(manifest)


def _rows(results: list[ShardResult], rank: int) -> str:
    start = sum(r.rows for r in results[:rank])
    return f"{start}..{start + results[rank].rows}"


def _leaf(info: tuple[str, str, tuple[int, ...]]) -> str:
    kind, dtype, shape = info
    return f"a {kind} of {dtype} {list(shape)}" if kind == "tensor" else f"a {kind}"
