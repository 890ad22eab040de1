"""A step's files in memory, for upload: the local writer's plan, without a local copy.

:func:`encode_checkpoint` runs the same planner as :func:`tdckpt._write.save.write_checkpoint`
(:func:`tdckpt._write.save_plan.plan_checkpoint`: the same files, names and ``meta.json``
bytes, the same refusals) but, instead of writing files, returns each file as a list of
byte views - of the tensors themselves where they are contiguous CPU tensors (no copy),
of bounded copies otherwise. The checksums are computed while uploading
(:func:`tdckpt._remote.transfer.upload_encoded`), so the bytes are read once, as the local
writer reads them once while writing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from tdckpt._write.checksum import new_hasher
from tdckpt._write.save import (
    check_save_options,
    new_manifest,
    prepare_checkpoint,
)
from tdckpt._write.writer import as_bytes, pieces
from tdckpt.schema import (
    FileRecord,
    Manifest,
    StateRecord,
)

__all__ = ["Encoded", "EncodedFile", "encode_checkpoint"]


@dataclass
class EncodedFile:
    rel: str
    key: tuple[str, ...] | None
    parts: list[memoryview]
    size: int
    _sums: dict[str, str] = field(default_factory=dict, repr=False)

    def checksum(self, algorithm: str) -> str:
        """``"<algorithm>:<hex digest>"`` of the file's bytes (computed once)."""
        if algorithm not in self._sums:
            h = new_hasher(algorithm)
            for part in self.parts:
                h.update(part)  # zlib / hashlib release the GIL: files hash in parallel
            self._sums[algorithm] = f"{algorithm}:{h.hexdigest()}"
        return self._sums[algorithm]


@dataclass
class Encoded:
    """Everything a manifest needs but the checksums (known once uploaded)."""

    files: list[EncodedFile]
    step: int | None
    root_type: str
    pickles: list[Any]
    user_metadata: dict[str, Any]
    state: StateRecord | None = None
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())

    def manifest(self, checksums: dict[str, str]) -> Manifest:
        return new_manifest(
            self.created,
            step=self.step,
            root_type=self.root_type,
            pickles=self.pickles,
            files=sorted(
                (
                    FileRecord(
                        path=f.rel,
                        size=f.size,
                        checksum=checksums[f.rel],
                        key=list(f.key) if f.key is not None else None,
                    )
                    for f in self.files
                ),
                key=lambda r: r.path,
            ),
            user_metadata=self.user_metadata,
            state=self.state,
        )


def encode_checkpoint(
    obj: Any,
    where: str,
    *,
    step: int | None,
    user_metadata: dict[str, Any] | None,
    checksum: str,
    state: StateRecord | None = None,
) -> Encoded:
    """Plan ``obj`` as a step (the local writer's checks and refusals, naming ``where``)."""
    metadata = check_save_options(user_metadata, checksum)
    prepared = prepare_checkpoint(obj, where)  # the local writer's checks and refusals
    plan = prepared.plan
    files = []
    for op in plan.ops:
        if op.kind == "dir":
            continue  # an object store has no folders; every folder holds a meta.json
        if op.kind == "bytes":
            assert op.data is not None
            files.append(EncodedFile(op.rel, op.key, [memoryview(op.data)], len(op.data)))
        else:
            assert op.tensor is not None
            parts = [as_bytes(piece) for piece in pieces(op.tensor)]
            files.append(EncodedFile(op.rel, op.key, parts, sum(len(p) for p in parts)))
    return Encoded(
        files=files,
        step=step,
        root_type=prepared.root_type,
        pickles=plan.pickles,
        user_metadata=metadata,
        state=state,
    )
