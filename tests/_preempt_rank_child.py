"""One rank of a 2-rank gloo run that a test preempts on rank 1 only (tests/test_preemption.py).

``python tests/_preempt_rank_child.py MODE RANK WORLD PORT ROOT OUT``

``run``
    join a gloo group on 127.0.0.1:PORT, then "train" this rank's shard (:func:`train_step`)
    for up to 20 steps with a collective manager, ``save_policy=SaveEvery(5) |
    SaveOnPreemption()`` and ``save_async``. Rank 1 prints ``mid-step 7`` in the middle of
    step 7 and waits there for its SIGTERM; rank 0 gets no signal. Each rank prints
    ``stopped at N preempted=<bool>`` and ``json.dump``s its result to OUT.
``mismatch``
    rank r asks ``should_save(5 + r)``; write the error every rank gets to OUT (JSON).
``resume``
    restore this rank's rows of the latest step (a collective restore), train to step 20 and
    ``torch.save`` the shard to OUT.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from tensordict import TensorDict

from tdckpt import CheckpointManager, SaveEvery, SaveOnPreemption

TOTAL = 20
ROWS = 4  # rows of each rank's shard (equal: a collective restore splits evenly)


def initial(rank: int) -> TensorDict:
    """This rank's shard before step 1 (the same in every process)."""
    g = torch.Generator().manual_seed(rank)
    return TensorDict(
        w=torch.randn(ROWS, 3, generator=g),
        n=torch.zeros(ROWS, dtype=torch.int64),
        batch_size=[ROWS],
    )


def train_step(shard: TensorDict, step: int) -> None:
    """A deterministic in-place update that depends on every earlier step."""
    shard["w"].mul_(0.9).add_(torch.sin(shard["w"] * step))
    shard["n"].add_(step)


def reference(rank: int, steps: int) -> TensorDict:
    shard = initial(rank)
    for step in range(1, steps + 1):
        train_step(shard, step)
    return shard


def run(rank: int, root: str, out: str) -> None:
    mgr = CheckpointManager(root, save_policy=SaveEvery(5) | SaveOnPreemption(), timeout=60)
    shard = initial(rank)
    stopped = None
    try:
        for step in range(1, TOTAL + 1):
            train_step(shard, step)
            if rank == 1 and step == 7:  # in the middle of the step: wait for the signal
                print("mid-step 7", flush=True)
                deadline = time.monotonic() + 60
                while not mgr.preempted:
                    if time.monotonic() > deadline:
                        raise SystemExit("no SIGTERM came")
                    time.sleep(0.005)
            if mgr.should_save(step):
                mgr.save_async(step, shard)
            if mgr.preempted:
                stopped = step
                break
    finally:
        mgr.close()
    print(f"stopped at {stopped} preempted={mgr.preempted}", flush=True)
    with open(out, "w") as f:
        json.dump({"stopped": stopped, "preempted": mgr.preempted}, f)


def resume(rank: int, root: str, out: str) -> None:
    with CheckpointManager(root, timeout=60) as mgr:
        start = mgr.latest_step()
        assert start is not None
        shard = mgr.restore()
    shard = TensorDict(w=shard["w"].clone(), n=shard["n"].clone(), batch_size=[ROWS])
    for step in range(start + 1, TOTAL + 1):
        train_step(shard, step)
    torch.save({"from": start, "w": shard["w"], "n": shard["n"]}, out)


def mismatch(rank: int, root: str, out: str) -> None:
    from tdckpt.errors import CollectiveError

    with CheckpointManager(root, save_policy=SaveEvery(1), timeout=60) as mgr:
        result: dict[str, str | None]
        try:
            mgr.should_save(5 + rank)
        except CollectiveError as exc:
            result = {"error": type(exc).__name__, "message": str(exc)}
        else:
            result = {"error": None}
    with open(out, "w") as f:
        json.dump(result, f)


def main() -> None:
    mode, rank, world, port, root, out = sys.argv[1:7]
    # the rendezvous store is the test's (it outlives every rank)
    store = dist.TCPStore("127.0.0.1", int(port), int(world), is_master=False)
    dist.init_process_group("gloo", store=store, rank=int(rank), world_size=int(world))
    try:
        {"run": run, "resume": resume, "mismatch": mismatch}[mode](int(rank), root, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
