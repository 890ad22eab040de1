"""``tdckpt inspect`` of a sharded step folder: the step manifest's shards, without data."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from tdckpt.schema import MANIFEST_NAME, MAX_MANIFEST_BYTES, ShardedManifest

__all__ = ["describe_sharded", "shard_summary"]

#: Step manifests larger than this are not inspected here (the step index caps them too).
_MAX_BYTES = MAX_MANIFEST_BYTES


def describe_sharded(prefix: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The shards of the sharded step at ``prefix`` as JSON data, or None if it is not one.

    Raises:
        MetadataError: a step manifest that says "sharded" but is invalid.
    """
    from tdckpt._shard.manifest import parse_step_manifest
    from tdckpt.errors import MetadataError

    where = Path(prefix) / MANIFEST_NAME
    try:
        st = os.stat(where, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_BYTES:
        return None
    data = where.read_bytes()
    if b'"sharded"' not in data:
        return None
    try:
        manifest = parse_step_manifest(data)
    except ValueError as exc:
        raise MetadataError(
            f"{where}: the step manifest is invalid ({str(exc).splitlines()[0]}).",
            path=str(where),
        ) from exc
    if not isinstance(manifest, ShardedManifest):
        return None
    shards = []
    for shard in manifest.shards:
        files = [f for f in manifest.files if f.path.startswith(shard.prefix + "/")]
        shards.append(
            {
                "rank": shard.rank,
                "prefix": shard.prefix,
                "rows": [shard.start, shard.stop],
                "files": len(files),
                "bytes": sum(f.size for f in files),
                "root_type": shard.root_type,
            }
        )
    return {
        "step_folder": str(prefix),
        "step": manifest.step,
        "world_size": manifest.world_size,
        "layout": manifest.layout,
        "batch_size": list(manifest.batch_size),
        "root_type": manifest.root_type,
        "attempt": manifest.attempt,
        "created": manifest.created,
        "bytes": sum(f.size for f in manifest.files),
        "shards": shards,
        "replicated": None
        if manifest.replicated is None
        else {"prefix": manifest.replicated.prefix, "keys": manifest.replicated.keys},
        "metadata": manifest.user_metadata,
    }


def shard_summary(manifest: ShardedManifest) -> str:
    """One line for ``tdckpt ls``: ranks and the rows each shard holds."""
    rows = ", ".join(f"{s.start}..{s.stop}" for s in manifest.shards[:8])
    more = f", ... ({manifest.world_size - 8} more)" if manifest.world_size > 8 else ""
    return f"{manifest.world_size} shards, rows {rows}{more}; batch size {manifest.batch_size}"
