"""A small training run that a test preempts with SIGTERM (run by tests/test_preemption.py).

``python tests/_preempt_child.py run ROOT WHEN``
    train from seed 0 for up to 20 steps with ``save_policy=SaveEvery(5) |
    SaveOnPreemption()`` and ``save_async``; a Python SIGTERM handler is installed first
    (it prints ``previous handler ran``), so the manager's handler must chain it.
    ``WHEN`` says where the test's SIGTERM lands:

    ``mid-step``
        step 7 prints ``mid-step 7`` between its backward pass and its optimizer step and
        waits there for the signal; the loop is in a ``with`` block.
    ``mid-save``
        the background writer is slowed down (0.1 s a leaf file); after the save of step 5
        is started the run prints ``saving 5``, and step 6 waits mid-step for the signal
        while that save is in flight. The script then ends right after its last
        ``save_async``, without ``close()``.

    Prints ``stopped at N`` after the save the preemption asked for.
``python tests/_preempt_child.py resume ROOT OUT``
    train 20 steps from seed 0 without interruption (the reference), then build everything
    from another seed, restore the latest step of ROOT in place and train to step 20;
    ``torch.save`` both results to OUT as ``{"full": ..., "resumed": ..., "from": step}``.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np
import torch
from _state_train_child import build, dataset, result

from tdckpt import CheckpointManager, SaveEvery, SaveOnPreemption
from tdckpt._write import snapshot as _snapshot

TOTAL = 20
WAIT = 60.0


def train_step(state: dict[str, Any], pause: Callable[[], None] | None = None) -> None:
    """One step of _state_train_child's training, with a pause inside it (after backward)."""
    x, y = dataset()
    model, optimizer = state["model"], state["optimizer"]
    model.train()
    idx = state["sampler"].next_batch()
    noise = torch.from_numpy(np.random.normal(0, 0.01, size=(len(idx), 6)).astype("float32"))
    scale = 1.0 + random.uniform(-0.1, 0.1)
    loss = torch.nn.functional.cross_entropy(model((x[idx] + noise) * scale), y[idx])
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    if pause is not None:
        pause()
    optimizer.step()
    state["scheduler"].step()


def run(root: str, when: str) -> None:
    def previous(signum: int, frame: FrameType | None) -> None:
        print("previous handler ran", flush=True)

    signal.signal(signal.SIGTERM, previous)
    if when == "mid-save":
        _snapshot._between_leaves = lambda rel: time.sleep(0.1)
    policy = SaveEvery(5) | SaveOnPreemption()
    mgr = CheckpointManager(root, save_policy=policy)
    state = build(0)
    futures: dict[int, Any] = {}

    def wait_for_signal() -> None:
        deadline = time.monotonic() + WAIT
        while not mgr.preempted:  # the handler runs on this thread, between two sleeps
            if time.monotonic() > deadline:
                raise SystemExit("no SIGTERM came")
            time.sleep(0.005)
        if 5 in futures:
            print(f"save of 5 in flight at the signal: {not futures[5].done()}", flush=True)

    signal_at = 7 if when == "mid-step" else 6
    for step in range(1, TOTAL + 1):
        if step == signal_at:
            print(f"mid-step {step}", flush=True)
        train_step(state, wait_for_signal if step == signal_at else None)
        if mgr.should_save(step):
            futures[step] = mgr.save_async(step, state, metadata={"step": step})
            if step == 5 and when == "mid-save":
                print("saving 5", flush=True)
        if mgr.preempted:
            print(f"stopped at {step}", flush=True)
            break
    if when == "mid-step":
        mgr.close()  # as leaving a with block: waits for the save
    # mid-save: the script ends here, the save of the last step in flight


def resume(root: str, out: str) -> None:
    state = build(0)
    for _ in range(TOTAL):
        train_step(state)
    full = result(state)
    state = build(99)  # nothing but the restore can make this run right
    with CheckpointManager(root) as mgr:
        start = mgr.latest_step()
        assert start is not None
        assert mgr.verify(start).ok
        mgr.restore_into(state, allow_pickle=False)
    for _ in range(start, TOTAL):
        train_step(state)
    torch.save({"full": full, "resumed": result(state), "from": start}, out)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        resume(sys.argv[2], sys.argv[3])
