"""Edit a saved training state's structure in place, as a hostile or damaged step would hold it.

The step's manifest is updated with the file's new size and checksum, so a restore sees a
step whose metadata is consistent and whose *values* are wrong: what a restore must refuse
on its own checks, not on a checksum.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tdckpt.schema import MANIFEST_NAME


def _checksum(data: bytes, algorithm: str) -> str:
    if algorithm == "crc32":
        return f"crc32:{zlib.crc32(data):08x}"
    return f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"


def rewrite(step: Path, rel: str, data: bytes) -> None:
    """Write ``data`` to ``step/rel`` and record its size and checksum in the manifest."""
    (step / rel).write_bytes(data)
    where = step / MANIFEST_NAME
    manifest = json.loads(where.read_text())
    for record in manifest["files"]:
        if record["path"] == rel:
            record["size"] = len(data)
            if record.get("checksum"):
                record["checksum"] = _checksum(data, record["checksum"].split(":")[0])
    where.write_text(json.dumps(manifest))


def structure(step: Path, entry: str) -> Any:
    """The tagged JSON structure of ``entry`` (what ``__state__/meta.json`` holds as data)."""
    return json.loads((step / entry / "__state__" / "meta.json").read_text())["data"]


def tamper(step: Path, entry: str, change: Callable[[Any], Any]) -> None:
    """Replace ``entry``'s structure by ``change(structure)`` (or the one it edited in place)."""
    rel = f"{entry}/__state__/meta.json"
    meta = json.loads((step / rel).read_text())
    new = change(meta["data"])
    if new is not None:
        meta["data"] = new
    rewrite(step, rel, json.dumps(meta).encode())


def pairs(node: Any) -> list[list[Any]]:
    """The ``[key, value]`` pairs of a tagged dict (``{"dict": [...]}``, ``{"odict": ...}``)."""
    ((_, body),) = node.items()
    return body  # type: ignore[no-any-return]


def item(node: Any, key: Any) -> Any:
    """The value under ``key`` of a tagged dict."""
    for k, v in pairs(node):
        if k == key:
            return v
    raise KeyError(key)


def set_item(node: Any, key: Any, value: Any) -> None:
    """Set ``key`` of a tagged dict to the (already tagged) ``value``."""
    for pair in pairs(node):
        if pair[0] == key:
            pair[1] = value
            return
    pairs(node).append([key, value])
