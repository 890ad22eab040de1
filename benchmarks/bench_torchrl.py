"""TorchRL benchmark: a 1M-transition replay buffer and a policy through ``torchrl.checkpoint``.

    python benchmarks/run.py torchrl [--quick]      (an environment with torchrl 0.14.1)

Rows, each against its baseline measured in the same run (best of several runs; ratios
< 1 mean tdckpt is faster):

* save: ``Checkpoint(policy=..., buffer=...).save(path)`` with TorchRL's default adapters
  (``StateDictCheckpointAdapter``, the buffer's ``dump``/``load`` with its
  ``TensorStorageCheckpointer``) followed by an fsync of every file and folder it wrote
  (equal durability), vs ``tdckpt.torchrl.save`` of the same checkpoint with ``use_tdckpt``
  and a buffer whose checkpointer is ``TdckptStorageCheckpointer`` (checksums and fsync on,
  TorchRL's own files synced too). The target: at most 1.2x.
* load: ``Checkpoint.load`` into a fresh policy and a fresh (empty) buffer of the same
  capacity, TorchRL's default vs tdckpt's (every file re-read against its checksum first).
  The target: no slower.

Every timed save starts after the previous round's output is deleted and ``os.sync()``
returned.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every folder bottom-up (what tdckpt does for its own files)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(root.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _best(run: Callable[[int], Any], reps: int, before: Callable[[int], Any]) -> float:
    best = float("inf")
    for i in range(reps):
        before(i)
        gc.collect()
        start = time.perf_counter()
        run(i)
        best = min(best, time.perf_counter() - start)
    return best


def bench(work: Path, quick: bool) -> None:
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule
    from torchrl.checkpoint import Checkpoint
    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    from tdckpt.torchrl import TdckptStorageCheckpointer, save, use_tdckpt

    n = 100_000 if quick else 1_000_000
    reps = 2 if quick else 3
    g = torch.Generator().manual_seed(0)
    data = TensorDict(
        {
            "obs": torch.randn(n, 8, generator=g),
            "action": torch.randint(0, 4, (n, 1), generator=g),
            "next": {
                "obs": torch.randn(n, 8, generator=g),
                "reward": torch.randn(n, 1, generator=g),
                "done": torch.zeros(n, 1, dtype=torch.bool),
            },
        },
        batch_size=[n],
    )

    def policy() -> Any:
        net = torch.nn.Sequential(
            torch.nn.Linear(8, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
            torch.nn.ReLU(), torch.nn.Linear(512, 4),
        )  # fmt: skip
        return TensorDictModule(net, in_keys=["obs"], out_keys=["logits"])

    def buffer(name: str, tdckpt: bool) -> Any:
        storage = LazyMemmapStorage(n, scratch_dir=work / f"scratch-{name}")
        checkpointer = TdckptStorageCheckpointer() if tdckpt else None
        return ReplayBuffer(storage=storage, checkpointer=checkpointer)

    src_policy = policy()
    plain_rb, ours_rb = buffer("plain", False), buffer("ours", True)
    plain_rb.extend(data)
    ours_rb.extend(data)
    nbytes = sum(t.numel() * t.element_size() for t in data.values(True, True))
    params = sum(p.numel() for p in src_policy.parameters())
    print(f"torchrl: {n} transitions ({nbytes / 2**20:.0f} MiB), a policy of {params} parameters")

    plain_ckpt = Checkpoint(policy=src_policy, buffer=plain_rb)
    ours_ckpt = use_tdckpt(Checkpoint(policy=src_policy, buffer=ours_rb))

    def clean(_: int) -> None:
        for p in work.glob("ckpt-*"):
            shutil.rmtree(p)
        os.sync()

    def plain_save(i: int) -> None:
        path = plain_ckpt.save(work / f"ckpt-plain-{i}")
        _fsync_tree(path)

    def ours_save(i: int) -> None:
        save(ours_ckpt, work / f"ckpt-ours-{i}")  # TorchRL's manifest and renames synced too

    base = _best(plain_save, reps, clean)
    ours = _best(ours_save, reps, clean)
    print(
        f"  {'save (+fsync for torchrl)':<28} torchrl {base * 1e3:10.1f} ms   "
        f"tdckpt {ours * 1e3:10.1f} ms   ratio {ours / base:5.2f}  (target <= 1.20)"
    )

    plain_path = plain_ckpt.save(work / "load-plain")
    ours_path = ours_ckpt.save(work / "load-ours")
    targets: dict[str, Any] = {}

    def fresh(tdckpt: bool) -> Callable[[int], None]:
        def make(i: int) -> None:
            name = f"{'ours' if tdckpt else 'plain'}-load-{i}"
            rb = buffer(name, tdckpt)
            ckpt = Checkpoint(policy=policy(), buffer=rb)
            targets["ckpt"] = use_tdckpt(ckpt) if tdckpt else ckpt

        return make

    base = _best(lambda _: targets["ckpt"].load(plain_path), reps, fresh(False))
    assert len(targets["ckpt"].components["buffer"]) == n
    ours = _best(lambda _: targets["ckpt"].load(ours_path), reps, fresh(True))
    assert len(targets["ckpt"].components["buffer"]) == n
    print(
        f"  {'load (tdckpt verifies)':<28} torchrl {base * 1e3:10.1f} ms   "
        f"tdckpt {ours * 1e3:10.1f} ms   ratio {ours / base:5.2f}  (target <= 1.00)"
    )
