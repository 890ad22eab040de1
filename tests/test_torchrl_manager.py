"""A TorchRL ``Checkpoint``'s components through ``tdckpt.CheckpointManager``.

``mgr.save(step, training_state(ckpt))`` and ``restore_checkpoint(mgr, ckpt)``: steps,
verify and the all-or-nothing training-state restore for the objects a TorchRL user
registers (a policy, Adam, ``GlobalRNGState``, a replay buffer, a JSON config), with
TorchRL's ``CheckpointLoadResult`` as the report. Runs in the ``tests-0.14`` session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchrl.checkpoint", reason="torchrl: the tests-0.14 session")

from tensordict import TensorDict
from torchrl.checkpoint import Checkpoint, GlobalRNGState
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer

import tdckpt
from tdckpt.errors import IntegrityError, RestoreError
from tdckpt.torchrl import JSONComponent, restore_checkpoint, training_state


def _objects(tmp: Path, name: str, kind: str, seed: int) -> Checkpoint:
    torch.manual_seed(seed)
    policy = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    optim = torch.optim.Adam(policy.parameters(), lr=1e-2)
    policy(torch.randn(2, 3)).sum().backward()
    optim.step()
    storage: Any = (
        LazyMemmapStorage(16, scratch_dir=tmp / f"scratch-{name}")
        if kind == "memmap"
        else LazyTensorStorage(16)
    )
    buffer = ReplayBuffer(storage=storage)
    g = torch.Generator().manual_seed(seed)
    rows = 5 if seed == 0 else 1
    buffer.extend(TensorDict(obs=torch.randn(rows, 3, generator=g), batch_size=[rows]))
    return Checkpoint(
        policy=policy, optim=optim, rng=GlobalRNGState(), buffer=buffer, config={"lr": seed}
    )


@pytest.fixture(params=["memmap", "tensor"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_save_and_restore_through_the_manager(tmp_path: Path, kind: str) -> None:
    source = _objects(tmp_path, "s", kind, seed=0)
    state = training_state(source)
    assert (
        isinstance(state["config"], JSONComponent)
        and state["policy"] is source.components["policy"]
    )
    with tdckpt.CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(10, state)
        expected = torch.randn(3)  # drawn after the save: the restore brings this draw back
        assert mgr.verify(10).ok
        target = _objects(tmp_path, "t", kind, seed=1)
        config = target.components["config"]
        result = restore_checkpoint(
            mgr, target, components=["policy", "optim", "rng", "buffer", "config"]
        )
    assert result.loaded == {"policy", "optim", "rng", "buffer", "config"}
    assert result.unrequested == set()
    assert result.values == {"config": {"lr": 0}} and config == {"lr": 0}  # in place
    assert torch.equal(torch.randn(3), expected)
    src, dst = source.components, target.components
    for (k, v), w in zip(
        src["policy"].state_dict().items(), dst["policy"].state_dict().values(), strict=True
    ):
        assert torch.equal(v, w), k
    assert len(dst["buffer"]) == 5 and (dst["buffer"][:5] == src["buffer"][:5]).all()
    assert (
        dst["optim"].state_dict()["state"][0]["step"]
        == src["optim"].state_dict()["state"][0]["step"]
    )


def test_a_subset_reports_the_rest_as_unrequested(tmp_path: Path) -> None:
    source = _objects(tmp_path, "s", "tensor", seed=0)
    with tdckpt.CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, training_state(source))
        target = _objects(tmp_path, "t", "tensor", seed=1)
        result = restore_checkpoint(mgr, target, components=["policy"])
    assert result.loaded == {"policy"} and result.unrequested == {
        "optim",
        "rng",
        "buffer",
        "config",
    }


def test_a_damaged_step_changes_nothing(tmp_path: Path) -> None:
    source = _objects(tmp_path, "s", "tensor", seed=0)
    with tdckpt.CheckpointManager(tmp_path / "root") as mgr:
        path = mgr.save(1, training_state(source))
        leaf = max(path.rglob("*.memmap"), key=lambda p: p.stat().st_size)
        data = bytearray(leaf.read_bytes())
        data[1] ^= 0x20
        leaf.write_bytes(bytes(data))
        target = _objects(tmp_path, "t", "tensor", seed=1)
        before = {k: v.clone() for k, v in target.components["policy"].state_dict().items()}
        with pytest.raises(IntegrityError, match=leaf.name):
            restore_checkpoint(mgr, target, components=["policy", "buffer", "config"])
        missing = Checkpoint(policy=target.components["policy"], other={"a": 1})
        with pytest.raises(RestoreError, match="'other'"):
            restore_checkpoint(mgr, missing, verify=False)
    after = target.components["policy"].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert target.components["config"] == {"lr": 1} and len(target.components["buffer"]) == 1
