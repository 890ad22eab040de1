"""A training state (module + optimizer) through an object-storage root (memory://)."""

from __future__ import annotations

import uuid

import pytest
import torch

from tdckpt import CheckpointManager

pytest.importorskip("fsspec")  # the [remote] extra; the [test] extra installs it


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_a_training_state_round_trips_through_memory_url() -> None:
    root = f"memory://tdckpt-state-{uuid.uuid4().hex}"
    model, opt = _model()
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "optim": opt})
        assert mgr.steps() == [1]
        assert mgr.verify(1).ok
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1.0)
    with CheckpointManager(root) as mgr:
        mgr.restore_into({"model": fresh, "optim": fresh_opt})
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    saved, restored = opt.state_dict(), fresh_opt.state_dict()
    assert saved["param_groups"] == restored["param_groups"]
    for pid, state in saved["state"].items():
        for name, value in state.items():
            assert torch.equal(value, restored["state"][pid][name]), (pid, name)


def test_save_async_to_an_object_store_commits_the_values_at_the_call() -> None:
    from tensordict import TensorDict

    root = f"memory://tdckpt-state-{uuid.uuid4().hex}"
    model, opt = _model()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    td = TensorDict(x=torch.arange(6.0), meta={"note": [1, 2]})
    with CheckpointManager(root) as mgr:
        future = mgr.save_async(1, {"model": model, "optim": opt}, metadata={"loss": 0.5})
        with torch.no_grad():  # training goes on in place right after the call
            for p in model.parameters():
                p.add_(1.0)
        second = mgr.save_async(2, td)  # waits for the first, then snapshots td
        td["x"].zero_()
        assert str(future.result(timeout=60)).startswith("memory://")
        second.result(timeout=60)
        assert mgr.steps() == [1, 2]
        assert mgr.metadata(1) == {"loss": 0.5}
        assert mgr.restore(2)["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        fresh, _ = _model()
        mgr.restore_into({"model": fresh}, step=1, strict=False)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, saved[name]), name


def test_save_async_to_an_object_store_refuses_an_existing_step_now() -> None:
    from tensordict import TensorDict

    from tdckpt.errors import CheckpointExistsError

    root = f"memory://tdckpt-state-{uuid.uuid4().hex}"
    with CheckpointManager(root) as mgr:
        mgr.save(1, TensorDict(a=torch.zeros(2)))
        with pytest.raises(CheckpointExistsError, match="step 1 already exists"):
            mgr.save_async(1, TensorDict(a=torch.ones(2)))
        assert mgr.restore(1)["a"].tolist() == [0.0, 0.0]
