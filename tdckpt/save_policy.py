"""Save policies: when :meth:`~tdckpt.CheckpointManager.should_save` says "save this step".

A policy is any object with ``should_save(context) -> bool`` (the :class:`SavePolicy`
protocol); the manager asks it with a :class:`SaveContext` - the step, the time on the
manager's clock, the last step saved and when, and whether a preemption signal is pending.
Policies compose with :class:`SaveAnyOf` or ``|`` (save when any of them says so)::

    from tdckpt.save_policy import SaveEvery, SaveEverySeconds, SaveFirst, SaveOnPreemption
    policy = SaveEvery(1000) | SaveEverySeconds(1800) | SaveFirst() | SaveOnPreemption()
    mgr = CheckpointManager("runs/exp1", save_policy=policy)
    for step in range(start, end):
        train_one_step()
        if mgr.should_save(step):
            mgr.save_async(step, state)
        if mgr.preempted:
            break

The manager never says yes twice for one step (the step it saved last, or the newest
committed step when the loop began), and in a group of ranks every rank gets the same
answer (see :meth:`~tdckpt.CheckpointManager.should_save`).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tdckpt.retention import _positive_int, _union_of

__all__ = [
    "SaveAnyOf",
    "SaveAtSteps",
    "SaveContext",
    "SaveEvery",
    "SaveEverySeconds",
    "SaveFirst",
    "SaveOnPreemption",
    "SavePolicy",
]


@dataclass(frozen=True)
class SaveContext:
    """What a save policy knows when :meth:`~tdckpt.CheckpointManager.should_save` asks.

    Times are seconds on the manager's clock (``CheckpointManager(clock=...)``, default
    :func:`time.monotonic`): compare them with each other, never with wall-clock dates.

    Attributes:
        step: the step asked about.
        now: the time of the question.
        started: the time of the manager's first ``should_save`` call (training began).
        last_step: the last step this manager saved, or else the newest step committed in
            the root when the loop began; None when there is none.
        last_time: when this manager last saved (``save``/``save_async`` called); None
            before its first save.
        preempted: a preemption signal arrived and no save was made since.
    """

    step: int
    now: float
    started: float
    last_step: int | None = None
    last_time: float | None = None
    preempted: bool = False


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether a step is saved."""

    def should_save(self, context: SaveContext) -> bool:
        """Return True to save ``context.step``."""
        ...


class _Composable:
    """``policy_a | policy_b`` saves when either says so."""

    def __or__(self, other: SavePolicy) -> SaveAnyOf:
        return SaveAnyOf(self, other)  # type: ignore[arg-type]


class SaveEvery(_Composable):
    """Save the steps divisible by ``n`` (step 0 included).

    Deterministic: a resumed run saves the same steps as an uninterrupted one.

    >>> [s for s in range(1, 8) if SaveEvery(3).should_save(SaveContext(s, 0.0, 0.0))]
    [3, 6]
    """

    def __init__(self, n: int) -> None:
        self.n = _positive_int("SaveEvery(n)", n)

    def should_save(self, context: SaveContext) -> bool:
        return context.step % self.n == 0

    def __repr__(self) -> str:
        return f"SaveEvery({self.n})"


class SaveEverySeconds(_Composable):
    """Save when ``seconds`` have passed since the last save (or since training began).

    At most ``seconds`` of work is lost, however long the steps take. "The last save" is
    any save of the manager (one another policy asked for, or one made by hand).

    >>> policy = SaveEverySeconds(60)
    >>> policy.should_save(SaveContext(5, now=30.0, started=0.0))
    False
    >>> policy.should_save(SaveContext(9, now=75.0, started=0.0, last_step=4, last_time=10.0))
    True
    """

    def __init__(self, seconds: float) -> None:
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not math.isfinite(seconds)
            or seconds <= 0
        ):
            raise ValueError(
                f"SaveEverySeconds(seconds) must be a finite number > 0, got {seconds!r}"
            )
        self.seconds = float(seconds)

    def should_save(self, context: SaveContext) -> bool:
        since = context.started if context.last_time is None else context.last_time
        return context.now - since >= self.seconds

    def __repr__(self) -> str:
        return f"SaveEverySeconds({self.seconds:g})"


class SaveAtSteps(_Composable):
    """Save exactly the given steps (e.g. the end of each learning-rate phase).

    >>> SaveAtSteps([10, 500]).should_save(SaveContext(500, 0.0, 0.0))
    True
    """

    def __init__(self, steps: Iterable[int]) -> None:
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
            raise TypeError(f"SaveAtSteps(steps) must be an iterable of ints, got {steps!r}")
        chosen = set()
        for step in steps:
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"SaveAtSteps(steps) takes ints >= 0, got {step!r}")
            chosen.add(step)
        self.steps = frozenset(chosen)

    def should_save(self, context: SaveContext) -> bool:
        return context.step in self.steps

    def __repr__(self) -> str:
        return f"SaveAtSteps({sorted(self.steps)})"


class SaveFirst(_Composable):
    """Save the first step of a run whose root holds no step yet (an initial checkpoint).

    >>> SaveFirst().should_save(SaveContext(0, 0.0, 0.0)), SaveFirst().should_save(
    ...     SaveContext(1, 0.0, 0.0, last_step=0, last_time=0.0))
    (True, False)
    """

    def should_save(self, context: SaveContext) -> bool:
        return context.last_step is None

    def __repr__(self) -> str:
        return "SaveFirst()"


class SaveOnPreemption(_Composable):
    """Save at the first ``should_save`` after one of ``signals`` arrived (default SIGTERM).

    A manager whose policy holds this one installs a handler for each signal when it is
    made (on the main thread): the handler only sets a flag and then calls the handler that
    was installed before (a Python function; not the default action, which would end the
    process). :meth:`~tdckpt.CheckpointManager.close` puts the previous handlers back.

    Attributes:
        signals: the signal numbers (e.g. ``(signal.SIGTERM, signal.SIGUSR1)``).
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,)) -> None:
        valid = set(signal.valid_signals())
        chosen: list[signal.Signals] = []
        for sig in signals:
            if isinstance(sig, bool) or not isinstance(sig, int) or sig not in valid:
                raise ValueError(f"SaveOnPreemption(signals) takes signal numbers, got {sig!r}")
            if sig in (signal.SIGKILL, getattr(signal, "SIGSTOP", signal.SIGKILL)):
                raise ValueError(
                    f"SaveOnPreemption: {signal.Signals(sig).name} cannot be caught; a job "
                    "scheduler that preempts sends SIGTERM (or SIGUSR1, ...) first."
                )
            if signal.Signals(sig) not in chosen:
                chosen.append(signal.Signals(sig))
        if not chosen:
            raise ValueError("SaveOnPreemption needs at least one signal")
        self.signals = tuple(chosen)

    def should_save(self, context: SaveContext) -> bool:
        return context.preempted

    def __repr__(self) -> str:
        return f"SaveOnPreemption(({', '.join(s.name for s in self.signals)},))"


class SaveAnyOf(_Composable):
    """Save when at least one of ``policies`` says so."""

    policies: tuple[SavePolicy, ...]

    def __init__(self, *policies: SavePolicy) -> None:
        self.policies = _union_of(SaveAnyOf, policies, "should_save", "save")

    def should_save(self, context: SaveContext) -> bool:
        # Every policy is asked (no short cut): a stateful user policy sees every step.
        answers = [bool(policy.should_save(context)) for policy in self.policies]
        return any(answers)

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.policies))


def preemption_signals(policy: SavePolicy | None) -> tuple[signal.Signals, ...]:
    """The signals of every :class:`SaveOnPreemption` in ``policy`` (in order, once each)."""
    found: list[signal.Signals] = []
    parts = policy.policies if isinstance(policy, SaveAnyOf) else (policy,)
    for part in parts:
        if isinstance(part, SaveOnPreemption):
            found.extend(s for s in part.signals if s not in found)
    return tuple(found)
