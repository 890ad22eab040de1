"""What the shard layer needs of the steps of a root, and nothing more.

The sharded save and restore (:mod:`tdckpt._shard.save`, :mod:`tdckpt._shard.restore`) drive
the step protocol of :mod:`tdckpt._store` - rank 0 begins an attempt and commits it, every
rank writes its part - and never the manager: the manager hands them a :class:`ShardSteps`
(its group, its store, and the few policy hooks a collective needs), so this layer never
imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tdckpt._shard.group import ShardGroup
from tdckpt._store.base import StepStore
from tdckpt.schema import Manifest

__all__ = ["ShardSteps"]


@dataclass(frozen=True)
class ShardSteps:
    """The steps of one root as a collective save or restore sees them.

    Attributes:
        group: the ranks saving and restoring together (None: one process).
        store: the root's step store (rank 0 begins and commits attempts in it).
        fsync: make every write durable before it is committed.
        checksum: the checksum algorithm of new files.
        resolve: the committed step (None: the latest) as ``(step, where, manifest)``.
        using: :func:`resolve`, the step kept from retention while the block runs.
        verified: raise IntegrityError unless the step passes verification.
        turn: rank 0's exclusive turn to write ``step`` (``turn(step, overwrite)``): the
            root's writer lock taken, the step claimed (refused if it exists without
            ``overwrite``, or is being restored), released when the block ends.
        layout: how each rank writes its shard: ``"memmap"`` (a file per leaf) or
            ``"consolidated"`` (one data file per shard).
    """

    group: ShardGroup | None
    store: StepStore
    fsync: bool
    checksum: str
    resolve: Callable[[int | None], tuple[int, Path | str, Manifest]]
    using: Callable[[int | None], contextlib.AbstractContextManager[tuple[int, Path, Manifest]]]
    verified: Callable[[int, Path | str, Manifest], None]
    turn: Callable[[int, bool], contextlib.AbstractContextManager[Any]]
    layout: str = "memmap"

    @property
    def root(self) -> Path:
        """The root folder (sharded steps live on a shared file system)."""
        return Path(self.store.root)
