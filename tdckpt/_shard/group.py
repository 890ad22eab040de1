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

from tdckpt.errors import CollectiveError, TdckptError

__all__ = ["DEFAULT_TIMEOUT", "ShardGroup", "rank0_refusal", "resolve_group", "wants_group"]

#: Seconds a collective of the save or restore protocol waits for the other ranks (the
#: slowest rank's shard write happens inside one of them).
DEFAULT_TIMEOUT = 1800.0

#: Bytes of a pickled object that :meth:`ShardGroup.all_gather` sends in its one fixed-size
#: round (an agreement, an outcome, a digest); larger objects take a second round.
INLINE_BYTES = 2048


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
    closed: bool = False

    def _closed(self, phase: str) -> CollectiveError:
        return CollectiveError(
            f"rank {self.rank} of {self.size}: '{phase}' needs tdckpt's group of this "
            "collective CheckpointManager, which close() freed. Make a new CheckpointManager "
            "(on every rank) to save or restore again.",
            rank=self.rank,
            phase=phase,
        )

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

        if self.closed:
            raise self._closed(phase)
        box = [obj]
        try:
            dist.broadcast_object_list(box, group=self.pg, group_src=0)
        except Exception as exc:  # gloo raises RuntimeError / DistBackendError subclasses
            raise self._fail(phase, exc) from exc
        return box[0]

    def gather(self, obj: Any, phase: str) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); None elsewhere."""
        import torch.distributed as dist

        if self.closed:
            raise self._closed(phase)
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        try:
            dist.gather_object(obj, out, group=self.pg, group_dst=0)
        except Exception as exc:
            raise self._fail(phase, exc) from exc
        return out

    def all_gather(self, obj: Any, phase: str) -> list[Any]:
        """Every rank's ``obj`` on every rank (in rank order).

        One gloo all_gather of a fixed-size buffer carries each rank's pickled ``obj`` and
        its length, where torch's ``all_gather_object`` always takes two (the sizes, then
        the data): a restore's agreement and outcome are one round each. An object larger
        than :data:`INLINE_BYTES` pickled (a save's list of leaves) takes a second round,
        sized to the largest.
        """
        import pickle

        import numpy as np
        import torch
        import torch.distributed as dist

        if self.closed:
            raise self._closed(phase)
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        first = np.zeros(8 + INLINE_BYTES, dtype=np.uint8)
        first[:8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)
        inline = data[:INLINE_BYTES]
        first[8 : 8 + len(inline)] = np.frombuffer(inline, dtype=np.uint8)
        try:
            mine = torch.from_numpy(first)
            got = [torch.empty_like(mine) for _ in range(self.size)]
            dist.all_gather(got, mine, group=self.pg)
            rows = [g.numpy() for g in got]
            sizes = [int.from_bytes(row[:8].tobytes(), "little") for row in rows]
            longest = max(sizes)
            if longest <= INLINE_BYTES:
                blobs = [row[8 : 8 + n].tobytes() for row, n in zip(rows, sizes, strict=True)]
            else:
                whole = np.zeros(longest, dtype=np.uint8)
                whole[: len(data)] = np.frombuffer(data, dtype=np.uint8)
                mine = torch.from_numpy(whole)
                got = [torch.empty_like(mine) for _ in range(self.size)]
                dist.all_gather(got, mine, group=self.pg)
                blobs = [g.numpy()[:n].tobytes() for g, n in zip(got, sizes, strict=True)]
        except Exception as exc:
            raise self._fail(phase, exc) from exc
        return [pickle.loads(blob) for blob in blobs]

    def agree(
        self,
        operation: str,
        step: Any,
        error: BaseException | None = None,
        *,
        payload: Any = None,
    ) -> list[Any]:
        """Check that every rank called ``operation`` with ``step``, before anything else.

        One ``all_gather`` of ``(operation, step, this rank's error, payload)``. Ranks that
        called different operations or steps all raise the same :class:`CollectiveError`
        listing every rank's call; else a rank whose ``error`` is set raises it and the
        others a CollectiveError naming that rank. Either way, before anything is written
        or restored. Returns every rank's ``payload`` (rank order): what a caller would
        otherwise exchange in a collective of its own (rank 0's pick of the step, the
        targets' rows).
        """
        phase = "agree on the operation and step"
        shown: Any = repr(step)[:80]
        if isinstance(step, int) and not isinstance(step, bool):
            shown = step if abs(step) < 10**30 else f"<an int of {step.bit_length()} bits>"
        err = None if error is None else f"{type(error).__name__}: {error}"
        everyone = self.all_gather((operation, shown, err, payload), phase)
        calls = [(str(c[0]), c[1]) for c in everyone]
        if any(call != calls[0] for call in calls):
            listing = ", ".join(f"rank {r}: {op}(step={st})" for r, (op, st) in enumerate(calls))
            raise CollectiveError(
                f"the ranks of the group did not call the same operation on the same step, so "
                f"nothing was written or restored on any rank: {listing}. Every rank must call "
                "the same method of its collective CheckpointManager with the same step, in "
                "the same order.",
                rank=self.rank,
                phase=phase,
                calls=calls,
            )
        self.settle(operation, step, error, everyone=[c[2] for c in everyone])
        return [c[3] for c in everyone]

    def settle(
        self,
        operation: str,
        step: Any,
        error: BaseException | None,
        *,
        everyone: list[Any] | None = None,
        payload: Any = None,
    ) -> list[Any]:
        """Raise on every rank if any rank failed (its own error there), else return every
        rank's ``payload`` (rank order).

        ``everyone``: the ranks' error strings when already gathered (by :meth:`agree`;
        then no payload travels); else one ``all_gather`` of them, each with its rank's
        ``payload``. A restore calls it after reading and checking, before the first target
        is changed, so a rank's refusal leaves every rank's target untouched.
        """
        payloads: list[Any] = []
        if everyone is None:
            mine = None if error is None else f"{type(error).__name__}: {error}"
            gathered = self.all_gather((mine, payload), f"agree on the outcome of {operation}")
            everyone = [g[0] for g in gathered]
            payloads = [g[1] for g in gathered]
        if error is not None:
            raise error
        failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
        if failed:
            rank, message = failed[0]
            raise CollectiveError(
                f"rank {rank} failed {operation} of step {step}, so nothing was written or "
                f"restored on this rank (rank {self.rank}) either: {message}",
                rank=self.rank,
                phase=operation,
                failed=[r for r, _ in failed],
            )
        return payloads

    def destroy(self) -> None:
        """Free the gloo group (best effort: a broken group cannot be torn down cleanly).

        Every later collective of this group raises a CollectiveError saying so.
        """
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self.pg)


def wants_group(group: Any) -> bool:
    """Whether :func:`resolve_group` makes a group for ``group``, decided with no
    collective (alike on every rank): a manager refuses its arguments before making one.

    Raises:
        CollectiveError: ``group`` given while torch.distributed is not initialized.
    """
    if group is False:  # explicitly a single-process manager, even under torch.distributed
        return False
    try:
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
    except ImportError:  # pragma: no cover - torch without distributed support
        initialized = False
    if group is None and not initialized:
        return False
    if not initialized:
        raise CollectiveError(
            f"group={group!r} was given but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first, or pass group=None for a "
            "single-process manager.",
            rank=None,
            phase="init",
        )
    return True


def resolve_group(group: Any, timeout: float) -> ShardGroup | None:
    """The manager's ShardGroup: None unless torch.distributed is initialized or ``group``.

    ``group=False`` is never collective (e.g. a manager that rank 0 alone makes to list or
    read steps while the job runs).

    Collective over the ranks of ``group`` (default: every rank of the world): each must
    build its manager, in the same order relative to other group creations.

    Raises:
        CollectiveError: ``group`` given while torch.distributed is not initialized.
    """
    if not wants_group(group):
        return None
    import torch.distributed as dist

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


def rank0_refusal(kind: str, message: str, default: type[TdckptError], **facts: Any) -> TdckptError:
    """The error a rank raises when rank 0 refused a collective call with ``kind``.

    Rank 0 decides alone what concerns the shared root (the step exists, no such step, the
    lock is held); every rank then raises the same :mod:`tdckpt.errors` class, so a caller
    catches one class on every rank. ``default`` when ``kind`` is not a tdckpt error (an
    OSError, a broken group).
    """
    import tdckpt.errors as errors

    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, TdckptError)) or cls is CollectiveError:
        cls = default
    return cls(message, **facts)
