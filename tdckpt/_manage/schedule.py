"""The state behind :meth:`tdckpt.CheckpointManager.should_save`: policy, clock, preemption.

:class:`SaveSchedule` asks the manager's save policy (:mod:`tdckpt.save_policy`) with a
:class:`~tdckpt.save_policy.SaveContext`, remembers the manager's last save, and owns the
preemption signal handlers of a policy holding
:class:`~tdckpt.save_policy.SaveOnPreemption`:

* one handler per signal serves every manager of the process (:class:`_Dispatcher`): it
  only counts the signal for each open manager (nothing else is safe in a signal handler:
  the main thread may be anywhere, inside a save included) and then calls the handler that
  was installed before tdckpt's, if that was a Python callable;
* a signal is *pending* from its arrival until a save starts after it; ``should_save``
  returns True while one is pending;
* :meth:`SaveSchedule.uninstall` (the manager's ``close()``) stops counting; the last open
  manager puts the original handler back. Where that cannot be done (a ``close()`` off the
  main thread, or a handler installed over tdckpt's since), tdckpt's stays installed but
  acts as the original - for a default action, by restoring it and raising the signal
  again, so the process still ends. A forked child (a DataLoader worker) counts nothing:
  the signal acts on it as the original handler would.

In a group of ranks the answer is agreed: every rank's step, answer and pending flag are
gathered over a gloo group of the schedule's own (never the one a background save uses),
and every rank saves when any rank wants to - one rank's signal is enough.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from tdckpt.errors import CollectiveError
from tdckpt.save_policy import SaveContext, SavePolicy, preemption_signals

__all__ = ["SaveSchedule"]

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class SaveSchedule:
    """One manager's save policy, its clock, its last save and its preemption handlers."""

    def __init__(self, policy: SavePolicy | None, clock: Callable[[], float] | None) -> None:
        if policy is not None and not callable(getattr(policy, "should_save", None)):
            raise TypeError(
                f"save_policy must be a save policy (an object with should_save), got "
                f"{policy!r}; see tdckpt.save_policy."
            )
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        self.policy = policy
        self.clock: Callable[[], float] = time.monotonic if clock is None else clock
        self.signals = preemption_signals(policy)
        self._started: float | None = None
        self._baseline = False  # last_step initialised from the root
        self._last_step: int | None = None
        self._last_time: float | None = None
        self._received = 0  # signals counted by the handlers (only ever incremented)
        self._handled = 0  # the count when the last save started
        self._agreed = False  # another rank's signal, learnt in an agreement
        self.signal: int | None = None  # the last preemption signal received (number)
        self._installed: list[int] = []  # the signals this schedule counts
        self._active = False
        self._pg: Any = None
        self._rank = 0
        self._size = 1
        self._timeout = 0.0

    # -- preemption handlers ---------------------------------------------------------------
    def check_thread(self, where: str) -> None:
        """Refuse (ValueError) to install handlers off the main thread, before anything else."""
        if self.signals and threading.current_thread() is not threading.main_thread():
            raise ValueError(
                f"{where}: a save policy with SaveOnPreemption installs signal handlers, which "
                "Python allows only on the main thread; make this manager on the main thread "
                "(or drop SaveOnPreemption from its save_policy)."
            )

    def install(self, where: str) -> None:
        """Count the policy's signals from now on (main thread only)."""
        self.check_thread(where)
        if not self.signals:
            return
        self._active = True
        for sig in self.signals:
            _dispatcher(sig).schedules.append(self)
            self._installed.append(sig)

    def count(self, signum: int) -> None:
        """A preemption signal arrived (called in the signal handler: counting only)."""
        if self._active:
            self._received += 1
            self.signal = signum

    def uninstall(self) -> None:
        """Stop counting signals; the last open manager puts the original handlers back."""
        self._active = False
        for sig in self._installed:
            found = _DISPATCHERS.get(sig)
            if found is None:
                continue
            found.schedules[:] = [s for s in found.schedules if s is not self]
            if not found.schedules:
                found.release()
        self._installed = []

    # -- collective agreement --------------------------------------------------------------
    def join_group(self, shard_pg: Any, timeout: float) -> None:
        """Agree with the ranks of ``shard_pg`` over a new gloo group (collective)."""
        import torch.distributed as dist

        delta = datetime.timedelta(seconds=float(timeout))
        ranks = dist.get_process_group_ranks(shard_pg)
        if len(ranks) == dist.get_world_size():
            pg = dist.new_group(backend="gloo", timeout=delta)
        else:
            pg = dist.new_group(
                ranks=ranks, backend="gloo", timeout=delta, use_local_synchronization=True
            )
        self._pg = pg
        self._rank = dist.get_rank(pg)
        self._size = dist.get_world_size(pg)
        self._timeout = timeout

    def _agree(self, step: int, answer: bool, pending: bool, what: str) -> tuple[bool, bool]:
        if self._pg is None:
            return answer, pending
        import torch.distributed as dist

        out: list[Any] = [None] * self._size
        try:
            dist.all_gather_object(out, (step, answer, pending), group=self._pg)
        except Exception as exc:
            raise CollectiveError(
                f"rank {self._rank} of {self._size}: the collective '{what}' failed "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
                f"Every rank must call {what} for the same steps, within {self._timeout:g} s "
                "of each other; another rank may have died. Restart the job from the last "
                "committed step.",
                rank=self._rank,
                phase=what,
                broken=True,
            ) from exc
        steps = sorted({entry[0] for entry in out})
        if len(steps) > 1:
            raise CollectiveError(
                f"rank {self._rank} of {self._size}: {what} was called for different steps "
                f"on different ranks ({', '.join(f'rank {r}: {e[0]}' for r, e in enumerate(out))}"
                "); every rank must ask about the same step, in the same order.",
                rank=self._rank,
                phase=what,
            )
        return any(entry[1] for entry in out), any(entry[2] for entry in out)

    # -- the questions ---------------------------------------------------------------------
    @property
    def preempted(self) -> bool:
        """A preemption signal arrived here (or, as agreed, on another rank)."""
        return self._received > 0 or self._agreed

    def pending(self) -> bool:
        """A signal arrived and no save started since."""
        return self._received > self._handled

    def _begin(self, latest: Callable[[], int | None]) -> float:
        now = self.clock()
        if self._started is None:
            self._started = now
        if not self._baseline:
            self._baseline = True
            if self._last_step is None:
                self._last_step = latest()
        return now

    def decide(self, step: int, latest: Callable[[], int | None]) -> bool:
        """The answer of ``should_save(step)`` (agreed between ranks in a group)."""
        now = self._begin(latest)
        pending = self.pending()
        answer = False
        if self.policy is not None and step != self._last_step:
            assert self._started is not None
            context = SaveContext(
                step=step,
                now=now,
                started=self._started,
                last_step=self._last_step,
                last_time=self._last_time,
                preempted=pending,
            )
            answer = bool(self.policy.should_save(context))
        answer, anyone = self._agree(step, answer, pending, "should_save")
        if anyone and not pending:
            self._agreed = True
        return answer

    def preemption_due(self, step: int, latest: Callable[[], int | None]) -> bool:
        """The answer of ``save_if_preempted(step, ...)`` (agreed between ranks in a group)."""
        self._begin(latest)
        pending = self.pending()
        _, anyone = self._agree(step, pending, pending, "save_if_preempted")
        if anyone and not pending:
            self._agreed = True
        return anyone and step != self._last_step

    def save_started(self) -> int:
        """Call when a save starts: the signal count it answers (for :meth:`saved`)."""
        return self._received

    def saved(self, step: int, answered: int) -> None:
        """A save of ``step`` went through (committed, or staged by ``save_async``)."""
        self._last_step = step
        self._last_time = self.clock()
        self._baseline = True
        self._handled = max(self._handled, answered)


class _Dispatcher:
    """The one handler of a signal for every manager of this process: it counts the signal
    for each open one (:attr:`schedules`), then calls the handler installed before it if
    that is a Python callable. With no manager open (closed off the main thread, or a
    handler installed over it since), or in a forked child, it acts as that handler would:
    for the default action, by restoring it and raising the signal again."""

    def __init__(self, sig: int, original: _Handler) -> None:
        self.sig = sig
        self.original = original
        self.pid = os.getpid()
        self.schedules: list[SaveSchedule] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:  # a forked child: as if tdckpt were not there
            self._as_original(signum, frame)
            return
        for schedule in list(self.schedules):
            schedule.count(signum)
        current = _DISPATCHERS.get(self.sig)
        if self.schedules or (current is not None and current is not self):
            # counted (or superseded by a newer dispatcher, which decides): pass it on
            if callable(self.original):
                self.original(signum, frame)
            return
        self._as_original(signum, frame)

    def _as_original(self, signum: int, frame: FrameType | None) -> None:
        if callable(self.original):
            self.original(signum, frame)
        elif self.original in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        # SIG_IGN: ignored, as before tdckpt

    def release(self) -> None:
        """Put the original handler back (on the main thread, while this one is in place)."""
        if threading.current_thread() is not threading.main_thread():
            return  # stays installed, acting as the original
        sig, original = self.sig, self.original
        if signal.getsignal(sig) is self:
            signal.signal(sig, signal.SIG_DFL if original is None else original)
        if _DISPATCHERS.get(sig) is self:
            del _DISPATCHERS[sig]


#: The dispatcher of each signal some open manager counts (this process's).
_DISPATCHERS: dict[int, _Dispatcher] = {}


def _dispatcher(sig: int) -> _Dispatcher:
    """The dispatcher of ``sig`` in this process, installed as its handler if it is not yet
    (main thread: the caller checked)."""
    found = _DISPATCHERS.get(sig)
    current = signal.getsignal(sig)
    if found is not None and found.pid == os.getpid() and id(current) == id(found):
        return found  # (id: mypy would narrow ``found`` to the handler's type)
    if isinstance(current, _Dispatcher):  # inherited through fork: its original is ours
        current = current.original
    dispatcher = _DISPATCHERS[sig] = _Dispatcher(sig, current)
    if found is not None and found.pid == os.getpid():
        # replaced since (another library set its handler, which now runs after ours):
        # the managers still open keep counting
        dispatcher.schedules = found.schedules
        found.schedules = []
    signal.signal(sig, dispatcher)
    return dispatcher
