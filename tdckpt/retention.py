"""Retention policies: which committed steps a :class:`~tdckpt.CheckpointManager` keeps.

A policy is any object with ``select_to_keep(steps) -> set[int]`` (the
:class:`RetentionPolicy` protocol). It sees every committed step, oldest first, and names the
ones to keep; the manager deletes the others. Policies compose with :class:`AnyOf` or ``|``::

    from tdckpt.retention import (
        KeepBest, KeepEvery, KeepEverySeconds, KeepLast, KeepYoungerThan,
    )
    policy = KeepLast(3) | KeepEvery(10_000) | KeepBest(2, "val_loss")
    policy = KeepLast(3) | KeepEverySeconds(3600) | KeepYoungerThan(86400)

Whatever a policy says, the manager applies it only after a new save has committed and
never deletes the newest committed step, the step that save just wrote, nor a step being
restored or verified at that moment.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "AnyOf",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepEverySeconds",
    "KeepLast",
    "KeepYoungerThan",
    "RetentionPolicy",
    "StepInfo",
]


@dataclass(frozen=True)
class StepInfo:
    """What a policy knows about one committed step.

    Attributes:
        step: the step number.
        path: the committed folder (or ``.tdz`` archive).
        metadata: the user metadata saved with it (``save(..., metadata=...)``).
        created: when it was written (UTC ISO-8601), from its manifest.
    """

    step: int
    path: Path | str  # a URL (str) for a root in object storage
    metadata: Mapping[str, Any] = field(default_factory=dict)
    created: str | None = None


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides which steps to keep."""

    def select_to_keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """Return the step numbers to keep among ``steps`` (sorted, oldest first)."""
        ...


class _Composable:
    """``policy_a | policy_b`` keeps what either keeps."""

    def __or__(self, other: RetentionPolicy) -> AnyOf:
        return AnyOf(self, other)  # type: ignore[arg-type]


def _positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1 (not a bool); ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _union_of(
    kind: type[Any], policies: tuple[Any, ...], method: str, what: str
) -> tuple[Any, ...]:
    """The ``policies`` of a union (:class:`AnyOf`, :class:`~tdckpt.save_policy.SaveAnyOf`):
    each must have ``method`` (TypeError); a union of the same ``kind`` among them gives
    its own policies (the result is flat)."""
    if not policies:
        raise ValueError(f"{kind.__name__} needs at least one policy")
    for policy in policies:
        if not callable(getattr(policy, method, None)):
            raise TypeError(
                f"{kind.__name__} takes {what} policies (objects with {method}), got {policy!r}"
            )
    flat: list[Any] = []
    for policy in policies:
        flat.extend(policy.policies if isinstance(policy, kind) else (policy,))
    return tuple(flat)


class KeepAll(_Composable):
    """Keep every step (the default: nothing is ever deleted)."""

    def select_to_keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {info.step for info in steps}

    def __repr__(self) -> str:
        return "KeepAll()"


class KeepLast(_Composable):
    """Keep the ``n`` highest-numbered steps.

    >>> sorted(KeepLast(2).select_to_keep([StepInfo(s, Path(str(s))) for s in (1, 5, 3)]))
    [3, 5]
    """

    def __init__(self, n: int) -> None:
        self.n = _positive_int("KeepLast(n)", n)

    def select_to_keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return set(sorted(info.step for info in steps)[-self.n :])

    def __repr__(self) -> str:
        return f"KeepLast({self.n})"


class KeepEvery(_Composable):
    """Keep the steps divisible by ``n`` (e.g. a permanent checkpoint every 10 000 steps).

    >>> sorted(KeepEvery(10).select_to_keep([StepInfo(s, Path(str(s))) for s in (5, 10, 20)]))
    [10, 20]
    """

    def __init__(self, n: int) -> None:
        self.n = _positive_int("KeepEvery(n)", n)

    def select_to_keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {info.step for info in steps if info.step % self.n == 0}

    def __repr__(self) -> str:
        return f"KeepEvery({self.n})"


def metric_value(metadata: Mapping[str, Any], key: str) -> float | None:
    """``metadata[key]`` as a comparable number, or None (missing, not a real number, NaN).

    >>> metric_value({"loss": 0.5}, "loss"), metric_value({"loss": "n/a"}, "loss")
    (0.5, None)
    """
    value = metadata.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int past float's range still compares as a number
        return math.inf if value > 0 else -math.inf
    return None if math.isnan(number) else number


class KeepBest(_Composable):
    """Keep the ``k`` steps with the best value of ``metadata[key]``.

    ``mode="min"`` keeps the lowest values (a loss), ``"max"`` the highest (an accuracy).
    Steps whose metadata lack the key, or hold something other than a number (or NaN), are
    never "best". Ties go to the newer step.

    >>> infos = [StepInfo(s, Path(str(s)), {"loss": v}) for s, v in ((1, 0.3), (2, 0.1), (3, 0.2))]
    >>> sorted(KeepBest(2, "loss").select_to_keep(infos))
    [2, 3]
    """

    def __init__(self, k: int, key: str, mode: Literal["min", "max"] = "min") -> None:
        self.k = _positive_int("KeepBest(k)", k)
        if not isinstance(key, str):
            raise TypeError(f"KeepBest(key) must be a str, got {key!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"KeepBest(mode) must be 'min' or 'max', got {mode!r}")
        self.key = key
        self.mode = mode

    def select_to_keep(self, steps: Sequence[StepInfo]) -> set[int]:
        scored = []
        for info in steps:
            value = metric_value(info.metadata, self.key)
            if value is not None:
                scored.append((value if self.mode == "min" else -value, -info.step))
        scored.sort()
        return {-neg_step for _, neg_step in scored[: self.k]}

    def __repr__(self) -> str:
        return f"KeepBest({self.k}, {self.key!r}, mode={self.mode!r})"


class AnyOf(_Composable):
    """Keep every step that at least one of ``policies`` keeps (the union)."""

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy) -> None:
        self.policies = _union_of(AnyOf, policies, "select_to_keep", "retention")

    def select_to_keep(self, steps: Sequence[StepInfo]) -> set[int]:
        keep: set[int] = set()
        for policy in self.policies:
            keep |= set(policy.select_to_keep(steps))
        return keep

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"


def created_at(info: StepInfo) -> float | None:
    """When the step was written (POSIX seconds, from its manifest), or None if unknown.

    >>> created_at(StepInfo(1, Path("1"), created="1970-01-01T00:01:00+00:00"))
    60.0
    >>> created_at(StepInfo(1, Path("1"), created="yesterday")) is None
    True
    """
    if not isinstance(info.created, str):
        return None
    try:
        when = datetime.fromisoformat(info.created)
    except ValueError:
        return None
    if when.tzinfo is None:  # tdckpt writes UTC with its offset; anything else is unknown
        return None
    return when.timestamp()


def _seconds(name: str, value: object) -> float:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"{name} must be a finite number of seconds > 0 (or a timedelta), got {value!r}"
        )
    return float(value)


class KeepEverySeconds(_Composable):
    """Keep one step every ``seconds`` of training time, by when each step was written.

    Walking the steps oldest first, a step is kept when it was written at least
    ``seconds`` after the last one kept (the oldest step with a known time is kept). A
    step's answer depends only on older steps, so it never changes as newer steps come and
    go: e.g. ``KeepLast(3) | KeepEverySeconds(3600)`` keeps the last three and one an hour.
    Steps whose manifest time cannot be read are not kept by this policy.

    >>> def at(step, second):
    ...     return StepInfo(step, Path(str(step)), created=f"2026-01-01T00:00:{second:02d}+00:00")
    >>> sorted(KeepEverySeconds(10).select_to_keep([at(1, 0), at(2, 6), at(3, 11), at(4, 20)]))
    [1, 3]
    """

    def __init__(self, seconds: float | timedelta) -> None:
        self.seconds = _seconds("KeepEverySeconds(seconds)", seconds)

    def select_to_keep(self, steps: Sequence[StepInfo]) -> set[int]:
        keep: set[int] = set()
        last: float | None = None
        for info in sorted(steps, key=lambda i: i.step):
            when = created_at(info)
            if when is None:
                continue
            if last is None or when - last >= self.seconds:
                keep.add(info.step)
                last = when
        return keep

    def __repr__(self) -> str:
        return f"KeepEverySeconds({self.seconds:g})"


class KeepYoungerThan(_Composable):
    """Keep every step written less than ``seconds`` ago (e.g. everything of the last day).

    ``clock`` gives the current time in POSIX seconds (default :func:`time.time`; a fake
    clock in tests). Steps whose manifest time cannot be read are not kept by this policy.

    >>> info = StepInfo(1, Path("1"), created="1970-01-01T00:01:00+00:00")  # at 60 s
    >>> KeepYoungerThan(30, clock=lambda: 80.0).select_to_keep([info])
    {1}
    >>> KeepYoungerThan(30, clock=lambda: 95.0).select_to_keep([info])
    set()
    """

    def __init__(
        self, seconds: float | timedelta, *, clock: Callable[[], float] | None = None
    ) -> None:
        self.seconds = _seconds("KeepYoungerThan(seconds)", seconds)
        if clock is not None and not callable(clock):
            raise TypeError(f"KeepYoungerThan(clock) must be a callable, got {clock!r}")
        self.clock: Callable[[], float] = time.time if clock is None else clock

    def select_to_keep(self, steps: Sequence[StepInfo]) -> set[int]:
        now = self.clock()
        keep = set()
        for info in steps:
            when = created_at(info)
            if when is not None and now - when < self.seconds:
                keep.add(info.step)
        return keep

    def __repr__(self) -> str:
        return f"KeepYoungerThan({self.seconds:g})"
