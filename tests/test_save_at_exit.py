"""A save_async still in flight when the interpreter exits is finished, or its loss is told.

Real child interpreters (tests/_exit_save_child.py) end right after ``save_async``, without
``close()``; before the fix the background save died with "cannot schedule new futures after
interpreter shutdown" and the step was lost silently.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _async_crash_child import value_of
from conftest import subprocess_env

from tdckpt.manager import CheckpointManager

TESTS = Path(__file__).resolve().parent
CHILD = TESTS / "_exit_save_child.py"


def _run(root: Path, step: int, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHILD), str(root), str(step), mode],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("mode", ["end", "exit"])
def test_a_save_in_flight_at_exit_is_committed(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "run"
    done = _run(root, 7, mode)
    assert done.returncode == 0, done.stderr
    assert "in flight: True" in done.stdout  # the script really ended during the save
    assert done.stderr == ""
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [7]
        assert mgr.verify(7).ok
        assert value_of(mgr.restore(7, allow_pickle=False)) == 7


def test_a_save_failing_at_exit_names_the_lost_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    done = _run(root, 9, "fail")
    assert "in flight: True" in done.stdout
    assert "the background save of step 9 failed while the interpreter was exiting" in (done.stderr)
    assert "OSError" in done.stderr
    assert "No space left on device (injected)" in done.stderr
    assert "step 9 was NOT committed" in done.stderr
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == []
