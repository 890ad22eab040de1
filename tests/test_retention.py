"""Retention policies, alone and applied by the manager after each committed save."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tdckpt._write import atomic as _atomic
from tdckpt.manager import CheckpointManager
from tdckpt.retention import (
    AnyOf,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLast,
    RetentionPolicy,
    StepInfo,
)


def infos(*steps: int, **metrics: dict[int, Any]) -> list[StepInfo]:
    """StepInfos for ``steps``; ``loss={1: 0.5}`` gives step 1 metadata {"loss": 0.5}."""
    out = []
    for step in steps:
        meta = {name: values[step] for name, values in metrics.items() if step in values}
        out.append(StepInfo(step=step, path=Path(str(step)), metadata=meta))
    return out


# -- the policies alone -------------------------------------------------------------------------


def test_keep_all() -> None:
    assert KeepAll().select_to_keep(infos(1, 2, 3)) == {1, 2, 3}
    assert KeepAll().select_to_keep([]) == set()


def test_keep_last_sorts_numerically() -> None:
    assert KeepLast(2).select_to_keep(infos(2, 10, 100, 9)) == {10, 100}
    assert KeepLast(5).select_to_keep(infos(1, 2)) == {1, 2}


def test_keep_every() -> None:
    assert KeepEvery(10).select_to_keep(infos(0, 5, 10, 15, 20)) == {0, 10, 20}


@pytest.mark.parametrize(
    ("mode", "k", "want"),
    [("min", 1, {2}), ("min", 2, {2, 4}), ("max", 1, {1}), ("max", 2, {1, 3})],
)
def test_keep_best(mode: str, k: int, want: set[int]) -> None:
    steps = infos(1, 2, 3, 4, 5, loss={1: 0.9, 2: 0.1, 3: 0.5, 4: 0.2})
    assert KeepBest(k, "loss", mode=mode).select_to_keep(steps) == want  # type: ignore[arg-type]


def test_keep_best_ignores_missing_and_non_numeric_values() -> None:
    steps = infos(
        1, 2, 3, 4, 5, 6, loss={1: "low", 2: None, 3: True, 4: float("nan"), 5: [0.0], 6: 3}
    )
    assert KeepBest(3, "loss").select_to_keep(steps) == {6}
    assert KeepBest(1, "absent").select_to_keep(steps) == set()


def test_keep_best_ties_go_to_the_newer_step() -> None:
    steps = infos(1, 2, 3, acc={1: 0.5, 2: 0.5, 3: 0.1})
    assert KeepBest(1, "acc", mode="max").select_to_keep(steps) == {2}


def test_any_of_is_the_union_and_flattens() -> None:
    policy = KeepLast(1) | KeepEvery(10) | KeepBest(1, "loss")
    assert isinstance(policy, AnyOf) and len(policy.policies) == 3
    steps = infos(5, 10, 15, 20, 25, loss={5: 0.01})
    assert policy.select_to_keep(steps) == {25, 10, 20, 5}
    assert repr(policy) == "AnyOf(KeepLast(1), KeepEvery(10), KeepBest(1, 'loss', mode='min'))"


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: KeepLast(0), ValueError, r"KeepLast\(n\) must be an int >= 1"),
        (lambda: KeepLast(True), ValueError, "int >= 1"),
        (lambda: KeepEvery(2.0), ValueError, "int >= 1"),
        (lambda: KeepBest(0, "x"), ValueError, "int >= 1"),
        (lambda: KeepBest(1, "x", mode="best"), ValueError, "'min' or 'max'"),
        (lambda: KeepBest(1, 3), TypeError, "must be a str"),
        (lambda: AnyOf(), ValueError, "at least one"),
        (lambda: AnyOf(KeepAll(), 3), TypeError, "retention policies"),
    ],
)
def test_bad_arguments(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_any_object_with_select_to_keep_is_a_policy() -> None:
    class Mine:
        def select_to_keep(self, steps: Sequence[StepInfo]) -> set[int]:
            return set()

    assert isinstance(Mine(), RetentionPolicy)
    assert isinstance(KeepLast(1), RetentionPolicy)
    assert AnyOf(Mine(), KeepLast(1)).select_to_keep(infos(1, 2)) == {2}


# -- applied by the manager ---------------------------------------------------------------------


def _td(step: int) -> TensorDict:
    return TensorDict(w=torch.full((4,), float(step)))


def _save_all(mgr: CheckpointManager, steps: Sequence[int], **metrics: dict[int, Any]) -> None:
    for step in steps:
        meta = {name: values[step] for name, values in metrics.items() if step in values}
        mgr.save(step, _td(step), metadata=meta)


@pytest.mark.parametrize(
    ("policy", "want"),
    [
        (KeepAll(), [1, 2, 3, 4, 5, 6]),
        (KeepLast(2), [5, 6]),
        (KeepEvery(2), [2, 4, 6]),
        (KeepEvery(4), [4, 6]),  # the newest is never deleted
        (KeepBest(2, "loss"), [2, 3, 6]),  # best two + the newest
        (KeepBest(1, "loss", mode="max"), [5, 6]),
        (KeepLast(1) | KeepBest(1, "loss"), [2, 6]),
    ],
    ids=repr,
)
def test_manager_applies_the_policy(
    policy: RetentionPolicy, want: list[int], tmp_path: Path
) -> None:
    with CheckpointManager(tmp_path, retention=policy, fsync=False) as mgr:
        _save_all(mgr, [1, 2, 3, 4, 5, 6], loss={1: 0.5, 2: 0.1, 3: 0.2, 4: 0.4, 5: 0.9, 6: 0.8})
        assert mgr.steps() == want
    assert sorted(os.listdir(tmp_path)) == sorted(map(str, want))  # nothing left behind


def test_a_policy_keeping_nothing_still_keeps_the_newest(tmp_path: Path) -> None:
    class Nothing:
        def select_to_keep(self, steps: Sequence[StepInfo]) -> set[int]:
            return set()

    with CheckpointManager(tmp_path, retention=Nothing(), fsync=False) as mgr:
        _save_all(mgr, [1, 2, 3])
        assert mgr.steps() == [3]


def test_the_step_just_saved_is_kept_even_if_older_than_the_newest(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, retention=KeepLast(1), fsync=False) as mgr:
        _save_all(mgr, [10, 5])
        assert mgr.steps() == [5, 10]
        mgr.save(11, _td(11))
        assert mgr.steps() == [11]


def test_retention_sees_the_metadata_and_runs_after_the_commit(tmp_path: Path) -> None:
    seen: list[list[tuple[int, dict[str, Any]]]] = []

    class Spy:
        def select_to_keep(self, steps: Sequence[StepInfo]) -> set[int]:
            seen.append([(s.step, dict(s.metadata)) for s in steps])
            assert all(s.path.exists() and s.created for s in steps)
            return {s.step for s in steps}

    with CheckpointManager(tmp_path, retention=Spy(), fsync=False) as mgr:
        _save_all(mgr, [1, 2], loss={1: 0.3})
    assert seen == [[(1, {"loss": 0.3})], [(1, {"loss": 0.3}), (2, {})]]


def test_a_step_being_restored_is_never_deleted(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, retention=KeepLast(1), fsync=False) as mgr:
        _save_all(mgr, [1])
        with mgr._pins.using(1):  # what restore_into/restore/verify hold while they read
            _save_all(mgr, [2, 3])
            assert mgr.steps() == [1, 3]
        mgr.save(4, _td(4))
        assert mgr.steps() == [4]


def test_a_crash_mid_delete_never_leaves_a_half_deleted_step_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointManager(tmp_path, retention=KeepLast(1), fsync=False) as mgr:
        mgr.save(1, _td(1))

        def crash(path: Path) -> None:
            (path / "w.memmap").unlink()  # half deleted ...
            raise KeyboardInterrupt  # ... when the process dies

        monkeypatch.setattr(_atomic, "remove_retired", crash)
        with pytest.raises(KeyboardInterrupt):
            mgr.save(2, _td(2))
        monkeypatch.undo()
        assert mgr.steps() == [2]  # step 1 was renamed away before the delete began
        leftovers = [n for n in os.listdir(tmp_path) if _atomic.is_tmp_name(n)]
        assert len(leftovers) == 1 and leftovers[0].startswith("1.tmp-")
        assert [p.name for p in mgr.gc()] == leftovers
        assert sorted(os.listdir(tmp_path)) == [".tdckpt.lock", "2"]


def test_prune_applies_a_stricter_policy_now(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, fsync=False) as mgr:
        _save_all(mgr, [1, 2, 3])
    with CheckpointManager(tmp_path, retention=KeepLast(1), fsync=False) as mgr:
        assert sorted(p.name for p in mgr.prune()) == ["1", "2"]
        assert mgr.steps() == [3]


def test_retention_covers_both_forms_of_a_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, fsync=False, archive=True) as mgr:
        _save_all(mgr, [1])
    with CheckpointManager(tmp_path, retention=KeepLast(1), fsync=False) as mgr:
        _save_all(mgr, [2])
        assert mgr.steps() == [2]
    assert sorted(os.listdir(tmp_path)) == ["2"]


# -- time-based retention ------------------------------------------------------------------------


def timed(*pairs: tuple[int, float | None]) -> list[StepInfo]:
    """StepInfos whose manifest time is ``seconds`` after 2026-01-01 00:00 UTC (None: unknown)."""
    from datetime import datetime, timedelta, timezone

    base = datetime(2026, 1, 1, tzinfo=timezone.utc)
    return [
        StepInfo(
            step=step,
            path=Path(str(step)),
            created=None if seconds is None else (base + timedelta(seconds=seconds)).isoformat(),
        )
        for step, seconds in pairs
    ]


BASE = 1767225600.0  # 2026-01-01 00:00 UTC, POSIX seconds


def test_keep_every_seconds_keeps_one_step_per_interval() -> None:
    from tdckpt.retention import KeepEverySeconds

    steps = timed((1, 0), (2, 30), (3, 59), (4, 61), (5, 100), (6, 130), (7, 300))
    # 1 kept; 4 is the first 60 s after 1; 6 the first 60 s after 4; 7 after 6
    assert KeepEverySeconds(60).select_to_keep(steps) == {1, 4, 6, 7}
    assert repr(KeepEverySeconds(60)) == "KeepEverySeconds(60)"


def test_keep_every_seconds_is_stable_as_steps_go() -> None:
    """A kept step stays kept while newer steps come and unkept ones are deleted."""
    from tdckpt.retention import KeepEverySeconds

    policy = KeepLast(2) | KeepEverySeconds(100)
    present: list[StepInfo] = []
    kept_once: set[int] = set()
    for step in range(1, 40):  # a step every 17 s; the manager deletes what is not kept
        present.append(timed((step, step * 17.0))[0])
        keep = policy.select_to_keep(present)
        by_time = KeepEverySeconds(100).select_to_keep(present)
        assert kept_once <= by_time, "a step kept for its time was dropped later"
        kept_once |= by_time
        present = [i for i in present if i.step in keep]
    assert kept_once == {1, 7, 13, 19, 25, 31, 37}  # 102 s apart: the first after 100 s
    assert [i.step for i in present] == [1, 7, 13, 19, 25, 31, 37, 38, 39]


def test_keep_every_seconds_skips_unknown_times_and_takes_a_timedelta() -> None:
    from datetime import timedelta

    from tdckpt.retention import KeepEverySeconds

    steps = timed((1, None), (2, 10), (3, 50), (4, 75))
    steps.append(StepInfo(step=5, path=Path("5"), created="not a time"))
    steps.append(StepInfo(step=6, path=Path("6"), created="2026-01-01T00:09:00"))  # no offset
    assert KeepEverySeconds(timedelta(minutes=1)).select_to_keep(steps) == {2, 4}


def test_keep_younger_than_with_a_fake_clock() -> None:
    from datetime import timedelta

    from tdckpt.retention import KeepYoungerThan

    steps = timed((1, 0), (2, 3000), (3, 3500), (4, None))
    now = BASE + 3600
    assert KeepYoungerThan(601, clock=lambda: now).select_to_keep(steps) == {2, 3}
    assert KeepYoungerThan(600, clock=lambda: now).select_to_keep(steps) == {3}
    assert KeepYoungerThan(timedelta(hours=2), clock=lambda: now).select_to_keep(steps) == {
        1,
        2,
        3,
    }
    assert repr(KeepYoungerThan(600)) == "KeepYoungerThan(600)"


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        ("KeepEverySeconds(0)", ValueError, r"KeepEverySeconds\(seconds\) must be a finite"),
        ("KeepEverySeconds(float('nan'))", ValueError, "got nan"),
        ("KeepYoungerThan(-1)", ValueError, r"KeepYoungerThan\(seconds\) must be a finite"),
        ("KeepYoungerThan('1h')", ValueError, "got '1h'"),
        ("KeepYoungerThan(5, clock=5)", TypeError, r"KeepYoungerThan\(clock\) must be a callable"),
    ],
)
def test_time_policies_refuse_bad_arguments(make: str, error: type[Exception], match: str) -> None:
    from tdckpt.retention import KeepEverySeconds, KeepYoungerThan

    names = {"KeepEverySeconds": KeepEverySeconds, "KeepYoungerThan": KeepYoungerThan}
    with pytest.raises(error, match=match):
        eval(make, names)


def test_time_retention_uses_the_real_creation_times(tmp_path: Path) -> None:
    import time
    from datetime import datetime

    from tdckpt.retention import KeepEverySeconds, KeepYoungerThan

    td = TensorDict(w=torch.zeros(2))
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, td)
        mgr.save(2, td)
        time.sleep(1.2)
        mgr.save(3, td)
        created = {
            i.step: datetime.fromisoformat(i.created or "").timestamp() for i in mgr.step_infos()
        }
    assert created[3] - created[1] >= 1.2
    expect = {1, 3} | ({2} if created[2] - created[1] >= 1.0 else set())
    with CheckpointManager(tmp_path, retention=KeepEverySeconds(1.0)) as mgr:
        mgr.prune()
        assert set(mgr.steps()) == expect
    # an hour later by the clock, only the newest step (always kept) is left; now, all stay
    with CheckpointManager(tmp_path, retention=KeepYoungerThan(600)) as mgr:
        mgr.prune()
        assert set(mgr.steps()) == expect
    later = KeepYoungerThan(600, clock=lambda: time.time() + 3600)
    with CheckpointManager(tmp_path, retention=later) as mgr:
        mgr.prune()
        assert mgr.steps() == [3]


def test_a_local_retention_failing_after_the_commit_warns_and_the_save_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retiring the old step fails (EACCES on the rename): save() returns the committed step
    with a TdckptWarning at the caller's line, as on object storage (it raised before, from a
    save whose step was committed and listed)."""
    import errno
    import inspect
    import warnings

    from tdckpt.warnings import TdckptWarning

    def refused(root: Path, path: Path, step: int, *, fsync: bool = True) -> Path:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    with CheckpointManager(tmp_path / "run", retention=KeepLast(1)) as mgr:
        mgr.save(1, TensorDict(w=torch.zeros(2)))
        monkeypatch.setattr(_atomic, "retire", refused)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
            path = mgr.save(2, TensorDict(w=torch.ones(2)))
        (w,) = caught
        assert w.category is TdckptWarning and (w.filename, w.lineno) == (__file__, line)
        text = str(w.message)
        assert text.startswith(f"{tmp_path / 'run' / '2'}: step 2 is committed, but ")
        assert "Permission denied" in text and "prune() and gc()" in text
        assert path == tmp_path / "run" / "2" and mgr.steps() == [1, 2]
        monkeypatch.undo()
        assert mgr.prune() == [tmp_path / "run" / "1"] and mgr.steps() == [2]
