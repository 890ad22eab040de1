"""Training helper for the exact-resume test: one small run, or half of one.

``python tests/_state_train_child.py MODE ROOT OUT``:

``full``
    train 20 steps from the seed; write the final parameters and optimizer state to OUT.
``first``
    train 10 steps from the seed; save the training state as step 10 into ROOT.
``full+first``
    both in one process (one interpreter start less), ``full`` first: each builds
    everything from the seed, so neither sees the other's state.
``resume``
    build everything from ANOTHER seed (so nothing but the restore can make it right),
    restore step 10 from ROOT in place, train 10 more steps; write the result to OUT.

The run draws from every generator a resumed run must restore: dropout (torch's CPU
generator), a shuffled sampler with its own torch.Generator (mid-epoch at step 10), noise
from NumPy's global generator and jitter from Python's ``random``; Adam (tensor step
counts) and a StepLR scheduler change the learning rate during the run.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import torch

import tdckpt

BATCH = 8
DATA = 52  # 7 batches an epoch (the last one short): step 10 is inside the second epoch


class ShuffledSampler:
    """A DataLoader-like sampler: a new permutation each epoch, resumable mid-epoch."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self.position = 0
        self.order = torch.randperm(n, generator=self.generator)

    def next_batch(self) -> torch.Tensor:
        if self.position >= self.n:
            self.epoch += 1
            self.position = 0
            self.order = torch.randperm(self.n, generator=self.generator)
        batch = self.order[self.position : self.position + BATCH]
        self.position += BATCH
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "order": self.order.clone(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.order = state["order"].clone()
        self.generator.set_state(state["generator"])


def build(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(32, 3),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    sampler = ShuffledSampler(DATA, seed=seed + 1)
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "sampler": sampler,
        "rng": tdckpt.RandomState(),
    }


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(DATA, 6, generator=g), torch.randint(0, 3, (DATA,), generator=g)


def train(state: dict[str, Any], steps: int) -> None:
    x, y = dataset()
    model, optimizer = state["model"], state["optimizer"]
    model.train()
    for _ in range(steps):
        idx = state["sampler"].next_batch()
        noise = torch.from_numpy(np.random.normal(0, 0.01, size=(len(idx), 6)).astype("float32"))
        scale = 1.0 + random.uniform(-0.1, 0.1)
        loss = torch.nn.functional.cross_entropy(model((x[idx] + noise) * scale), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state["scheduler"].step()


def result(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "params": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "optimizer": state["optimizer"].state_dict(),
        "scheduler": state["scheduler"].state_dict(),
        "next": torch.rand(3),  # the generators too: the next draw must agree
    }


def main() -> None:
    mode, root, out = sys.argv[1:4]
    if mode in ("full", "full+first"):
        state = build(0)
        train(state, 20)
        torch.save(result(state), out)
    if mode in ("first", "full+first"):  # build() seeds every generator afresh
        state = build(0)
        train(state, 10)
        with tdckpt.CheckpointManager(root) as mgr:
            mgr.save(10, state, metadata={"step": 10})
    elif mode == "resume":
        state = build(99)
        with tdckpt.CheckpointManager(root) as mgr:
            mgr.restore_into(state, allow_pickle=False)
        train(state, 10)
        torch.save(result(state), out)
    elif mode != "full":
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
