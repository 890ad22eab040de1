"""Save policies alone (a fake clock), and ``should_save``/preemption/``wait`` on a manager."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import tdckpt
from tdckpt._write import snapshot as _snapshot
from tdckpt.errors import AsyncSaveError
from tdckpt.manager import CheckpointManager
from tdckpt.save_policy import (
    SaveAnyOf,
    SaveAtSteps,
    SaveContext,
    SaveEvery,
    SaveEverySeconds,
    SaveFirst,
    SaveOnPreemption,
    SavePolicy,
)

WAIT = 30.0


class FakeClock:
    """Seconds that move only when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def ctx(step: int, now: float = 0.0, **kw: Any) -> SaveContext:
    return SaveContext(step=step, now=now, started=kw.pop("started", 0.0), **kw)


def state(v: float = 0.0) -> TensorDict:
    return TensorDict(w=torch.full((3,), float(v)))


def _raise_signal(sig: int) -> None:
    """Send ``sig`` to this process; its Python handler runs on this (the main) thread."""
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # a bytecode boundary: any pending Python handler has run


@pytest.fixture
def saved_handlers() -> Iterator[None]:
    """Put SIGUSR1's and SIGUSR2's handlers back after the test, whatever it did."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


# -- the policies alone -------------------------------------------------------------------------


def test_save_every() -> None:
    policy = SaveEvery(5)
    assert [s for s in range(12) if policy.should_save(ctx(s))] == [0, 5, 10]
    assert repr(policy) == "SaveEvery(5)"


def test_save_every_seconds_counts_from_the_start_then_from_the_last_save() -> None:
    policy = SaveEverySeconds(60)
    assert not policy.should_save(ctx(1, now=59.9, started=0.0))
    assert policy.should_save(ctx(2, now=60.0, started=0.0))
    # after a save at t=100, the next one is due at t=160, not before
    assert not policy.should_save(ctx(3, now=159.0, last_step=2, last_time=100.0))
    assert policy.should_save(ctx(4, now=160.0, last_step=2, last_time=100.0))
    assert repr(policy) == "SaveEverySeconds(60)"


def test_save_at_steps_and_first() -> None:
    assert [s for s in range(10) if SaveAtSteps([3, 7, 3]).should_save(ctx(s))] == [3, 7]
    assert repr(SaveAtSteps((7, 3))) == "SaveAtSteps([3, 7])"
    assert SaveFirst().should_save(ctx(0))
    assert not SaveFirst().should_save(ctx(5, last_step=4, last_time=0.0))


def test_save_on_preemption_follows_the_pending_flag() -> None:
    policy = SaveOnPreemption()
    assert policy.signals == (signal.SIGTERM,)
    assert not policy.should_save(ctx(3))
    assert policy.should_save(ctx(3, preempted=True))
    both = SaveOnPreemption([signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR1])
    assert both.signals == (signal.SIGUSR1, signal.SIGTERM)
    assert repr(both) == "SaveOnPreemption((SIGUSR1, SIGTERM,))"


def test_policies_compose_with_or_and_flatten() -> None:
    policy = SaveEvery(10) | SaveAtSteps([3]) | SaveOnPreemption()
    assert isinstance(policy, SaveAnyOf) and len(policy.policies) == 3
    assert isinstance(policy, SavePolicy)
    answers = {s: policy.should_save(ctx(s)) for s in range(12)}
    assert [s for s, yes in answers.items() if yes] == [0, 3, 10]
    assert policy.should_save(ctx(7, preempted=True))
    assert repr(policy) == "SaveEvery(10) | SaveAtSteps([3]) | SaveOnPreemption((SIGTERM,))"


def test_every_policy_of_a_union_is_asked() -> None:
    asked: list[int] = []

    class Counting:
        def should_save(self, context: SaveContext) -> bool:
            asked.append(context.step)
            return False

    policy = SaveAnyOf(SaveEvery(1), Counting())
    assert policy.should_save(ctx(4))
    assert asked == [4]


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: SaveEvery(0), ValueError, r"SaveEvery\(n\) must be an int >= 1, got 0"),
        (lambda: SaveEvery(True), ValueError, "got True"),
        (lambda: SaveEverySeconds(0), ValueError, r"finite number > 0, got 0"),
        (lambda: SaveEverySeconds(float("inf")), ValueError, "got inf"),
        (lambda: SaveEverySeconds("60"), ValueError, "got '60'"),  # type: ignore[arg-type]
        (lambda: SaveAtSteps(5), TypeError, "iterable of ints, got 5"),  # type: ignore[arg-type]
        (lambda: SaveAtSteps("12"), TypeError, "iterable of ints, got '12'"),  # type: ignore[arg-type]
        (lambda: SaveAtSteps([1, -2]), ValueError, "ints >= 0, got -2"),
        (lambda: SaveOnPreemption([signal.SIGKILL]), ValueError, "SIGKILL cannot be caught"),
        (lambda: SaveOnPreemption([999]), ValueError, "signal numbers, got 999"),
        (lambda: SaveOnPreemption([]), ValueError, "at least one signal"),
        (lambda: SaveAnyOf(), ValueError, "at least one policy"),
        (lambda: SaveAnyOf(SaveEvery(1), 5), TypeError, "objects with should_save"),  # type: ignore[arg-type]
    ],
)
def test_bad_policy_arguments_are_refused(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_the_policies_are_exported() -> None:
    for name in ("SaveEvery", "SaveEverySeconds", "SaveAtSteps", "SaveFirst", "SaveOnPreemption"):
        assert getattr(tdckpt, name) is getattr(tdckpt.save_policy, name)


# -- should_save on a manager, with a fake clock ------------------------------------------------


def test_without_a_policy_should_save_is_always_false(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        assert not any(mgr.should_save(s) for s in range(20))
        assert not mgr.preempted


def test_a_loop_with_steps_and_seconds(tmp_path: Path) -> None:
    clock = FakeClock()
    policy = SaveEvery(10) | SaveEverySeconds(30) | SaveFirst()
    saved = []
    with CheckpointManager(tmp_path, save_policy=policy, clock=clock) as mgr:
        for step in range(1, 26):
            clock.advance(4)  # 4 s a step: 30 s pass every 7.5 steps
            if mgr.should_save(step):
                mgr.save(step, state(step))
                saved.append(step)
        assert mgr.steps() == saved
    # 1: the first (t=1004); 9: 32 s after it (step 8 is 28 s after); 10: every 10
    # (t=1040); 18: 32 s after that; 20: every 10; 28 would be next, past the loop
    assert saved == [1, 9, 10, 18, 20]


def test_any_save_restarts_the_seconds(tmp_path: Path) -> None:
    clock = FakeClock()
    with CheckpointManager(tmp_path, save_policy=SaveEverySeconds(10), clock=clock) as mgr:
        assert not mgr.should_save(1)  # starts the clock
        clock.advance(9)
        mgr.save(2, state())  # by hand, not asked for
        clock.advance(9)
        assert not mgr.should_save(3)  # 9 s after the save, 18 s after the start
        clock.advance(1)
        assert mgr.should_save(4)
        mgr.save_async(4, state()).result(WAIT)
        clock.advance(5)
        assert not mgr.should_save(5)


def test_never_twice_for_one_step_and_not_the_resumed_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, save_policy=SaveEvery(5)) as mgr:
        assert mgr.should_save(5)
        mgr.save(5, state())
        assert not mgr.should_save(5)  # saved: asking again (a retried step) says no
        assert mgr.should_save(10)
    # a resumed run: the newest committed step (5) is not saved again, SaveFirst is quiet
    with CheckpointManager(tmp_path, save_policy=SaveEvery(5) | SaveFirst()) as mgr:
        assert not mgr.should_save(5)
        assert not mgr.should_save(6)
        assert mgr.should_save(10)


def test_save_first_on_an_empty_root(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, save_policy=SaveFirst()) as mgr:
        assert mgr.should_save(0)
        assert mgr.should_save(1)  # nothing saved yet: still "the first"
        mgr.save(1, state())
        assert not mgr.should_save(2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"save_policy": 5}, TypeError, "save_policy must be a save policy"),
        ({"save_policy": SaveEvery(1), "clock": 3.0}, TypeError, "clock must be a callable"),
    ],
)
def test_bad_manager_arguments(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        CheckpointManager(tmp_path, **kwargs)


def test_should_save_refuses_a_bad_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, save_policy=SaveEvery(1)) as mgr, pytest.raises(ValueError):
        mgr.should_save(-1)


# -- preemption in this process (SIGUSR1/SIGUSR2: pytest keeps SIGTERM) --------------------------


def test_a_signal_makes_the_next_should_save_true_once(
    tmp_path: Path, saved_handlers: None
) -> None:
    policy = SaveEvery(100) | SaveOnPreemption([signal.SIGUSR1])
    with CheckpointManager(tmp_path, save_policy=policy) as mgr:
        assert not mgr.should_save(1)
        assert not mgr.preempted
        _raise_signal(signal.SIGUSR1)
        assert mgr.preempted
        assert mgr.should_save(2)
        assert mgr.should_save(2)  # not saved yet: still due
        mgr.save(2, state(2))
        assert not mgr.should_save(3)  # answered by the save of step 2
        assert mgr.preempted  # stays: the job is being stopped
        assert mgr.steps() == [2]


def test_a_signal_during_a_background_save_is_not_answered_by_it(
    tmp_path: Path, saved_handlers: None
) -> None:
    policy = SaveOnPreemption([signal.SIGUSR1])
    with CheckpointManager(tmp_path, save_policy=policy) as mgr:

        def hook(rel: str) -> None:  # on the background thread, while step 1 is written
            os.kill(os.getpid(), signal.SIGUSR1)

        _snapshot._between_leaves, before = hook, _snapshot._between_leaves
        try:
            mgr.save_async(1, state()).result(WAIT)
        finally:
            _snapshot._between_leaves = before
        _raise_signal(0)  # (signal 0: nothing) the main thread runs the pending handler
        assert mgr.preempted
        # step 1 was staged before the signal came: the state of step 2 must be saved
        assert mgr.should_save(2)
        mgr.save_async(2, state(2))
        assert not mgr.should_save(3)
        assert mgr.wait() == mgr.path(2)


def test_the_previous_handler_still_runs_and_comes_back(
    tmp_path: Path, saved_handlers: None
) -> None:
    calls: list[int] = []

    def previous(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)

    signal.signal(signal.SIGUSR2, previous)
    policy = SaveOnPreemption([signal.SIGUSR2])
    mgr = CheckpointManager(tmp_path, save_policy=policy)
    assert signal.getsignal(signal.SIGUSR2) is not previous
    _raise_signal(signal.SIGUSR2)
    assert calls == [signal.SIGUSR2]
    assert mgr.preempted
    mgr.close()
    assert signal.getsignal(signal.SIGUSR2) is previous
    _raise_signal(signal.SIGUSR2)
    assert calls == [signal.SIGUSR2, signal.SIGUSR2]


def test_a_default_handler_comes_back_on_close(tmp_path: Path, saved_handlers: None) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    with CheckpointManager(tmp_path, save_policy=SaveOnPreemption([signal.SIGUSR1])):
        assert callable(signal.getsignal(signal.SIGUSR1))
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN


def test_a_close_off_the_main_thread_leaves_a_handler_that_only_passes_on(
    tmp_path: Path, saved_handlers: None
) -> None:
    calls: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    mgr = CheckpointManager(tmp_path, save_policy=SaveOnPreemption([signal.SIGUSR1]))
    closer = threading.Thread(target=mgr.close)
    closer.start()
    closer.join(WAIT)
    _raise_signal(signal.SIGUSR1)
    assert calls == [signal.SIGUSR1]
    assert not mgr.preempted  # closed: the manager no longer counts signals


def test_a_manager_with_preemption_must_be_made_on_the_main_thread(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def make() -> None:
        try:
            CheckpointManager(tmp_path, save_policy=SaveOnPreemption([signal.SIGUSR1]))
        except BaseException as exc:
            errors.append(exc)

    maker = threading.Thread(target=make)
    maker.start()
    maker.join(WAIT)
    assert len(errors) == 1
    assert isinstance(errors[0], ValueError)
    assert "only on the main thread" in str(errors[0])
    assert str(tmp_path) in str(errors[0])


def test_save_if_preempted(tmp_path: Path, saved_handlers: None) -> None:
    with (
        CheckpointManager(tmp_path, save_policy=SaveEvery(10)) as mgr,
        pytest.raises(ValueError, match="needs a save_policy holding SaveOnPreemption"),
    ):
        mgr.save_if_preempted(1, state())
    policy = SaveOnPreemption([signal.SIGUSR1])
    with CheckpointManager(tmp_path, save_policy=policy) as mgr:
        assert mgr.save_if_preempted(1, state(1)) is None
        assert mgr.steps() == []
        _raise_signal(signal.SIGUSR1)
        path = mgr.save_if_preempted(2, state(2), metadata={"why": "preempted"})
        assert path == mgr.path(2)
        assert mgr.metadata(2) == {"why": "preempted"}
        assert mgr.save_if_preempted(3, state(3)) is None  # answered by the save of 2
        assert mgr.steps() == [2]


# -- wait ----------------------------------------------------------------------------------------


def test_wait_returns_the_committed_path(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.wait() is None
        mgr.save_async(3, state(3))
        assert mgr.wait() == mgr.path(3)
        assert mgr.steps() == [3]
        assert mgr.wait() == mgr.path(3)  # nothing new in flight: the same answer


def test_wait_raises_an_unretrieved_failure_once(tmp_path: Path) -> None:
    def fail(rel: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device (injected)", rel)

    with CheckpointManager(tmp_path) as mgr:
        _snapshot._between_leaves, before = fail, _snapshot._between_leaves
        try:
            mgr.save_async(4, state(4))
            with pytest.raises(AsyncSaveError, match="step 4 failed") as info:
                mgr.wait()
        finally:
            _snapshot._between_leaves = before
        assert isinstance(info.value.__cause__, OSError)
        assert mgr.wait() is None  # delivered: not raised again (nor by close)
        assert mgr.steps() == []


# -- an object-storage root ----------------------------------------------------------------------


def test_should_save_on_an_object_storage_root(saved_handlers: None) -> None:
    import uuid

    fsspec = pytest.importorskip("fsspec")
    name = f"t{uuid.uuid4().hex[:12]}"
    clock = FakeClock()
    policy = SaveEverySeconds(10) | SaveOnPreemption([signal.SIGUSR1])
    try:
        mgr = CheckpointManager(f"memory://{name}/run", save_policy=policy, clock=clock)
        assert type(mgr).__name__ == "CheckpointManager" and mgr.root.startswith("memory://")  # type: ignore[union-attr]
        assert not mgr.should_save(1)
        clock.advance(10)
        assert mgr.should_save(2)
        mgr.save(2, state(2))
        clock.advance(5)
        assert not mgr.should_save(3)
        _raise_signal(signal.SIGUSR1)
        assert mgr.should_save(3)
        mgr.save_async(3, state(3))
        assert not mgr.should_save(4)
        assert mgr.wait() is not None
        assert mgr.steps() == [2, 3]
        assert mgr.preempted
        mgr.close()
        assert signal.getsignal(signal.SIGUSR1) is not None
        assert not callable(signal.getsignal(signal.SIGUSR1))  # the default is back
    finally:
        fsspec.filesystem("memory").rm(f"/{name}", recursive=True)


def test_a_default_action_still_ends_the_process_after_a_close_off_the_main_thread(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import os, signal, threading, time
        from tdckpt import CheckpointManager, SaveOnPreemption
        mgr = CheckpointManager({str(tmp_path)!r}, save_policy=SaveOnPreemption([signal.SIGUSR1]))
        closer = threading.Thread(target=mgr.close)
        closer.start()
        closer.join()
        print("closed", flush=True)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(5)
        print("still alive", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout == "closed\n", done.stderr
    assert done.returncode == -signal.SIGUSR1
