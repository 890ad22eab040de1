"""Sharded steps written in this process, for tests that tamper with them.

:func:`write_sharded` runs tdckpt's own shard writer (``_write_shard``, one call per rank,
real files) and rank 0's manifest builder, without a gloo group: the step is what a
collective save of those shards commits. ``lie=True`` skips the coverage check (each rank
reports shard 0's keys), to make a step whose shards disagree as a buggy or hostile writer
would. :func:`edit_manifest` rewrites the step manifest and, unless told otherwise, seals
it again (a manifest that is consistent with its checksum but lies about its shards).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tdckpt._shard.group import ShardGroup
from tdckpt._shard.manifest import build_manifest, manifest_digest
from tdckpt._shard.save import _write_shard, split_shard, write_step_manifest
from tdckpt.schema import MANIFEST_NAME


def write_sharded(
    root: Path,
    step: int,
    shards: Sequence[Any],
    *,
    replicated: Sequence[Any] = (),
    metadata: dict[str, Any] | None = None,
    lie: bool = False,
    layout: str = "memmap",
) -> Path:
    """Commit ``shards`` (rank order) as the sharded ``step`` of ``root``; its folder."""
    root.mkdir(parents=True, exist_ok=True)
    folder = root / str(step)
    folder.mkdir()
    attempt = f"attempt-{uuid.uuid4().hex}"
    (folder / attempt).mkdir()
    results = []
    for rank, obj in enumerate(shards):
        group = ShardGroup(pg=None, rank=rank, size=len(shards), timeout=1.0)
        prepared = split_shard(obj, replicated)
        result, err = _write_shard(
            group, prepared, folder, attempt, fsync=False, checksum="crc32", layout=layout
        )
        assert err is None, err
        results.append(result)
    if lie:
        for result in results[1:]:
            result.leaves = results[0].leaves
            result.batch_tail = results[0].batch_tail
            result.structure = results[0].structure
    manifest = build_manifest(
        results, step=step, attempt=attempt, user_metadata=metadata or {}, layout=layout
    )
    write_step_manifest(folder, manifest, fsync=False)
    return folder


def edit_manifest(
    folder: Path, edit: Callable[[dict[str, Any]], None], *, seal: bool = True
) -> dict[str, Any]:
    """Apply ``edit`` to the step manifest's JSON; seal it again unless ``seal`` is False."""
    path = folder / MANIFEST_NAME
    doc = json.loads(path.read_text())
    edit(doc)
    if seal and "manifest_checksum" in doc:
        doc["manifest_checksum"] = manifest_digest(doc)
    path.write_text(json.dumps(doc, indent=1))
    return doc
