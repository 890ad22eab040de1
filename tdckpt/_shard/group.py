"""tdckpt's own gloo process group, and the three collectives the sharded protocol uses.

A collective :class:`~tdckpt.manager.CheckpointManager` makes one gloo group of its own
(``dist.new_group(backend="gloo", timeout=...)``) over the ranks of the group it is given
(default: the whole world). Coordination never runs on the training's group (NCCL or gloo),
so tdckpt's collectives neither need a device nor race the training's collectives; a
background saver (``save_async``) uses the same group from its one thread.

Every collective here turns what torch.distributed raises when a peer is dead or slow (a
gloo "connection reset", a timeout) into a :class:`~tdckpt.errors.CollectiveError` naming
the phase, so a surviving rank always gets a TdckptError, never a hang past the timeout.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Any

from tdckpt.errors import CollectiveError

__all__ = ["DEFAULT_TIMEOUT", "ShardGroup", "resolve_group"]

#: Seconds a collective of the save or restore protocol waits for the other ranks (the
#: slowest rank's shard write happens inside one of them).
DEFAULT_TIMEOUT = 1800.0


@dataclass
class ShardGroup:
    """The tdckpt-owned gloo group of a collective manager.

    Attributes:
        pg: the gloo ``ProcessGroup`` (also for ``save_async``'s background collectives).
        rank: this process's rank in ``pg``.
        size: the number of ranks in ``pg``.
        timeout: seconds every collective waits.
    """

    pg: Any
    rank: int
    size: int
    timeout: float

    def _fail(self, phase: str, exc: BaseException) -> CollectiveError:
        return CollectiveError(
            f"rank {self.rank} of {self.size}: the collective '{phase}' failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
            "Another rank died, raised outside tdckpt or did not call the same method "
            f"within {self.timeout:g} s. Nothing was committed by this call unless "
            "steps() lists the step; this group cannot be used again: restart the job "
            "(earlier steps are intact).",
            rank=self.rank,
            phase=phase,
            broken=True,
        )

    def broadcast(self, obj: Any, phase: str) -> Any:
        """Rank 0's ``obj`` on every rank."""
        import torch.distributed as dist

        box = [obj]
        try:
            dist.broadcast_object_list(box, group=self.pg, group_src=0)
        except Exception as exc:  # gloo raises RuntimeError / DistBackendError subclasses
            raise self._fail(phase, exc) from exc
        return box[0]

    def gather(self, obj: Any, phase: str) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); None elsewhere."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        try:
            dist.gather_object(obj, out, group=self.pg, group_dst=0)
        except Exception as exc:
            raise self._fail(phase, exc) from exc
        return out

    def all_gather(self, obj: Any, phase: str) -> list[Any]:
        """Every rank's ``obj`` on every rank (in rank order)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self.pg)
        except Exception as exc:
            raise self._fail(phase, exc) from exc
        return out

    def destroy(self) -> None:
        """Free the gloo group (collective on its ranks in torch; best effort here)."""
        import torch.distributed as dist

        with contextlib.suppress(Exception):  # a broken group cannot be torn down cleanly
            dist.destroy_process_group(self.pg)


def resolve_group(group: Any, timeout: float) -> ShardGroup | None:
    """The manager's ShardGroup: None unless torch.distributed is initialized or ``group``.

    ``group=False`` is never collective (e.g. a manager that rank 0 alone makes to list or
    read steps while the job runs).

    Collective over the ranks of ``group`` (default: every rank of the world): each must
    build its manager, in the same order relative to other group creations.

    Raises:
        CollectiveError: ``group`` given while torch.distributed is not initialized.
    """
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed support
        dist = None  # type: ignore[assignment]
    if group is False:  # explicitly a single-process manager, even under torch.distributed
        return None
    initialized = dist is not None and dist.is_available() and dist.is_initialized()
    if group is None and not initialized:
        return None
    if not initialized:
        raise CollectiveError(
            f"group={group!r} was given but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first, or pass group=None for a "
            "single-process manager.",
            rank=None,
            phase="init",
        )
    if not (isinstance(timeout, (int, float)) and 0 < timeout < 10**7):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    delta = datetime.timedelta(seconds=float(timeout))
    if group is None or group is dist.group.WORLD:
        pg = dist.new_group(backend="gloo", timeout=delta)
    else:
        ranks = dist.get_process_group_ranks(group)
        pg = dist.new_group(
            ranks=ranks, backend="gloo", timeout=delta, use_local_synchronization=True
        )
    return ShardGroup(pg=pg, rank=dist.get_rank(pg), size=dist.get_world_size(pg), timeout=timeout)
