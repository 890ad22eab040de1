"""A real training run preempted with SIGTERM saves a step, and resumes from it bit-exactly.

The child (tests/_preempt_child.py) trains a small model with dropout, Adam, a scheduler,
a shuffled sampler and NumPy/Python noise, with ``SaveEvery(5) | SaveOnPreemption()``; the
test sends SIGTERM in the middle of a training step, or while a ``save_async`` is in
flight, then resumes the run in a fresh process from the step committed on the way out.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import subprocess_env

from tdckpt.manager import CheckpointManager

TESTS = Path(__file__).resolve().parent
CHILD = TESTS / "_preempt_child.py"
WAIT = 120


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal bit for bit: tensors by torch.equal, containers element by element."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _preempt(root: Path, when: str, wait_for: str) -> tuple[str, str]:
    """Run the child, send SIGTERM once it prints ``wait_for``; return its stdout, stderr."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), "run", str(root), when],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    lines = []
    try:
        for line in child.stdout:
            lines.append(line)
            if line.strip() == wait_for:
                child.send_signal(signal.SIGTERM)
                break
        out, err = child.communicate(timeout=WAIT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, f"child failed ({child.returncode}):\n{err}"
    return "".join(lines) + out, err


def _resume(root: Path, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "resume.pt"
    subprocess.run(
        [sys.executable, str(CHILD), "resume", str(root), str(out)],
        env=subprocess_env(),
        timeout=WAIT,
        check=True,
    )
    loaded: dict[str, Any] = torch.load(out, weights_only=True)
    return loaded


@pytest.mark.parametrize(
    ("when", "wait_for", "stopped", "steps"),
    [
        ("mid-step", "mid-step 7", 7, [5, 7]),
        ("mid-save", "mid-step 6", 6, [5, 6]),
    ],
)
def test_sigterm_saves_a_step_and_the_run_resumes_from_it_bit_exactly(
    tmp_path: Path, when: str, wait_for: str, stopped: int, steps: list[int]
) -> None:
    root = tmp_path / "run"
    out, err = _preempt(root, when, wait_for)
    assert "previous handler ran" in out  # the manager's handler chained the script's own
    assert f"stopped at {stopped}" in out
    if when == "mid-save":
        assert "save of 5 in flight at the signal: True" in out
    assert err == ""
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == steps
        assert mgr.metadata(stopped) == {"step": stopped}
    resumed = _resume(root, tmp_path)
    assert resumed["from"] == stopped
    assert_same(resumed["resumed"], resumed["full"])


# -- two gloo ranks, the signal on rank 1 only ---------------------------------------------------

RANK_CHILD = TESTS / "_preempt_rank_child.py"


class _Ranks(list[subprocess.Popen[str]]):
    """The rank processes, and the rendezvous store they join through: hosted here, so it
    outlives every rank (a rank that is done may exit while a peer still uses it)."""

    store: Any = None


def _ranks(mode: str, root: Path, tmp_path: Path) -> _Ranks:
    import torch.distributed as dist

    ranks = _Ranks()
    ranks.store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ranks.extend(
        subprocess.Popen(
            [
                sys.executable,
                str(RANK_CHILD),
                mode,
                str(rank),
                "2",
                str(ranks.store.port),
                str(root),
                str(tmp_path / f"{mode}{rank}.out"),
            ],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    )
    return ranks


def _finish(ranks: list[subprocess.Popen[str]]) -> list[str]:
    outs = []
    try:
        for rank, proc in enumerate(ranks):
            out, err = proc.communicate(timeout=WAIT)
            assert proc.returncode == 0, f"rank {rank} failed ({proc.returncode}):\n{err}"
            outs.append(out)
    finally:
        _cleanup(ranks)
    return outs


def _cleanup(ranks: list[subprocess.Popen[str]]) -> None:
    for proc in ranks:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_one_ranks_sigterm_makes_every_rank_save_the_same_step(tmp_path: Path) -> None:
    import json

    from _preempt_rank_child import reference

    root = tmp_path / "run"
    ranks = _ranks("run", root, tmp_path)
    try:
        stdout = ranks[1].stdout
        assert stdout is not None
        first = stdout.readline()
        assert first.strip() == "mid-step 7", first
        ranks[1].send_signal(signal.SIGTERM)  # rank 1 alone
    except BaseException:
        _cleanup(ranks)
        raise
    outs = _finish(ranks)
    results = [json.loads((tmp_path / f"run{rank}.out").read_text()) for rank in range(2)]
    # both stopped at step 7, after saving it together; rank 0 learnt of the signal
    assert results == [{"stopped": 7, "preempted": True}] * 2, outs
    with CheckpointManager(root, group=False) as mgr:
        assert mgr.steps() == [5, 7]
        assert mgr.verify(7).ok
        whole = mgr.restore(7)
    expected = [reference(rank, 7) for rank in range(2)]
    assert torch.equal(whole["w"], torch.cat([e["w"] for e in expected]))
    assert torch.equal(whole["n"], torch.cat([e["n"] for e in expected]))
    # both ranks resume from step 7 and reach the uninterrupted run's step 20 bit-exactly
    _finish(_ranks("resume", root, tmp_path))
    for rank in range(2):
        resumed = torch.load(tmp_path / f"resume{rank}.out", weights_only=True)
        assert resumed["from"] == 7
        full = reference(rank, 20)
        assert torch.equal(resumed["w"], full["w"])
        assert torch.equal(resumed["n"], full["n"])


def test_ranks_asking_about_different_steps_all_get_an_error(tmp_path: Path) -> None:
    import json

    _finish(_ranks("mismatch", tmp_path / "run", tmp_path))
    for rank in range(2):
        result = json.loads((tmp_path / f"mismatch{rank}.out").read_text())
        assert result["error"] == "CollectiveError"
        assert (
            f"rank {rank} of 2: should_save was called for different steps" in (result["message"])
        )
        assert "rank 0: 5, rank 1: 6" in result["message"]


_TWO_MANAGERS = """
import os, signal, sys, tempfile
from tdckpt import CheckpointManager
from tdckpt.save_policy import SaveOnPreemption
root = tempfile.mkdtemp()
policy = SaveOnPreemption([signal.SIGTERM])
a = CheckpointManager(root + "/a", save_policy=policy)
b = CheckpointManager(root + "/b", save_policy=policy)
a.close()
os.kill(os.getpid(), signal.SIGTERM)
print("alive", b.preempted, a.preempted, flush=True)
b.close()
print("restored", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
c = CheckpointManager(root + "/c", save_policy=policy)
os.kill(os.getpid(), signal.SIGTERM)
print("alive", c.preempted, flush=True)
c.close()
os.kill(os.getpid(), signal.SIGTERM)
print("not reached", flush=True)
"""

_FORKED_CHILD = """
import multiprocessing as mp, signal, tempfile, time
from tdckpt import CheckpointManager
from tdckpt.save_policy import SaveOnPreemption

def work():
    time.sleep(30)

if __name__ == "__main__":
    mgr = CheckpointManager(tempfile.mkdtemp(), save_policy=SaveOnPreemption([signal.SIGTERM]))
    child = mp.get_context("fork").Process(target=work)
    child.start()
    time.sleep(0.5)
    started = time.monotonic()
    child.terminate()
    child.join(20)
    quick = time.monotonic() - started < 10
    print("child", child.exitcode, quick, mgr.preempted, flush=True)
    mgr.close()
"""


def test_every_open_manager_counts_the_signal_and_closing_them_all_restores_it() -> None:
    """Two managers with SaveOnPreemption: closing the first left its handler in the chain,
    which then gave SIGTERM its default action and the process died though the second was
    open; closing both left a stale handler that killed a third manager's process too. One
    handler now serves every open manager, and the last close puts the default back."""
    out = subprocess.run(
        [sys.executable, "-c", _TWO_MANAGERS],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert out.stdout.split("\n")[:3] == ["alive True False", "restored True", "alive True"], (
        out.stdout + out.stderr
    )
    assert out.returncode == -signal.SIGTERM  # all closed: SIGTERM ends the process again
    assert "not reached" not in out.stdout


def test_a_forked_child_keeps_the_default_sigterm() -> None:
    """A child forked while a manager with SaveOnPreemption is open (a DataLoader worker,
    a pool) inherits its handler: SIGTERM was counted there, by nobody, and the child ran
    on. The signal now acts on a forked child as it would without tdckpt."""
    out = subprocess.run(
        [sys.executable, "-c", _FORKED_CHILD],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert out.stdout.strip() == f"child {-signal.SIGTERM} True False", out.stdout + out.stderr
